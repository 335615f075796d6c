"""What one memory reading costs per process at 8, 32 and 64 workers (issue 30 item 5).

The coordinator forks ``count`` idle children (they inherit whatever it holds, the state dict
included, as a pool's workers do), lets them settle, then times ``MemoryGovernor.read`` over them
in CPU seconds (the figure that stays meaningful when the children outnumber the cores), divided
by the processes read (the children and the coordinator). Three kinds of reading, interleaved:

    cheap   the governor's own reading: O(1) counters, smaps_rollup where they moved
    rollup  every process's counters moved (all of them allocating, or a fork or exit in the
            tree): every process's smaps_rollup is read
    exact   every process's full smaps (what a settle or the pre-issue-30 reading did)

Shared by ``bench --suite scaling`` and ``bench/bench_bignode.py``.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from typing import Any

from parallel_dcp.engine.memory import MemoryGovernor

__all__ = ["GOVERNOR_COUNTS", "governor_cost"]

GOVERNOR_COUNTS = (8, 32, 64)
_KINDS = ("cheap", "rollup", "exact")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _fork_idle(count: int) -> tuple[list[int], int]:
    """``count`` children blocked on a pipe; the write end releases them."""
    read_end, write_end = os.pipe()
    children = []
    try:
        for _ in range(count):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                os.close(write_end)
                # Touch a little memory of its own, as a started worker has; no torch call: a
                # forked child must not enter the parent's intra-op thread pool.
                bytearray(1 << 20)
                os.read(read_end, 1)
                os._exit(0)
            children.append(pid)
    except BaseException:
        os.close(write_end)
        _reap(children)
        raise
    finally:
        os.close(read_end)
    return children, write_end


def _reap(children: list[int]) -> None:
    for pid in children:
        os.waitpid(pid, 0)


def governor_cost(rounds: int, counts: tuple[int, ...] = GOVERNOR_COUNTS, settle: float = 0.3) -> list[dict[str, Any]]:
    """Per child count: the median CPU milliseconds per process of each kind of reading."""
    rows = []
    for count in counts:
        children, release = _fork_idle(count)
        try:
            time.sleep(settle)  # the children are past their first page faults
            gov = MemoryGovernor(2**50)
            gov.read(children, exact=True)  # learns each process's code share once, as a job does
            found: dict[str, list[float]] = {kind: [] for kind in _KINDS}
            for _ in range(max(1, rounds)):
                for kind in _KINDS:
                    # "rollup": mark every process's counters as moved, so each smaps_rollup is read
                    gov._charges._shares_moved = kind == "rollup"
                    before = _cpu()
                    gov.read(children, exact=kind == "exact")
                    found[kind].append((_cpu() - before) / (count + 1))
        finally:
            os.close(release)
            _reap(children)
        row: dict[str, Any] = {"workers": count, "processes_read": count + 1}
        row |= {f"{kind}_ms_per_process": statistics.median(found[kind]) * 1e3 for kind in _KINDS}
        rows.append(row)
    return rows
