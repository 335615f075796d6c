"""A Saver's later saves of 50,000 small tensors to tmpfs: before (base tree) vs after (this branch),
interleaved; S, C and the scaling suite's projection for each.

Usage: flock LOCK python bench/bench_saver_coordinator.py OUT_ROOT BASE_TREE AFTER_TREE REPS [WORKERS [TASKS_LIKE]]

Two long-lived processes (before: PYTHONPATH=BASE_TREE; after: AFTER_TREE, both with AFTER_TREE's
``.venv``) each hold ``synthetic.many_small(50000)`` and a ``parallel_dcp.Saver(workers=WORKERS)``
(default 1, as ``bench --suite scaling:small`` probes it) that saved it twice before the rows; they
take turns, one later save a row (round 0 a warm-up). Per row, from its SaveResult, as
parallel_dcp/benchmark/pieces.py takes them: wall, P (seconds inside the workers' tasks), H (their
handling), S = wall - P - H (serial), C = ``coordinator_write_seconds`` (the coordinator's work
while the workers work). The medians feed ``pieces.executor_projections`` (the suite's model:
T(N) = S + max(C, W(N))): its projected speedup at 16 and 64 workers, a projection, not a
measurement. Prints each row, the medians and the after/before ratios.

TASKS_LIKE=N: the save is cut into the tasks a save on N workers has (``partition.task_count`` asked
for N workers; a tree without it, before 2026-12-06 noon, gets ``partition.TASKS_PER_WORKER`` set to
4 N: 111 tasks for N = 64 there, 64 here; 64 for N = 16 in both; 4 on one worker), so that C holds the
coordinator's work per task (each task sent, each result taken in) as often as on N workers. Each
of its results is taken in after the coordinator slept (one worker: a result every ~30 ms), so its
per-task costs are those of a cold loop: an upper bound of N busy workers'. Read its x N only.
"""

import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import sys, time, json, shutil, warnings, gc
warnings.filterwarnings("ignore")
import os
import parallel_dcp
from parallel_dcp.engine import partition
from parallel_dcp.synthetic import many_small
if os.environ.get("PDCP_BENCH_TASKS_LIKE"):
    like = int(os.environ["PDCP_BENCH_TASKS_LIKE"])
    if hasattr(partition, "task_count"):
        count = partition.task_count
        partition.task_count = lambda total, workers, items: count(total, like, items)
    else:
        partition.TASKS_PER_WORKER = 4 * like
workers = int(sys.argv[1])
sd = many_small(50000)
saver = parallel_dcp.Saver(workers=workers)
for line in sys.stdin:
    path = line.strip()
    if path.startswith("warm "):
        for _ in range(2):
            saver.save(sd, path[5:])
            shutil.rmtree(path[5:])
        print("ready", parallel_dcp.__file__, flush=True)
        continue
    gc.collect()
    t = time.perf_counter()
    r = saver.save(sd, path)
    took = time.perf_counter() - t
    shutil.rmtree(path)
    print(json.dumps({
        "wall": took,
        "P": sum(w.seconds for w in r.per_worker),
        # The hand-over of each result but a run's last (its send into the pipe): reported apart
        # since this round (0 in a tree before it, whose S holds it).
        "H": sum(w.handling_seconds + getattr(w, "handover_seconds", 0.0) for w in r.per_worker),
        "handover": sum(getattr(w, "handover_seconds", 0.0) for w in r.per_worker),
        "C": r.coordinator_write_seconds or 0.0,
        "job": max((w.setup_seconds for w in r.per_worker), default=0.0),
        "tasks": r.tasks,
        "phases": dict(r.phases),
    }), flush=True)
saver.close()
"""
N = 50000


def projection(rows: list[dict], after_tree: str, handover_parallel: bool = True) -> dict:
    """The pieces and projection of ``rows``; ``handover_parallel=False``: as before this round,
    the workers' hand-over of their results counted in S, not in their parallel work."""
    if not handover_parallel:
        rows = [r | {"H": r["H"] - r.get("handover", 0.0)} for r in rows]
    sys.path.insert(0, after_tree)
    from parallel_dcp.benchmark.pieces import executor_projections

    def med(values: list[float]) -> float:
        return statistics.median(values)

    phases = {name: med([r["phases"].get(name, 0.0) for r in rows]) for name in rows[0]["phases"]}
    wall = med([r["wall"] for r in rows])
    probe = {
        "saver": {
            "executor_used": "saver",
            "alone_seconds": wall,
            "busy_thread_seconds": wall,  # not probed here: a Saver's writers are not GIL-capped
            "busy_process_seconds": wall,
            "worker_seconds": med([r["P"] for r in rows]),
            "worker_handling_seconds": med([r["H"] for r in rows]),
            "coordinator_write_seconds": med([r["C"] for r in rows]),
            "serial_seconds": med([max(0.0, r["wall"] - r["P"] - r["H"]) for r in rows]),
            "serial_before_seconds": med([r["phases"]["plan"] + r["phases"]["fork"] for r in rows]),
            "serial_after_seconds": med(
                [max(0.0, r["wall"] - r["phases"]["plan"] - r["phases"]["fork"] - r["phases"]["write"]) for r in rows]
            ),
            "worker_job_seconds": med([r["job"] for r in rows]),
            "phases": phases,
        }
    }
    found = executor_projections(probe, 1, N)["saver"]
    x = {row["workers"]: row["projected_speedup"] for row in found["rows"]}
    return {
        "wall": wall,
        "S": found["serial_seconds"],
        "S_us_per_key": found["serial_us_per_key"],
        "C": found["coordinator_write_seconds"],
        "C_us_per_key": found["coordinator_write_us_per_key"],
        "P+H": found["worker_seconds"],
        "x16": x[16],
        "x64": x[64],
    }


def main() -> None:
    root, base, after, reps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    workers_count = sys.argv[5] if len(sys.argv) > 5 else "1"
    tasks_like = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    py = f"{after}/.venv/bin/python"
    procs = {}
    for name, tree in (("before", base), ("after", after)):
        env = dict(os.environ, PYTHONPATH=tree)
        if tasks_like:
            env["PDCP_BENCH_TASKS_LIKE"] = str(tasks_like)
        procs[name] = subprocess.Popen(
            [py, "-c", WORKER, workers_count],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=root,  # not a tree: `python -c` puts the working directory first on sys.path
        )
        procs[name].stdin.write(f"warm {root}/{name}-warm\n")
        procs[name].stdin.flush()
        print(name, procs[name].stdout.readline().strip(), flush=True)
    rows = {name: [] for name in procs}
    for rnd in range(reps + 1):
        order = ("before", "after") if rnd % 2 == 0 else ("after", "before")
        for name in order:
            procs[name].stdin.write(f"{root}/{name}-{rnd}\n")
            procs[name].stdin.flush()
            got = json.loads(procs[name].stdout.readline())
            print(
                f"round {rnd} {name}: wall {got['wall']:.3f} P {got['P']:.3f} H {got['H']:.3f} C {got['C']:.3f}",
                flush=True,
            )
            if rnd:
                rows[name].append(got)
    tasks = ", ".join(f"{name} {rows[name][-1]['tasks']}" for name in rows if rows[name])
    print(f"tasks per save: {tasks}" + (f" (as on {tasks_like} workers)" if tasks_like else ""))
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    found = {name: projection(rows[name], after) for name in rows}
    found["after, hand-over counted serial"] = projection(rows["after"], after, handover_parallel=False)
    for name, f in found.items():
        print(
            f"{name}: wall {f['wall']:.3f} s, S {f['S']:.4f} s ({f['S_us_per_key']:.2f} us/key),"
            f" C {f['C']:.4f} s ({f['C_us_per_key']:.2f} us/key), P+H {f['P+H']:.3f} s;"
            f" projected x16 {f['x16']:.2f}, x64 {f['x64']:.2f}"
        )
    b, a = found["before"], found["after"]
    print(f"after/before: S {a['S'] / b['S']:.2f}, C {a['C'] / b['C']:.2f}, wall {a['wall'] / b['wall']:.2f}")
    h = statistics.median(r.get("handover", 0.0) for r in rows["after"])
    print(f"after: the workers' hand-over of their results (in S before this round, now in H): {h:.4f} s")
    print(json.dumps({"workers": int(workers_count), "tasks_like": tasks_like, "reps": reps, "found": found}))


if __name__ == "__main__":
    main()
