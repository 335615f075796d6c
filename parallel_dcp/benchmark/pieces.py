"""The scaling suite's measured pieces per executor, and the projection each one feeds (issue 30).

    probe      one state dict, workers=1, per round and interleaved: a save alone, beside one
               busy Python thread in the caller, and beside one busy forked process (the control:
               it takes a core but not the GIL), with the default executor ("auto"), "threads",
               "processes" and a Saver's workers (the Saver started and saved once before the
               rounds, so every timed Saver save is a second save), also with the promise that no
               tensor was relaid in place ("saver_unchanged": ``layout_unchanged=True``)
    per run    wall seconds, worker seconds (SaveResult.per_worker, summed: P), the workers' handling
               of their tasks outside them (``handling_seconds`` + ``handover_seconds``, summed: H:
               taking each task in, pickling its result, sending it into the worker's pipe; the
               hand-over apart in the JSON), phases, executor, the coordinator's own seconds
               inside the write phase (``SaveResult.coordinator_write_seconds``: C, a Saver's; 0
               elsewhere),
               and the slowest worker's per-job seconds (``setup_seconds``: a Saver's worker loading
               the job's shell before its first task; 0 where workers inherit the job)
    pieces     S = wall - P - H (serial; the median of each run's own), in three parts as the code
               runs them: before the first task (phases plan + fork), after the last result
               (wall - plan - fork - write: merge, commit, publish), and the write phase's rest
               (write - P - H: the first hand-off, the last result, what did not overlap); the
               JSON also splits it into the coordinator's phases (plan, fork, merge, commit), the
               per-job part of each worker (paid side by side, so once at any count) and the rest;
               C: the coordinator's work while the workers work (a Saver sends each busy worker
               its next task ahead, so taking results in and handing tasks out overlaps them; on
               a Saver's later save the layout check too: its first tasks go out before it);
               F = phases["fork"] (worker start: one fork for processes, the Saver's second-save
               start),
               G = min(1, (busy thread - busy process) / alone): the GIL-held share, what a
               thread that wants the GIL costs beyond the core it takes
    per task   a Saver's later save again, by a second Saver(workers=1) whose plan is cut into the
               tasks of a save on PER_TASK_PROBE_WORKERS workers (``partition.planned_as_on``):
               its S and C against the first's, per task more, are what one more task costs the
               coordinator (each sent, each result taken in; serial and beside the workers)
    held       each save of a Saver starts by reading the memory of the fork server and every worker
               it holds (its governor's baseline): a Saver(workers=1) and a
               Saver(workers=BASELINE_PROBE_WORKERS), each after two warm-up saves, read it 0.1 s
               after a save, medians of 5; the difference over the workers more is the cost of
               each worker held (``baseline_per_held_worker``)
    model      T(N) = S(N) + max(C(N), W(N), G * (P + H))     W(N): scaling.staggered_work_seconds(P + H, N, F)
               S(N), C(N): S and C plus the per-task costs times the tasks a save on N workers has
               beyond the probe's own (``partition.task_count``: 4 at w=1, 64 at 16 and at 64
               workers for 50,000 small keys), and a Saver's S(N) its baseline's cost of the N - 1
               workers held beyond the probe's one; the non-Saver executors, not probed so, keep S;
               G only caps executors that write in the caller's interpreter (threads, and the
               default where it resolved to threads); speedup = measured wall alone / T(N). C(N)
               leaves out the governor's readings of N processes (``governor`` rows of
               scaling:llm), and each task's costs are measured on one worker, whose results come
               one at a time to a coordinator that slept in between (cold caches: an upper bound).

A projection, labelled as one: storage is not the bottleneck, and the inputs are this run's.

    busy rows  a state dict of more than BUSY_PROBE_KEYS tensors (50,000 small ones) is saved
               alone in full, but beside the busy thread and process on its first BUSY_PROBE_KEYS
               tensors only (alone too, in the same round): writer threads beside a busy thread
               take the GIL back at every record, and the full dict's probe ran past 11 minutes.
               Those busy times are scaled per key, by the full dict's time alone over the
               subset's (G, a ratio, is the subset's), and labelled so in the output and the JSON
               (``busy_probe``: keys probed, of how many, the subset's own seconds, the scale).

Longer than 300 lines because the probe, its per-run pieces and the projection they feed are one
model: every input the projection prints is measured here, next to the formula that uses it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import parallel_dcp
from parallel_dcp.benchmark.scaling import PROJECTED_COUNTS, staggered_work_seconds
from parallel_dcp.benchmark.writers import flat_tensors
from parallel_dcp.engine.partition import ITEM_OVERHEAD_BYTES, planned_as_on, task_count

__all__ = [
    "BASELINE_PROBE_WORKERS",
    "BUSY_PROBE_KEYS",
    "PER_TASK_PROBE_WORKERS",
    "PROBED",
    "baseline_per_held_worker",
    "executor_lines",
    "executor_projections",
    "probe_executors",
]

# "default" is save() with no executor given; "saver" is a Saver's second save; "saver_unchanged"
# the same with Saver.save(layout_unchanged=True).
PROBED = ("default", "threads", "processes", "saver", "saver_unchanged")
_BUSY = ("thread", "process")
_GIL_BOUND = ("threads",)  # executors whose writers share the caller's interpreter
_GiB = 2**30
# Beside a busy thread, a state dict of more tensors than this is probed on this many (see above).
BUSY_PROBE_KEYS = 2000
# A Saver's save is probed a second time cut into the tasks of a save on this many workers (see above).
PER_TASK_PROBE_WORKERS = 64
# The Saver held at this many workers to measure what each worker held adds to a save's baseline.
BASELINE_PROBE_WORKERS = 16


def _busy(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def _median(values: list[float]) -> float:
    return statistics.median(values)


@contextlib.contextmanager
def _beside(mode: str) -> Iterator[None]:
    """Nothing ("alone"), one busy Python thread in this process ("thread": the GIL and a core)
    or one busy forked process ("process": a core only, the control)."""
    if mode == "alone":
        yield
        return
    if mode == "process":
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child spins until it is killed
            try:
                while True:
                    sum(range(1000))
            finally:
                os._exit(0)
        try:
            time.sleep(0.05)  # busy before the save starts, as a data loader is
            yield
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        return
    stop = threading.Event()
    thread = threading.Thread(target=_busy, args=(stop,), daemon=True)
    thread.start()
    try:
        time.sleep(0.05)
        yield
    finally:
        stop.set()
        thread.join()


def probe_executors(state_dict: Any, root: str, rounds: int, sync: bool) -> dict[str, Any]:
    """Medians per executor of a save alone, beside a busy thread and beside a busy process (see
    the module docstring: a state dict of many tensors is probed busy on a subset, scaled per key)."""
    tensors = flat_tensors(state_dict)
    subset = dict(itertools.islice(tensors.items(), BUSY_PROBE_KEYS)) if len(tensors) > BUSY_PROBE_KEYS else None
    alone: dict[str, list[tuple[float, float, dict[str, float], str, float, float, float, float]]] = {
        k: [] for k in PROBED
    }
    busy: dict[tuple[str, str], list[float]] = {(kind, mode): [] for kind in PROBED for mode in _BUSY}
    subset_alone: dict[str, list[float]] = {kind: [] for kind in PROBED}
    # A Saver's later save cut into the tasks of one on PER_TASK_PROBE_WORKERS workers: (wall, P + H, C, tasks).
    cut: list[tuple[float, float, float, int]] = []
    saver_tasks = 0
    out = f"{root}/probe"
    with parallel_dcp.Saver(workers=1) as saver, parallel_dcp.Saver(workers=1) as cut_saver:

        def once(kind: str, sd: Any) -> Any:
            if kind in ("saver", "saver_unchanged"):
                return saver.save(sd, out, sync_files=sync, layout_unchanged=kind == "saver_unchanged")
            if kind == "default":  # no executor given: what a user gets
                return parallel_dcp.save(sd, out, workers=1, sync_files=sync)
            return parallel_dcp.save(sd, out, workers=1, sync_files=sync, executor=kind)

        def timed(kind: str, sd: Any, mode: str) -> tuple[float, Any]:
            with _beside(mode):
                began = time.perf_counter()
                result = once(kind, sd)
                wall = time.perf_counter() - began
            shutil.rmtree(out)
            return wall, result

        def timed_cut() -> tuple[float, float, float, int]:
            with planned_as_on(PER_TASK_PROBE_WORKERS):
                began = time.perf_counter()
                result = cut_saver.save(state_dict, out, sync_files=sync)
                wall = time.perf_counter() - began
            shutil.rmtree(out)
            work = sum(w.seconds + w.handling_seconds + w.handover_seconds for w in result.per_worker)
            return wall, work, result.coordinator_write_seconds or 0.0, result.tasks

        first = once("saver", state_dict)  # the Saver's first save: it starts its workers
        shutil.rmtree(out)
        timed_cut()  # (its first save too)
        for _ in range(max(1, rounds)):
            for kind in PROBED:
                wall, result = timed(kind, state_dict, "alone")
                inside = sum(w.seconds for w in result.per_worker)
                # What a worker spends on the job outside its tasks (a Saver's: loading the job's
                # shell), the slowest worker's: part of the serial seconds at any worker count.
                setup = max((w.setup_seconds for w in result.per_worker), default=0.0)
                handling = sum(w.handling_seconds for w in result.per_worker)
                handover = sum(w.handover_seconds for w in result.per_worker)
                streamed = result.coordinator_write_seconds or 0.0
                alone[kind].append(
                    (wall, inside, dict(result.phases), result.executor, setup, handling + handover, streamed, handover)
                )
                if kind == "saver":
                    saver_tasks = result.tasks
                    cut.append(timed_cut())
                if subset is not None:
                    subset_alone[kind].append(timed(kind, subset, "alone")[0])
                for mode in _BUSY:
                    busy[(kind, mode)].append(timed(kind, subset if subset is not None else state_dict, mode)[0])
        start_seconds = saver.start_seconds
    found: dict[str, Any] = {}
    for kind in PROBED:
        runs = alone[kind]
        wall = _median([r[0] for r in runs])
        thread, process = _median(busy[(kind, "thread")]), _median(busy[(kind, "process")])
        scale = 1.0
        if subset is not None:
            scale = wall / _median(subset_alone[kind])
        found[kind] = {
            "executor_used": runs[-1][3],
            "alone_seconds": wall,
            "busy_thread_seconds": thread * scale,
            "busy_process_seconds": process * scale,
            "worker_seconds": _median([r[1] for r in runs]),
            "worker_handling_seconds": _median([r[5] for r in runs]),
            "worker_handover_seconds": _median([r[7] for r in runs]),
            "coordinator_write_seconds": _median([r[6] for r in runs]),
            # Each run's own wall - P - H: the median of the differences, not the difference of the
            # medians (the worker part varies from run to run by more than S is).
            "serial_seconds": _median([max(0.0, r[0] - r[1] - r[5]) for r in runs]),
            "serial_before_seconds": _median([r[2]["plan"] + r[2]["fork"] for r in runs]),
            "serial_after_seconds": _median(
                [max(0.0, r[0] - r[2]["plan"] - r[2]["fork"] - r[2]["write"]) for r in runs]
            ),
            "worker_job_seconds": _median([r[4] for r in runs]),
            "phases": {name: _median([r[2].get(name, 0.0) for r in runs]) for name in runs[0][2]},
        }
        if subset is not None:
            found[kind]["busy_probe"] = {
                "keys": len(subset),
                "of_keys": len(tensors),
                "alone_seconds": _median(subset_alone[kind]),
                "busy_thread_seconds": thread,
                "busy_process_seconds": process,
                "scale": scale,
            }
    found["saver"]["first_save_start_seconds"] = first.phases.get("fork", 0.0)
    found["saver"]["saver_start_seconds"] = start_seconds
    per_task = {
        "as_on_workers": PER_TASK_PROBE_WORKERS,
        "tasks": int(_median([float(r[3]) for r in cut])),
        "serial_seconds": _median([max(0.0, r[0] - r[1]) for r in cut]),
        "coordinator_write_seconds": _median([r[2] for r in cut]),
        # What it is set against: the Saver's own save (without the promise, as the cut one), so
        # that saver_unchanged, which checks less, takes the same per-task costs.
        "own_serial_seconds": found["saver"]["serial_seconds"],
        "own_coordinator_write_seconds": found["saver"]["coordinator_write_seconds"],
    }
    held = baseline_per_held_worker(root)
    for kind in ("saver", "saver_unchanged"):
        found[kind]["tasks"] = saver_tasks
        found[kind]["cut_like_many_workers"] = per_task
        found[kind]["baseline_per_held_worker"] = held
    return found


def baseline_per_held_worker(root: str, many: int | None = None, reps: int = 5) -> dict[str, Any]:
    """What a Saver save's baseline reading costs for each worker the Saver holds: the median
    reading (0.1 s after a save, as between checkpoints) with one worker held and with ``many``
    (default BASELINE_PROBE_WORKERS), each Saver after two warm-up saves (their workers' first
    reports read them in full)."""
    import torch

    many = many or BASELINE_PROBE_WORKERS

    state = {f"t{i}": torch.zeros(1 << 14) for i in range(4 * many)}  # a task for every worker
    out = f"{root}/held"
    seconds: list[float] = []
    for workers in (1, many):
        readings = []
        with parallel_dcp.Saver(workers=workers) as saver:
            for round_ in range(reps + 2):
                saver.save(state, out, sync_files=False)
                shutil.rmtree(out)
                time.sleep(0.1)
                reading = saver._live().baseline_seconds()
                if round_ >= 2:
                    readings.append(reading)
        seconds.append(_median(readings))
    return {
        "workers": [1, many],
        "baseline_seconds": seconds,
        "seconds_per_held_worker": max(0.0, seconds[1] - seconds[0]) / (many - 1),
    }


def executor_projections(probe: dict[str, Any], nbytes: int, keys: int) -> dict[str, Any]:
    """Per probed executor: its pieces per GiB and per key, and the projected speedup at each
    of ``scaling.PROJECTED_COUNTS`` workers."""
    gib, keys = max(nbytes, 1) / _GiB, max(keys, 1)
    found: dict[str, Any] = {}
    for kind, got in probe.items():
        # The workers' handling of their tasks (taking each in, pickling its result) runs in each
        # worker beside the others': parallel, as the tasks are.
        handling = got.get("worker_handling_seconds", 0.0)
        wall, work = got["alone_seconds"], got["worker_seconds"] + handling
        serial = got.get("serial_seconds", max(0.0, wall - work))
        streamed = got.get("coordinator_write_seconds", 0.0)
        start = min(got["phases"].get("fork", 0.0), serial)  # S holds the first start
        # S = wall - P, split: the coordinator's own phases, each worker's per-job part (in
        # parallel, so counted once), and the rest (dispatch, results, waits between them).
        phases = got["phases"]
        coordinator = sum(phases.get(name, 0.0) for name in ("plan", "fork", "merge", "commit"))
        per_job = got.get("worker_job_seconds", 0.0)
        before = got.get("serial_before_seconds", phases.get("plan", 0.0) + phases.get("fork", 0.0))
        after = got.get("serial_after_seconds", phases.get("merge", 0.0) + phases.get("commit", 0.0))
        # What the busy thread costs beyond the busy process's core: the GIL's part.
        extra = got["busy_thread_seconds"] - got["busy_process_seconds"]
        share = min(1.0, max(0.0, extra / wall)) if wall > 0 else 0.0
        capped = kind in _GIL_BOUND or (kind == "default" and got["executor_used"] in _GIL_BOUND)
        per_task = _per_task(got, serial, streamed)
        held = got.get("baseline_per_held_worker", {}).get("seconds_per_held_worker", 0.0)
        total = nbytes + ITEM_OVERHEAD_BYTES * keys  # partition's cost of the whole job
        rows = []
        for count in PROJECTED_COUNTS:
            # A save on more workers has more tasks, each sent and its result taken in by the one
            # coordinator: what the probe cut like many workers measured per task is added.
            tasks = task_count(total, count, keys)
            more = max(0, tasks - per_task["tasks_measured"]) if per_task else 0
            serial_at = serial + more * per_task["serial_seconds_per_task"] if per_task else serial
            serial_at += (count - 1) * held  # a Saver's baseline reads every worker it holds
            streamed_at = streamed + more * per_task["coordinator_seconds_per_task"] if per_task else streamed
            seconds = serial_at + max(
                streamed_at, staggered_work_seconds(work, count, start), share * work if capped else 0.0
            )
            rows.append(
                {
                    "workers": count,
                    "tasks": tasks,
                    "serial_seconds": serial_at,
                    "coordinator_write_seconds": streamed_at,
                    "projected_seconds": seconds,
                    "projected_speedup": wall / seconds if seconds > 0 else None,
                }
            )
        found[kind] = {
            "executor_used": got["executor_used"],
            "measured_seconds_alone": wall,
            "measured_seconds_busy_thread": got["busy_thread_seconds"],
            "measured_seconds_busy_process": got["busy_process_seconds"],
            "serial_seconds": serial,
            "serial_seconds_per_gib": serial / gib,
            "serial_us_per_key": serial / keys * 1e6,
            "serial_parts": {
                "coordinator_phases_seconds": coordinator,
                "worker_job_seconds": per_job,
                "other_seconds": serial - coordinator - per_job,
                # The same seconds by where they fall: before the first task, after the last
                # result, and the write phase's rest.
                "before_first_task_seconds": before,
                "after_last_result_seconds": after,
                "write_rest_seconds": serial - before - after,
            },
            "coordinator_write_seconds": streamed,
            "coordinator_write_us_per_key": streamed / keys * 1e6,
            "worker_handling_seconds": handling,
            "worker_handover_seconds": got.get("worker_handover_seconds", 0.0),  # (within the handling)
            "worker_task_seconds": got["worker_seconds"],
            "worker_seconds": work,  # the parallel part: inside the tasks and handling them
            "worker_seconds_per_gib": work / gib,
            "start_seconds_per_worker": start,
            "start_seconds_per_worker_per_gib": start / gib,
            "gil_held_share": share,
            "gil_capped": capped,
            "rows": rows,
        }
        if "busy_probe" in got:  # the busy rows were probed on a subset, scaled per key
            found[kind]["busy_probe"] = got["busy_probe"]
        if per_task:
            found[kind]["per_task"] = per_task
        if "baseline_per_held_worker" in got:
            found[kind]["baseline_per_held_worker"] = got["baseline_per_held_worker"]
    return found


def _per_task(got: dict[str, Any], serial: float, streamed: float) -> dict[str, Any] | None:
    """What one more task costs the coordinator, serial and beside the workers: the probe's save cut
    like many workers against the same save in its own tasks (the plain Saver's, where the probe
    gives it; else this executor's ``serial`` and ``streamed``), per task more (none below 0:
    noise); None where the probe made no such save or it had no more tasks."""
    cut = got.get("cut_like_many_workers")
    measured = got.get("tasks") or 0
    if not cut or cut["tasks"] <= measured:
        return None
    more = cut["tasks"] - measured
    serial = cut.get("own_serial_seconds", serial)
    streamed = cut.get("own_coordinator_write_seconds", streamed)
    return {
        "tasks_measured": measured,
        "tasks_cut": cut["tasks"],
        "cut_as_on_workers": cut["as_on_workers"],
        "serial_seconds_per_task": max(0.0, cut["serial_seconds"] - serial) / more,
        "coordinator_seconds_per_task": max(0.0, cut["coordinator_write_seconds"] - streamed) / more,
    }


def _tasks(rows: list[dict[str, Any]], count: int) -> str:
    return str(next((r["tasks"] for r in rows if r["workers"] == count), "-"))


def _x(rows: list[dict[str, Any]], count: int) -> str:
    row = next((r for r in rows if r["workers"] == count), None)
    return f"{row['projected_speedup']:.2f}x" if row and row["projected_speedup"] is not None else "-"


def executor_lines(executors: dict[str, Any], governor: list[dict[str, Any]] | None) -> list[str]:
    """Printed pieces and projection per executor; every projected figure says so."""
    lines = ["PIECES (measured in this run, workers=1: alone, beside one busy Python thread, beside one busy process):"]
    for kind, e in executors.items():
        parts = e["serial_parts"]
        if "busy_probe" in e:
            sub = e["busy_probe"]
            lines.append(
                f"  {kind}: busy rows probed on {sub['keys']:,} of {sub['of_keys']:,} tensors (alone"
                f" {sub['alone_seconds']:.3f} s, busy thread {sub['busy_thread_seconds']:.3f} s, busy process"
                f" {sub['busy_process_seconds']:.3f} s), scaled per key by {sub['scale']:.2f} below"
            )
        lines.append(
            f"  {kind} ({e['executor_used']}): alone {e['measured_seconds_alone']:.3f} s, busy thread"
            f" {e['measured_seconds_busy_thread']:.3f} s, busy process {e['measured_seconds_busy_process']:.3f} s,"
            f" GIL-held share {e['gil_held_share']:.2f};"
            f" serial {e['serial_seconds']:.3f} s ({e['serial_seconds_per_gib']:.3f} s/GiB,"
            f" {e['serial_us_per_key']:.1f} us/key: coordinator phases {parts['coordinator_phases_seconds']:.3f},"
            f" per-job in each worker {parts['worker_job_seconds']:.3f}, other {parts['other_seconds']:.3f};"
            f" before the first task {parts['before_first_task_seconds']:.3f}, write rest"
            f" {parts['write_rest_seconds']:.3f}, after the last result {parts['after_last_result_seconds']:.3f}),"
            f" coordinator beside the workers {e['coordinator_write_seconds']:.3f} s"
            f" ({e['coordinator_write_us_per_key']:.1f} us/key),"
            f" workers' task handling {e['worker_handling_seconds']:.3f} s"
            f" (of which handing results over {e.get('worker_handover_seconds', 0.0):.3f}),"
            f" worker {e['worker_seconds_per_gib']:.3f} s/GiB,"
            f" start {e['start_seconds_per_worker'] * 1e3:.1f} ms/worker"
            f" ({e['start_seconds_per_worker_per_gib'] * 1e3:.1f} ms/GiB)"
        )
    for kind, e in executors.items():
        if "baseline_per_held_worker" in e:
            b = e["baseline_per_held_worker"]
            lines.append(
                f"    {kind}: its baseline reading {b['baseline_seconds'][0] * 1e3:.2f} ms with 1 worker held,"
                f" {b['baseline_seconds'][1] * 1e3:.2f} ms with {b['workers'][1]}:"
                f" {b['seconds_per_held_worker'] * 1e6:.0f} us a worker held, in S(N)"
            )
        if "per_task" in e:
            t = e["per_task"]
            lines.append(
                f"  {kind}: per task beyond its own {t['tasks_measured']} (cut into {t['tasks_cut']}, as on"
                f" {t['cut_as_on_workers']} workers): serial {t['serial_seconds_per_task'] * 1e3:.3f} ms,"
                f" coordinator beside the workers {t['coordinator_seconds_per_task'] * 1e3:.3f} ms"
                f" (tasks at 16 / 64 / 128 workers: {_tasks(e['rows'], 16)} / {_tasks(e['rows'], 64)}"
                f" / {_tasks(e['rows'], 128)})"
            )
    for row in governor or []:
        lines.append(
            f"  governor reading at {row['workers']} workers: cheap {row['cheap_ms_per_process']:.3f},"
            f" all moved {row['moved_ms_per_process']:.3f} ({row['moved_reads_per_reading']:g} rolled up),"
            f" every rollup {row['rollup_ms_per_process']:.3f}, exact {row['exact_ms_per_process']:.3f} ms CPU/process"
        )
    lines.append("  projected speedup per executor (T(N) = S + max(C, W(N), G*(P+H) if GIL-bound); not a measurement):")
    for kind, e in executors.items():
        cap = " (capped by the GIL-held share)" if e["gil_capped"] else ""
        lines.append(
            f"  projected {kind}: x16 {_x(e['rows'], 16)}, x64 {_x(e['rows'], 64)}, x128 {_x(e['rows'], 128)}{cap}"
        )
    return lines
