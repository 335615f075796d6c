"""The scaling suite's measured pieces per executor, and the projection each one feeds (issue 30).

    probe      one state dict, workers=1, per round and interleaved: a save alone and a save
               beside one busy Python thread in the caller, with the default executor ("auto"),
               "threads", "processes" and a Saver's workers (the Saver started and saved once
               before the rounds, so every timed Saver save is a second save)
    per run    wall seconds, worker seconds (SaveResult.per_worker, summed: P), phases, executor
    pieces     S = wall - P (serial), F = phases["fork"] (worker start: one fork for processes,
               the Saver's second-save start), G = min(1, busy / alone - 1): the GIL-held share,
               the part of the save slowed by a thread that wants the GIL (an upper bound here:
               on a small machine the busy thread also takes a core)
    model      T(N) = S + max(W(N), G * P)     W(N): scaling.staggered_work_seconds(P, N, F)
               G only caps executors that write in the caller's interpreter (threads, and the
               default where it resolved to threads); speedup = measured wall alone / T(N)

A projection, labelled as one: storage is not the bottleneck, and the inputs are this run's.
"""

from __future__ import annotations

import shutil
import statistics
import threading
import time
from typing import Any

import parallel_dcp
from parallel_dcp.benchmark.scaling import PROJECTED_COUNTS, staggered_work_seconds

__all__ = ["PROBED", "executor_lines", "executor_projections", "probe_executors"]

# "default" is save() with no executor given; "saver" is a Saver's second save.
PROBED = ("default", "threads", "processes", "saver")
_GIL_BOUND = ("threads",)  # executors whose writers share the caller's interpreter
_GiB = 2**30


def _busy(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def _median(values: list[float]) -> float:
    return statistics.median(values)


def probe_executors(state_dict: Any, root: str, rounds: int, sync: bool) -> dict[str, Any]:
    """Medians per executor of a save alone and beside a busy thread (see the module docstring)."""
    alone: dict[str, list[tuple[float, float, dict[str, float], str]]] = {kind: [] for kind in PROBED}
    busy: dict[str, list[float]] = {kind: [] for kind in PROBED}
    out = f"{root}/probe"
    with parallel_dcp.Saver(workers=1) as saver:

        def once(kind: str) -> Any:
            if kind == "saver":
                return saver.save(state_dict, out, sync_files=sync)
            if kind == "default":  # no executor given: what a user gets
                return parallel_dcp.save(state_dict, out, workers=1, sync_files=sync)
            return parallel_dcp.save(state_dict, out, workers=1, sync_files=sync, executor=kind)

        first = once("saver")  # the Saver's first save: it starts its workers
        shutil.rmtree(out)
        for _ in range(max(1, rounds)):
            for kind in PROBED:
                for beside in (False, True):
                    stop = threading.Event()
                    thread = threading.Thread(target=_busy, args=(stop,), daemon=True)
                    if beside:
                        thread.start()
                        time.sleep(0.05)  # busy before the save starts, as a data loader is
                    try:
                        began = time.perf_counter()
                        result = once(kind)
                        wall = time.perf_counter() - began
                    finally:
                        stop.set()
                        if beside:
                            thread.join()
                    shutil.rmtree(out)
                    if beside:
                        busy[kind].append(wall)
                    else:
                        inside = sum(w.seconds for w in result.per_worker)
                        alone[kind].append((wall, inside, dict(result.phases), result.executor))
        start_seconds = saver.start_seconds
    found: dict[str, Any] = {}
    for kind in PROBED:
        runs = alone[kind]
        wall = _median([r[0] for r in runs])
        found[kind] = {
            "executor_used": runs[-1][3],
            "alone_seconds": wall,
            "busy_thread_seconds": _median(busy[kind]),
            "busy_thread_ratio": _median(busy[kind]) / wall if wall > 0 else None,
            "worker_seconds": _median([r[1] for r in runs]),
            "phases": {name: _median([r[2].get(name, 0.0) for r in runs]) for name in runs[0][2]},
        }
    found["saver"]["first_save_start_seconds"] = first.phases.get("fork", 0.0)
    found["saver"]["saver_start_seconds"] = start_seconds
    return found


def executor_projections(probe: dict[str, Any], nbytes: int, keys: int) -> dict[str, Any]:
    """Per probed executor: its pieces per GiB and per key, and the projected speedup at each
    of ``scaling.PROJECTED_COUNTS`` workers."""
    gib, keys = max(nbytes, 1) / _GiB, max(keys, 1)
    found: dict[str, Any] = {}
    for kind, got in probe.items():
        wall, work = got["alone_seconds"], got["worker_seconds"]
        serial = max(0.0, wall - work)
        start = min(got["phases"].get("fork", 0.0), serial)  # S holds the first start
        ratio = got["busy_thread_ratio"]
        share = min(1.0, max(0.0, ratio - 1.0)) if ratio is not None else 0.0
        capped = kind in _GIL_BOUND or (kind == "default" and got["executor_used"] in _GIL_BOUND)
        rows = []
        for count in PROJECTED_COUNTS:
            seconds = serial + max(staggered_work_seconds(work, count, start), share * work if capped else 0.0)
            rows.append(
                {
                    "workers": count,
                    "projected_seconds": seconds,
                    "projected_speedup": wall / seconds if seconds > 0 else None,
                }
            )
        found[kind] = {
            "executor_used": got["executor_used"],
            "measured_seconds_alone": wall,
            "measured_seconds_busy_thread": got["busy_thread_seconds"],
            "serial_seconds": serial,
            "serial_seconds_per_gib": serial / gib,
            "serial_us_per_key": serial / keys * 1e6,
            "worker_seconds": work,
            "worker_seconds_per_gib": work / gib,
            "start_seconds_per_worker": start,
            "start_seconds_per_worker_per_gib": start / gib,
            "gil_held_share": share,
            "gil_capped": capped,
            "rows": rows,
        }
    return found


def _x(rows: list[dict[str, Any]], count: int) -> str:
    row = next((r for r in rows if r["workers"] == count), None)
    return f"{row['projected_speedup']:.2f}x" if row and row["projected_speedup"] is not None else "-"


def executor_lines(executors: dict[str, Any], governor: list[dict[str, Any]] | None) -> list[str]:
    """Printed pieces and projection per executor; every projected figure says so."""
    lines = ["PIECES (measured in this run, workers=1, alone and beside one busy Python thread):"]
    for kind, e in executors.items():
        lines.append(
            f"  {kind} ({e['executor_used']}): alone {e['measured_seconds_alone']:.3f} s, busy thread"
            f" {e['measured_seconds_busy_thread']:.3f} s, GIL-held share {e['gil_held_share']:.2f};"
            f" serial {e['serial_seconds']:.3f} s ({e['serial_seconds_per_gib']:.3f} s/GiB,"
            f" {e['serial_us_per_key']:.1f} us/key), worker {e['worker_seconds_per_gib']:.3f} s/GiB,"
            f" start {e['start_seconds_per_worker'] * 1e3:.1f} ms/worker"
            f" ({e['start_seconds_per_worker_per_gib'] * 1e3:.1f} ms/GiB)"
        )
    for row in governor or []:
        lines.append(
            f"  governor reading at {row['workers']} workers: cheap {row['cheap_ms_per_process']:.3f},"
            f" rollup {row['rollup_ms_per_process']:.3f}, exact {row['exact_ms_per_process']:.3f} ms CPU/process"
        )
    lines.append("  projected speedup per executor (T(N) = S + max(W(N), G*P if GIL-bound); not a measurement):")
    for kind, e in executors.items():
        cap = " (capped by the GIL-held share)" if e["gil_capped"] else ""
        lines.append(
            f"  projected {kind}: x16 {_x(e['rows'], 16)}, x64 {_x(e['rows'], 64)}, x128 {_x(e['rows'], 128)}{cap}"
        )
    return lines
