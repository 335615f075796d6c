"""The 4 GiB LLM-like state dict's Saver later save, w=1, at one worker's tasks and cut into 64 workers' tasks.

Usage: flock LOCK python bench/bench_llm_task_count.py [REPS]   (default 5; needs ~9 GiB of memory and /dev/shm)

Three `Saver(workers=1)` in this process hold `synthetic.llm_like(4.0)`: one plans its 4 tasks, one the tasks of a
save on 64 workers (`partition.task_count` asked for 64 workers while it plans: 64), and one the 130 that a save on
64 workers had before 2026-12-06 noon (`partition.TASKS_PER_WORKER` set to 256), each saved twice before the rows;
they take turns, one later save a row. Per configuration, the medians of wall, P, H, S and C (as
bench/bench_saver_coordinator.py takes them) feed the scaling suite's model (`pieces.executor_projections`): its
projected speedup at 16 and 64 workers, a projection, not a measurement. The rows cut like 64 workers' hold the
coordinator's per-task work as often as on 64 workers; read their x64 only.
"""

import gc
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import parallel_dcp
from parallel_dcp.benchmark.pieces import executor_projections
from parallel_dcp.engine import partition
from parallel_dcp.synthetic import llm_like, tensor_bytes

warnings.filterwarnings("ignore")


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    sd = llm_like(4.0)
    nbytes, keys = tensor_bytes(sd), len(sd)
    root = tempfile.mkdtemp(dir="/dev/shm", prefix="llmtasks-")
    out = f"{root}/ck"
    # (workers planned for, tasks a worker at most): one worker; 64 workers now; 64 workers before.
    configs = [(1, 4), (64, 4), (1, 256)]
    rows: dict[tuple[int, int], list[dict[str, Any]]] = {config: [] for config in configs}
    savers = {}
    count = partition.task_count

    def planned_like(config: tuple[int, int]) -> None:
        like, partition.TASKS_PER_WORKER = config
        partition.task_count = lambda total, workers, items: count(total, like, items)

    for config in configs:
        planned_like(config)
        savers[config] = parallel_dcp.Saver(workers=1)
        for _ in range(2):
            savers[config].save(sd, out)
            shutil.rmtree(out)
    try:
        for rnd in range(reps):
            for config in configs if rnd % 2 == 0 else configs[::-1]:
                planned_like(config)
                gc.collect()
                began = time.perf_counter()
                result = savers[config].save(sd, out)
                wall = time.perf_counter() - began
                shutil.rmtree(out)
                rows[config].append(
                    {
                        "wall": wall,
                        "P": sum(w.seconds for w in result.per_worker),
                        "H": sum(w.handling_seconds + w.handover_seconds for w in result.per_worker),
                        "C": result.coordinator_write_seconds or 0.0,
                        "tasks": result.tasks,
                        "phases": dict(result.phases),
                    }
                )
    finally:
        partition.task_count, partition.TASKS_PER_WORKER = count, 4
        for saver in savers.values():
            saver.close()
        shutil.rmtree(root, ignore_errors=True)
    for (like, per_worker), found in rows.items():

        def med(name: str, found: list[dict[str, Any]] = found) -> float:
            return statistics.median(r[name] for r in found)

        probe = {
            "saver": {
                "executor_used": "saver",
                "alone_seconds": med("wall"),
                "busy_thread_seconds": med("wall"),  # not probed here
                "busy_process_seconds": med("wall"),
                "worker_seconds": med("P"),
                "worker_handling_seconds": med("H"),
                "coordinator_write_seconds": med("C"),
                "serial_seconds": statistics.median(max(0.0, r["wall"] - r["P"] - r["H"]) for r in found),
                "phases": {k: statistics.median(r["phases"].get(k, 0.0) for r in found) for k in found[0]["phases"]},
            }
        }
        got = executor_projections(probe, nbytes, keys)["saver"]
        x = {row["workers"]: row["projected_speedup"] for row in got["rows"]}
        print(
            f"planned like {like} worker(s), at most {per_worker} tasks a worker: {found[0]['tasks']} tasks"
            f" ({keys} tensors, {nbytes / 2**30:.1f} GiB): wall {med('wall'):.3f} s,"
            f" S {got['serial_seconds'] * 1e3:.1f} ms, C {med('C') * 1e3:.1f} ms, P+H {got['worker_seconds']:.3f} s;"
            f" projected x16 {x[16]:.2f}, x64 {x[64]:.2f}"
        )


if __name__ == "__main__":
    main()
