"""What one memory reading costs per process at 8, 32 and 64 workers (issue 30 item 5).

The coordinator forks ``count`` children (they inherit whatever it holds, the state dict
included, as a pool's workers do), lets them settle, then times ``MemoryGovernor.read`` over them
in CPU seconds (the figure that stays meaningful when the children outnumber the cores), divided
by the processes read (the children and the coordinator). Four kinds of reading, interleaved:

    cheap   the governor's own reading of idle children: O(1) counters
    moved   the governor's own reading right after every child mapped, wrote and unmapped 4 MiB
            (its counters show faults and frees: each is due a rollup; the reading rolls up at
            most process_memory.rollup_budget of them and bounds the others)
    rollup  every process's smaps_rollup (what a reading cost before that budget, when every
            process's counters had moved)
    exact   every process's full smaps (what a settle or the pre-issue-30 reading did)

Shared by ``bench --suite scaling`` and ``bench/bench_bignode.py``.
"""

from __future__ import annotations

import mmap
import os
import resource
import statistics
import time
from typing import Any

from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.engine.process_memory import ROLLUP

__all__ = ["GOVERNOR_COUNTS", "governor_cost"]

GOVERNOR_COUNTS = (8, 32, 64)
_KINDS = ("cheap", "moved", "rollup", "exact")
_CHURN = 4 * 1024 * 1024


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _fork_idle(count: int) -> tuple[list[int], list[int], int]:
    """``count`` children, each waiting on its own pipe: a byte ``m`` makes it map, write and unmap
    ``_CHURN`` bytes and answer on the shared pipe (returned last); closing its pipe ends it."""
    done_read, done_write = os.pipe()
    children: list[int] = []
    pokes: list[int] = []
    try:
        for _ in range(count):
            poke_read, poke_write = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                for fd in (*pokes, poke_write, done_read):
                    os.close(fd)
                # Touch a little memory of its own, as a started worker has; no torch call: a
                # forked child must not enter the parent's intra-op thread pool.
                bytearray(1 << 20)
                while os.read(poke_read, 1) == b"m":
                    with mmap.mmap(-1, _CHURN) as block:
                        for offset in range(0, _CHURN, mmap.PAGESIZE):
                            block[offset] = 1
                    os.write(done_write, b"d")
                os._exit(0)
            os.close(poke_read)
            children.append(pid)
            pokes.append(poke_write)
    except BaseException:
        for fd in pokes:
            os.close(fd)
        os.close(done_read)
        _reap(children)
        raise
    finally:
        os.close(done_write)
    return children, pokes, done_read


def _churn(pokes: list[int], done: int) -> None:
    """Every child maps, writes and unmaps ``_CHURN`` bytes; back once all of them did."""
    for fd in pokes:
        os.write(fd, b"m")
    for _ in pokes:
        os.read(done, 1)


def _reap(children: list[int]) -> None:
    for pid in children:
        os.waitpid(pid, 0)


def governor_cost(rounds: int, counts: tuple[int, ...] = GOVERNOR_COUNTS, settle: float = 0.3) -> list[dict[str, Any]]:
    """Per child count: the CPU milliseconds per process of each kind of reading (the mean of the
    governor's own readings, the median of the others), and the median count of processes a
    "moved" reading rolled up or read in full."""
    rows = []
    for count in counts:
        children, pokes, done = _fork_idle(count)
        try:
            time.sleep(settle)  # the children are past their first page faults
            gov = MemoryGovernor(2**50)
            gov.read(children, exact=True)  # learns each process's code share once, as a job does
            pids = [os.getpid(), *children]
            found: dict[str, list[float]] = {kind: [] for kind in _KINDS}
            rolled: list[int] = []
            for _ in range(max(1, rounds)):
                for kind in _KINDS:
                    if kind == "moved":
                        _churn(pokes, done)
                    reads = gov._charges.rollups + gov._charges.full_reads
                    before = _cpu()
                    if kind == "rollup":
                        for pid in pids:
                            gov._charges.charge(pid, ROLLUP)
                    else:
                        gov.read(children, exact=kind == "exact")
                    found[kind].append((_cpu() - before) / (count + 1))
                    if kind == "moved":
                        rolled.append(gov._charges.rollups + gov._charges.full_reads - reads)
        finally:
            for fd in pokes:
                os.close(fd)
            os.close(done)
            _reap(children)
        row: dict[str, Any] = {"workers": count, "processes_read": count + 1}
        # The governor's own readings ("cheap", "moved") are averaged: its CPU credit lets one
        # reading roll up what an earlier one saved for, so a median would hide those rollups.
        average = {"cheap": statistics.mean, "moved": statistics.mean}
        row |= {f"{kind}_ms_per_process": average.get(kind, statistics.median)(found[kind]) * 1e3 for kind in _KINDS}
        row["moved_reads_per_reading"] = statistics.median(rolled)
        rows.append(row)
    return rows
