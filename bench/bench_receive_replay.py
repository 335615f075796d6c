"""The coordinator's receive path per result, hot against cold: 111 real results replayed from a child process.

Usage: flock LOCK python bench/bench_receive_replay.py

A `Saver(workers=1)` saves `synthetic.many_small(50000)` cut into 111 tasks (`partition.TASKS_PER_WORKER` set to 256:
what a save on 64 workers had before 2026-12-06 noon; 64 since) and its results are recorded as the coordinator took
them in (each over `messages.INLINE_RESULT_BYTES`, so each in a memory file). A child process then sends them again
as a worker does (`messages.pickled_result`, then the reply with its memory file, `messages.send_reply`), back to
back or 30 ms apart (as one worker's results come), and this process takes each in as `WorkerPool._receive` does
(`messages.receive_reply`, then the result unpickled). Prints each result's CPU seconds here (median, mean, total)
and the parts (the socket, `recvmsg` of the reply's head and its file, the mapping, `_map_buffers` in all), twice
each way.
"""

import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import multiprocess as mp

import parallel_dcp
from parallel_dcp.engine import messages, partition
from parallel_dcp.engine import pool as pool_module
from parallel_dcp.engine.ready import wait_ready
from parallel_dcp.synthetic import many_small

warnings.filterwarnings("ignore")


def record() -> list[tuple[Any, list[bytes]]]:
    """The "ok" replies and buffers of one later save's 111 results."""
    partition.TASKS_PER_WORKER = 256
    got: list[tuple[Any, list[bytes]]] = []
    original = pool_module._recv

    def keep(conn: Any) -> Any:
        reply, raw = original(conn)
        got.append((reply, [bytes(b) for b in raw]))
        return reply, raw

    pool_module._recv = keep
    root = tempfile.mkdtemp(dir="/dev/shm", prefix="replay-")
    try:
        sd = many_small(50000)
        with parallel_dcp.Saver(workers=1) as saver:
            saver.save(sd, f"{root}/ck")
            shutil.rmtree(f"{root}/ck")
            got.clear()
            saver.save(sd, f"{root}/ck")
    finally:
        pool_module._recv = original
        shutil.rmtree(root)
    return [(reply, raw) for reply, raw in got if reply[0] == "ok"]


def _child(conn: Any, results: list[tuple[Any, list[bytes]]], pause: float) -> None:
    for reply, raw in results:
        data, sizes, shared = messages.pickled_result(pickle.loads(reply[2], buffers=raw))
        messages.send_reply(conn, pickle.dumps(("ok", reply[1], data, 0.0, 0.0, 0.0, sizes)), shared)
        if pause:
            time.sleep(pause)
    conn.recv_bytes()


def replay(results: list[tuple[Any, list[bytes]]], pause: float) -> list[float]:
    """Each result's CPU seconds in this process, taken in as the pool does."""
    here, there = mp.Pipe()
    child = mp.Process(target=_child, args=(there, results, pause))
    child.start()
    per, kept = [], []
    for _ in results:
        wait_ready([here], None)
        began = time.thread_time()
        if wait_ready([here], 0):
            reply, raw = messages.receive_reply(here)
            with messages.gc_paused():
                kept.append(pickle.loads(reply[2], buffers=raw))
        per.append(time.thread_time() - began)
    here.send_bytes(b"done")
    child.join()
    return per


def main() -> None:
    results = record()
    print(f"{len(results)} results recorded (python {sys.version.split()[0]}, pid {os.getpid()})")
    parts: dict[str, float] = {}

    def timed(label: str, f: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            began = time.thread_time()
            try:
                return f(*args, **kwargs)
            finally:
                parts[label] = parts.get(label, 0.0) + time.thread_time() - began

        return run

    messages._mapped = timed("mapping", messages._mapped)
    messages._socket = timed("socket", messages._socket)
    messages._read_head = timed("recvmsg", messages._read_head)
    messages._map_buffers = timed("_map_buffers in all", messages._map_buffers)
    for pause in (0.0, 0.03, 0.0, 0.03):
        parts.clear()
        per = replay(results, pause)
        print(
            f"{pause * 1e3:.0f} ms between results: per result CPU median {statistics.median(per) * 1e6:.0f} us,"
            f" mean {statistics.mean(per) * 1e6:.0f} us, total {sum(per) * 1e3:.1f} ms;"
            f" parts {', '.join(f'{k} {v * 1e3:.1f} ms' for k, v in parts.items())}"
        )


if __name__ == "__main__":
    main()
