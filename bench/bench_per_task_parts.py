"""What each task costs a Saver's coordinator, part by part: a later save at one worker's 4 tasks against the same
save cut into the 64 of a save on 64 workers, per task more.

Usage: flock LOCK python bench/bench_per_task_parts.py llm|small [REPS]   (default 5)

Two `Saver(workers=1)` in this process hold `synthetic.llm_like(1.0)` (llm) or `synthetic.many_small(50000)` (small):
one plans its own tasks, one those of a save on 64 workers (`partition.planned_as_on(64)`), each saved twice before
the rows; they take turns, one later save a row. The coordinator's functions on the path of a task sent and a
result taken in (engine/pool.py, engine/messages.py, the pickling and the pipe's reads in them) are wrapped to
add up their wall seconds per save; C is `SaveResult.coordinator_write_seconds` (its work beside the workers) and S
the wall less the workers' seconds. Prints, per part, the medians at both task counts and the difference per task
more. The wrappers cost a few microseconds a call; compare the rows, not the wrapped run's C with an unwrapped one's.
Each result meets a coordinator that slept while the one worker worked: cold caches, an upper bound of what 64 busy
workers' results cost it.
"""

import gc
import pickle
import shutil
import socket
import statistics
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Callable
from typing import Any

import parallel_dcp
from parallel_dcp.engine import memory, messages, pool, remote_memory
from parallel_dcp.engine.partition import planned_as_on
from parallel_dcp.synthetic import llm_like, many_small

warnings.filterwarnings("ignore")
spent: dict[str, float] = {}


def timed(owner: Any, name: str, label: str) -> None:
    inner: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - began

    setattr(owner, name, wrapper)


def wrap_the_path() -> None:
    """The pool's and the messages' pickle and socket modules replaced by timed copies (only theirs)."""
    pool.pickle = types.SimpleNamespace(**{k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")})
    messages.pickle = types.SimpleNamespace(**vars(pool.pickle))
    messages.socket = types.SimpleNamespace(**{k: getattr(socket, k) for k in dir(socket) if not k.startswith("__")})
    for owner, name, label in [
        (pool.WorkerPool, "_receive", "result taken in, all (_receive)"),
        (pool, "_recv", "  its reply and buffers (receive_reply)"),
        (messages, "_read_head", "    its head and memory file read (recvmsg)"),
        (messages, "_read_exactly", "    the rest read from the pipe"),
        (messages.pickle, "loads", "    the reply unpickled"),
        (messages, "_map_buffers", "    its buffers (_map_buffers)"),
        (messages, "_socket", "      the pipe's socket"),
        (messages.os, "fstat", "      its size checked (fstat)"),
        (messages, "_mapped", "      mapped"),
        (pool.pickle, "loads", "  the result unpickled"),
        (pool.WorkerPool, "_send_ahead", "tasks sent ahead, all (_send_ahead)"),
        (pool.WorkerPool, "_message", "  a task's message and part (_message)"),
        (pool.pickle, "dumps", "  pickled"),
        (remote_memory.RemoteBytes, "of", "  its address (RemoteBytes.of)"),
        (pool, "_send", "  sent"),
        (pool.WorkerPool, "_dispatch", "tasks dispatched (_dispatch)"),
        (memory.MemoryGovernor, "watch", "the governor's watch"),
    ]:
        timed(owner, name, label)


def main() -> None:
    kind = sys.argv[1]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    sd = llm_like(1.0) if kind == "llm" else many_small(50000)
    wrap_the_path()
    root = tempfile.mkdtemp(dir="/dev/shm", prefix="pertask-")
    out = f"{root}/ck"
    savers = {1: parallel_dcp.Saver(workers=1), 64: parallel_dcp.Saver(workers=1)}
    rows: dict[int, list[dict[str, float]]] = {like: [] for like in savers}
    try:
        for like, saver in savers.items():
            with planned_as_on(like):
                for _ in range(2):
                    saver.save(sd, out)
                    shutil.rmtree(out)
        for rnd in range(reps):
            for like in savers if rnd % 2 == 0 else list(savers)[::-1]:
                spent.clear()
                gc.collect()
                with planned_as_on(like):
                    began = time.perf_counter()
                    result = savers[like].save(sd, out)
                    wall = time.perf_counter() - began
                shutil.rmtree(out)
                work = sum(w.seconds + w.handling_seconds + w.handover_seconds for w in result.per_worker)
                row = dict(spent)
                row["C: the coordinator beside the workers"] = result.coordinator_write_seconds or 0.0
                row["S: serial (wall - the workers' seconds)"] = wall - work
                row["tasks"] = result.tasks
                rows[like].append(row)
    finally:
        for saver in savers.values():
            saver.close()
        shutil.rmtree(root, ignore_errors=True)
    few, many = rows[1][0]["tasks"], rows[64][0]["tasks"]
    print(f"{kind}: {few} tasks against {many} (as on 64 workers), medians of {reps}, wall ms; per task more in us")
    for label in rows[1][0]:
        if label == "tasks":
            continue
        a = statistics.median(r.get(label, 0.0) for r in rows[1])
        b = statistics.median(r.get(label, 0.0) for r in rows[64])
        print(f"{label:48s} {a * 1e3:9.2f} {b * 1e3:9.2f}   {(b - a) / (many - few) * 1e6:8.1f}")


if __name__ == "__main__":
    main()
