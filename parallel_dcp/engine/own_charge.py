"""A process's own reading of its memory, for the coordinator that charges it (a Saver's worker
going idle as a save ends: engine/worker.py; process_memory.ChargeReader.learn takes it in).

The walk of its page tables costs the worker ~1.2 ms and its coordinator nothing; the reading is
paired with the counters read just before it, so a bound or a lower bound taken from those
counters later counts what moved meanwhile on the safe side.
"""

from __future__ import annotations

import os
import time

from parallel_dcp.engine.proc_reading import FAULT_SLACK, counter_drift, exact_charge, read_counters, rollup_anon
from parallel_dcp.engine.process_memory import ChargeReport

__all__ = ["own_charge"]


_own_full_file = [-1]  # this process's RssFile at its last own_charge in full


def own_charge() -> ChargeReport | None:
    """This process's rollup, read by itself (a worker going idle: the walk of its page tables
    costs it ~1-2 ms, and its coordinator nothing); its full ``smaps`` too (~5 ms) where its
    file pages moved since it last read that (code paged in by its first tasks, which only a
    full reading tells apart from a data file's pages). The counters are read first: what the
    process added while the rollup ran is then in both the rollup and the growth counted from
    those counters (counted twice, never missed), and what it freed meanwhile is missing from
    the rollup and subtracted again from a lower bound (missed twice, never counted)."""
    pid = os.getpid()
    at = time.monotonic()
    counters = read_counters(pid)
    rollup = rollup_anon(pid)
    jitter = counter_drift(counters, read_counters(pid))
    if counters is None or rollup is None:
        return None
    exact = None
    if abs(counters.file - _own_full_file[0]) > FAULT_SLACK:
        charged, private, _ = exact_charge(pid)
        exact, _own_full_file[0] = (charged, private), counters.file
    return ChargeReport(at, rollup, (counters.anon, counters.file, counters.faults, counters.shmem), exact, jitter)
