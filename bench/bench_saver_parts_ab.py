"""A/B of a `Saver`'s later saves, part by part, between two trees: C (its work beside the workers), S (serial: wall -
the workers' seconds) and the named functions inside them, wall and CPU (this thread's), and the coordinator
thread's CPU in a whole save, interleaved runs.

Usage: flock LOCK python bench/bench_saver_parts_ab.py TREE_A TREE_B [ROUNDS [SAVES [small|llm [TASKS]]]]
    ROUNDS (default 5): processes per tree, A and B taking turns (B first every other round)
    SAVES (default 8): later saves per process, the first 2 of them left out (each process's medians)
    TASKS (default 64): cut every save into the tasks of a save on that many workers (`partition.planned_as_on`)
Each process imports its tree's code (PYTHONPATH=TREE) and runs `bench_saver_parts_ab.py --one ...`: one
`Saver(workers=1)` saving `synthetic.many_small(50000)` (or `llm_like(4)`) to tmpfs; a named function absent from a
tree is left out of its rows. Prints, per part, the median over the processes of each one's median, A then B.
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

PARTS = [  # (module, owner or "", name, label)
    ("parallel_dcp.jobs.speculation", "Speculation", "confirm", "layout check (Speculation.confirm)"),
    ("parallel_dcp.engine.memory", "MemoryGovernor", "watch", "governor readings (MemoryGovernor.watch)"),
    ("parallel_dcp.engine.memory", "MemoryGovernor", "read", "  of which read (MemoryGovernor.read)"),
    ("parallel_dcp.engine.pool", "WorkerPool", "_receive", "results taken in (WorkerPool._receive)"),
    ("parallel_dcp.engine.pool", "", "_recv", "  the reply and its buffers (receive_reply)"),
    ("parallel_dcp.engine.messages", "", "read_buffers", "    its buffers (read_buffers: A)"),
    ("parallel_dcp.engine.messages", "", "_map_buffers", "    its buffers (_map_buffers: B)"),
    ("parallel_dcp.engine.messages", "", "_mapped", "      mapped (_mapped)"),
    ("parallel_dcp.engine.result_region", "ResultRegion", "map", "      mapped in its range (ResultRegion.map)"),
    ("parallel_dcp.engine.pool", "WorkerPool", "_send_ahead", "tasks sent ahead (WorkerPool._send_ahead)"),
    ("parallel_dcp.engine.pool", "WorkerPool", "_dispatch", "tasks dispatched (WorkerPool._dispatch)"),
    ("parallel_dcp.engine.pool", "WorkerPool", "_message", "  messages made (WorkerPool._message)"),
]


def one(kind: str, saves: int, tasks: int) -> None:
    import importlib

    import parallel_dcp
    from parallel_dcp.engine.partition import planned_as_on
    from parallel_dcp.synthetic import llm_like, many_small

    warnings.filterwarnings("ignore")
    spent: dict[str, list[float]] = {}

    def wrap(owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                got = spent.setdefault(label, [0.0, 0.0])
                got[0] += time.perf_counter() - wall
                got[1] += time.thread_time() - cpu

        setattr(owner, name, run)

    for module, owner, name, label in PARTS:
        try:
            target: Any = importlib.import_module(module)
        except ModuleNotFoundError:  # (a module the other tree added)
            continue
        if owner:
            target = getattr(target, owner)
        if hasattr(target, name):
            wrap(target, name, label)
    sd = many_small(50000) if kind == "small" else llm_like(4)
    root = tempfile.mkdtemp(dir="/dev/shm", prefix="parts-ab-")
    rows: list[dict[str, float]] = []
    try:
        with parallel_dcp.Saver(workers=1) as saver:
            for n in range(saves + 2):
                spent.clear()
                with planned_as_on(tasks):
                    began, cpu = time.perf_counter(), time.thread_time()
                    result = saver.save(sd, f"{root}/ck")
                    wall, cpu = time.perf_counter() - began, time.thread_time() - cpu
                shutil.rmtree(f"{root}/ck")
                if n < 2:
                    continue
                work = sum(w.seconds + w.handling_seconds + w.handover_seconds for w in result.per_worker)
                ph = result.phases
                row = {
                    "wall": wall,
                    "S (wall - P - H)": wall - work,
                    "  before the first task (plan + fork)": ph.get("plan", 0.0) + ph.get("fork", 0.0),
                    "  write rest (write - P - H)": ph.get("write", 0.0) - work,
                    "  after the last result (merge, commit)": wall
                    - ph.get("plan", 0.0)
                    - ph.get("fork", 0.0)
                    - ph.get("write", 0.0),
                    "C (coordinator_write_seconds)": result.coordinator_write_seconds or 0.0,
                    "coordinator's thread CPU, whole save": cpu,
                    "tasks": result.tasks,
                }
                for label, (w, c) in spent.items():
                    row[label] = w
                    row[label + " [cpu]"] = c
                rows.append(row)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    labels = list(dict.fromkeys(k for r in rows for k in r))
    print(json.dumps({k: statistics.median(r.get(k, 0.0) for r in rows) for k in labels}))


def main() -> None:
    if sys.argv[1] == "--one":
        one(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    a, b = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    saves = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    kind = sys.argv[5] if len(sys.argv) > 5 else "small"
    tasks = int(sys.argv[6]) if len(sys.argv) > 6 else 64
    got: dict[str, list[dict[str, float]]] = {a: [], b: []}
    for rnd in range(rounds):
        for tree in (a, b) if rnd % 2 == 0 else (b, a):
            env = dict(os.environ, PYTHONPATH=tree)
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--one", kind, str(saves), str(tasks)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            got[tree].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {rnd} {tree}: C {got[tree][-1]['C (coordinator_write_seconds)'] * 1e3:.1f} ms", flush=True)
    labels = list(dict.fromkeys(k for runs in got.values() for r in runs for k in r))
    print(f"{kind}, {saves} later saves a process, {rounds} processes a tree; medians of the processes' medians, ms")
    print(f"{'':56s}{'A':>10s}{'B':>10s}   A: {a}  B: {b}")
    for label in labels:
        if label == "tasks":
            print(f"{'tasks':56s}{got[a][0].get(label, 0):10.0f}{got[b][0].get(label, 0):10.0f}")
            continue
        med = [statistics.median(r.get(label, 0.0) for r in got[t]) * 1e3 for t in (a, b)]
        print(f"{label:56s}{med[0]:10.2f}{med[1]:10.2f}")


if __name__ == "__main__":
    main()
