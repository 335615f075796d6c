"""A/B of the coordinator's CPU per loop pass of `WorkerPool.run` at many workers, between two trees (issue 30).

Usage: flock LOCK python bench/bench_pool_pass_ab.py TREE_A TREE_B [REPS [WORKERS [saver KEYS SAVER_WORKERS]]]
    REPS (default 5): processes per tree, A and B taking turns (B first every other round)
    WORKERS (default 64): the pool's workers (all forked before the first run; oversubscribed on a small VM: fine,
        the coordinator's thread CPU is what is measured)
    saver KEYS SAVER_WORKERS: also a `Saver(workers=SAVER_WORKERS)`'s later saves of `synthetic.many_small(KEYS)` to
        tmpfs, the coordinator thread's CPU a save

Each process imports its tree's code (PYTHONPATH=TREE) and runs this script with ``--one``: one
`WorkerPool(WORKERS)` runs WORKERS and 10 x WORKERS tasks (each sleeps 5-35 ms in its worker, staggered), with a
`MemoryGovernor` (a 64 GiB ceiling: it samples, never refuses) and an ``on_tick`` that counts the loop's passes
(it is called once a pass), plain (``run(tasks)``) and as a Saver's pool does (``run(handler=)``: each busy worker
is sent its next task ahead), 2 warm-up runs then 7 measured, medians; the coordinator thread's CPU
(``time.thread_time``: what a shared VM does not inflate as it does wall time) per run, per pass, and per pass
less the CPU of taking the results in (`WorkerPool._receive`, the same code in both trees). Prints the median
over the processes of each one's medians, A then B.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any


def _sleep(task: Any) -> int:
    # 5-35 ms, staggered: the replies come a few at a time, so most passes take in one or two.
    time.sleep(0.005 * (1 + task.index % 7))
    return task.index


def one(workers: int, saver: tuple[int, int] | None) -> None:
    from parallel_dcp.engine.memory import MemoryGovernor
    from parallel_dcp.engine.partition import Task
    from parallel_dcp.engine.pool import WorkerPool

    warnings.filterwarnings("ignore")
    rows: dict[str, list[float]] = {}
    # Taking each result in (the same code in both trees: the rest of a pass is the loop's own).
    taking = [0.0]
    receive = WorkerPool._receive

    def timed(pool: Any, *args: Any) -> Any:
        cpu = time.thread_time()
        try:
            return receive(pool, *args)
        finally:
            taking[0] += time.thread_time() - cpu

    WorkerPool._receive = timed  # type: ignore[method-assign]
    with WorkerPool(workers, _sleep) as pool:
        for count in (workers, 10 * workers):
            tasks = [Task(index=i, keys=(f"k{i}",), nbytes=1) for i in range(count)]
            for how in ("plain", "ahead"):
                for n in range(9):
                    passes = [0]

                    def tick(passes: list[int] = passes) -> None:
                        passes[0] += 1

                    governor = MemoryGovernor(64 << 30)
                    taking[0] = 0.0
                    cpu = time.thread_time()
                    handler = _sleep if how == "ahead" else None
                    got = list(pool.run(tasks, governor=governor, on_tick=tick, handler=handler))
                    cpu = time.thread_time() - cpu
                    assert sorted(r.value for r in got) == list(range(count))
                    if n < 2:
                        continue
                    label = f"{count} tasks, {how}"
                    rows.setdefault(f"{label}: CPU a run (ms)", []).append(cpu * 1e3)
                    rows.setdefault(f"{label}: passes", []).append(passes[0])
                    rows.setdefault(f"{label}: CPU a pass (us)", []).append(cpu / passes[0] * 1e6)
                    rows.setdefault(f"{label}: CPU a pass outside taking results in (us)", []).append(
                        (cpu - taking[0]) / passes[0] * 1e6
                    )
    if saver is not None:
        import parallel_dcp
        from parallel_dcp.synthetic import many_small

        keys, saver_workers = saver
        sd = many_small(keys)
        root = tempfile.mkdtemp(dir="/dev/shm", prefix="pool-pass-ab-")
        try:
            with parallel_dcp.Saver(workers=saver_workers) as s:
                for n in range(7):
                    cpu = time.thread_time()
                    result = s.save(sd, f"{root}/ck")
                    cpu = time.thread_time() - cpu
                    shutil.rmtree(f"{root}/ck")
                    if n < 2:
                        continue
                    label = f"Saver(workers={saver_workers}), {keys} keys"
                    rows.setdefault(f"{label}: coordinator thread CPU a save (ms)", []).append(cpu * 1e3)
                    rows.setdefault(f"{label}: C (ms, wall)", []).append((result.coordinator_write_seconds or 0) * 1e3)
                    rows.setdefault(f"{label}: tasks", []).append(result.tasks)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({k: statistics.median(v) for k, v in rows.items()}))


def main() -> None:
    if sys.argv[1] == "--one":
        saver = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else None
        one(int(sys.argv[2]), saver)
        return
    a, b = sys.argv[1], sys.argv[2]
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    workers = sys.argv[4] if len(sys.argv) > 4 else "64"
    saver = sys.argv[6:8] if len(sys.argv) > 5 and sys.argv[5] == "saver" else []
    got: dict[str, list[dict[str, float]]] = {a: [], b: []}
    for rnd in range(reps):
        for tree in (a, b) if rnd % 2 == 0 else (b, a):
            env = dict(os.environ, PYTHONPATH=tree)
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--one", workers, *saver],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            got[tree].append(json.loads(out.strip().splitlines()[-1]))
            load = os.getloadavg()[0]
            first = got[tree][-1][f"{10 * int(workers)} tasks, ahead: CPU a pass (us)"]
            print(
                f"round {rnd} {tree}: {10 * int(workers)} tasks ahead {first:.1f} us a pass (load {load:.1f})",
                flush=True,
            )
    print(f"WorkerPool({workers}); {reps} processes a tree, 7 runs each; medians of the processes' medians")
    print(f"{'':64s}{'A':>10s}{'B':>10s}{'B/A':>8s}   A: {a}  B: {b}")
    for label in dict.fromkeys(k for runs in got.values() for r in runs for k in r):
        med = [statistics.median(r[label] for r in got[t]) for t in (a, b)]
        print(f"{label:64s}{med[0]:10.1f}{med[1]:10.1f}{med[1] / med[0]:8.2f}")


if __name__ == "__main__":
    main()
