"""``--suite scaling``: measure a save's serial and parallel parts, and project them to big nodes.

    measured   parallel_dcp.save w=1, w=2, ... (forked workers), interleaved with the limits:
               wall seconds T(w); per run, from SaveResult: the seconds inside workers' tasks
               (summed over workers: P) and the bytes written (B)
    model      S = T(1) - P(1)          what the coordinator does alone (plan, fork, dispatch,
                                        unpickling results, merge, .metadata, manifest, publish)
               F = seconds to fork one worker (the median fork phase, which holds the first fork):
                   the coordinator forks its workers one after another (each fork copies the
                   page tables of everything it holds), the first before any task, each other
                   one when a task waits and every started worker is busy, so worker i starts
                   working i * F after the first
               W(N) = the time in which N such workers get P(1) worker-seconds done:
                      sum over i < N of max(0, W - i * F) = P(1)
               T(N) = S + W(N)       (S holds the first fork)     (storage not the bottleneck)
               T_capped(N) = S + max(W(N), B / plain-write rate)      (this machine's storage)
    printed    the projected speedup T(1) / T(N) at 1, 2, 8, 16, 32, 64, 128 beside the measured
               T(1) / T(w): a projection, labelled as one, never a measurement.

Forked workers are used at every count (no writer threads): processes are what scales on a
node with many cores; threads share one interpreter.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import parallel_dcp
from parallel_dcp.benchmark.measure import Case, Measured

__all__ = ["PROJECTED_COUNTS", "Samples", "project", "projection_lines", "scaling_cases", "staggered_work_seconds"]

PROJECTED_COUNTS = (1, 2, 8, 16, 32, 64, 128)


@dataclass(slots=True)
class Samples:
    """Per worker count: one (wall, worker seconds, bytes, phases) per timed run."""

    runs: dict[int, list[tuple[float, float, int, dict[str, float]]]] = field(default_factory=dict)


def scaling_cases(state_dict: Any, workers: list[int], sync: bool) -> tuple[list[Case], Samples]:
    """The parallel_dcp cases of the suite; their runs fill the returned :class:`Samples`."""
    samples = Samples()

    def case(count: int) -> Case:
        def run(out: str) -> dict[str, Any]:
            result = parallel_dcp.save(state_dict, out, workers=count, sync_files=sync, executor="processes")
            inside = sum(w.seconds for w in result.per_worker)
            samples.runs.setdefault(count, []).append((result.seconds, inside, result.bytes, dict(result.phases)))
            return {"workers_used": result.workers, "tasks": result.tasks, "executor": result.executor}

        return Case(
            name=f"parallel_dcp w={count} processes",
            family="parallel_dcp processes",
            procs=count,
            run=run,
            limit=f"plain write x{count}",
        )

    return [case(count) for count in workers], samples


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def staggered_work_seconds(work: float, workers: int, fork: float) -> float:
    """The W in which ``workers`` workers, the i-th starting ``i * fork`` after the first, get
    ``work`` worker-seconds done (W = work / workers when forks cost nothing)."""
    if work <= 0:
        return 0.0
    low, high = 0.0, work + workers * fork
    for _ in range(60):  # bisection: the sum grows with W
        mid = (low + high) / 2
        if sum(max(0.0, mid - i * fork) for i in range(workers)) >= work:
            high = mid
        else:
            low = mid
    return high


def project(samples: Samples, measured: list[Measured], warmup: int, keys: int) -> dict[str, Any]:
    """The model's inputs (medians of the timed runs) and its projection; empty without a w=1 run."""
    runs = {count: found[warmup:] or found for count, found in samples.runs.items()}
    if not runs.get(1):
        return {}
    walls = {count: _median([r[0] for r in found]) for count, found in runs.items()}
    inside = _median([r[1] for r in runs[1]])
    nbytes = int(_median([float(r[2]) for r in runs[1]]))
    serial = max(0.0, walls[1] - inside)
    phases = {
        count: {name: _median([r[3].get(name, 0.0) for r in found]) for name in runs[1][0][3]}
        for count, found in runs.items()
    }
    plain = {m.case.procs: _median(m.walls) for m in measured if m.case.family == "plain write" and m.walls}
    memcpy = [_median(m.walls) for m in measured if m.case.family == "memcpy" and m.walls]
    storage_rate = max((nbytes / s for s in plain.values() if s > 0), default=0.0)
    # The fork phase holds the first worker's fork and measuring it (the others fork during the
    # write): an upper bound on one fork.
    fork = _median([phases[count]["fork"] for count in phases]) if phases and "fork" in runs[1][0][3] else 0.0
    fork = min(fork, serial)
    rows = []
    for count in sorted(set(PROJECTED_COUNTS) | set(walls)):
        work = staggered_work_seconds(inside, count, fork)
        model = serial + work
        capped = serial + max(work, nbytes / storage_rate if storage_rate else 0.0)
        rows.append(
            {
                "workers": count,
                "projected_seconds": model,
                "projected_speedup": walls[1] / model if model > 0 else None,
                "projected_capped_speedup": walls[1] / capped if capped > 0 else None,
                "measured_seconds": walls.get(count),
                "measured_speedup": walls[1] / walls[count] if count in walls and walls[count] > 0 else None,
            }
        )
    return {
        "model": "T(N) = S + W(N), W: sum over i<N of max(0, W - i*F) = P (worker i starts i*F late);"
        " capped: S + max(W(N), B/plain-write rate); speedup = T(1) measured / T(N)",
        "serial_seconds": serial,
        "fork_seconds_per_worker": fork,
        "keys": keys,
        "serial_us_per_key": serial / max(keys, 1) * 1e6,
        "parallel_worker_seconds": inside,
        "bytes": nbytes,
        "per_worker_bytes_per_second": nbytes / inside if inside > 0 else None,
        "storage_bytes_per_second": storage_rate or None,
        "memcpy_bytes_per_second": nbytes / memcpy[0] if memcpy and memcpy[0] > 0 else None,
        "phases": phases,
        "rows": rows,
    }


def _gibs(rate: float | None) -> str:
    return f"{rate / 2**30:.2f} GiB/s" if rate else "-"


def _num(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def projection_lines(projection: dict[str, Any]) -> list[str]:
    """The projection table with its model and measured inputs."""
    if not projection:
        return ["projection: no w=1 run was measured, nothing to project"]
    serial = projection["serial_seconds"]
    lines = [
        "PROJECTION (a model fed with this run's measurements, not a measurement):",
        f"  model: {projection['model']}",
        f"  inputs: S = {serial:.3f} s serial ({projection['serial_us_per_key']:.1f} us/key over"
        f" {projection['keys']:,} keys), F = {projection['fork_seconds_per_worker']:.3f} s to fork each worker,"
        f" P = {projection['parallel_worker_seconds']:.3f} worker-seconds for {projection['bytes'] / 2**20:.0f} MiB"
        f" ({_gibs(projection['per_worker_bytes_per_second'])} a worker),"
        f" storage {_gibs(projection['storage_bytes_per_second'])} (best plain write),"
        f" memcpy {_gibs(projection['memcpy_bytes_per_second'])} (one process)",
        "  phases at w=1 (s): " + ", ".join(f"{k} {v:.3f}" for k, v in projection["phases"].get(1, {}).items()),
        f"  {'workers':>7}  {'projected s':>11}  {'projected x':>11}  {'capped x':>8}"
        f"  {'measured s':>10}  {'measured x':>10}",
    ]
    for row in projection["rows"]:
        lines.append(
            f"  {row['workers']:>7}  {_num(row['projected_seconds'], '11.3f')}"
            f"  {_num(row['projected_speedup'], '10.2f')}x  {_num(row['projected_capped_speedup'], '7.2f')}x"
            f"  {_num(row['measured_seconds'], '10.3f')}  "
            + (f"{row['measured_speedup']:9.2f}x" if row["measured_speedup"] is not None else f"{'-':>10}")
        )
    lines.append("  capped x: the write part no faster than this machine's storage (plain write) allows")
    return lines
