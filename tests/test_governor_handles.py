"""The watchdog's cheap bound (resident sizes) keeps each worker's psutil handle from one watch to
the next, and bounds the same tree as fresh handles would."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import psutil
import pytest

from parallel_dcp.engine import memory
from parallel_dcp.engine.memory import MemoryGovernor


def test_the_rss_bound_makes_one_handle_per_worker_and_drops_the_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []
    original = psutil.Process

    def counted(pid: int | None = None) -> Any:
        made.append(pid or 0)
        return original(pid)

    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        governor = MemoryGovernor(2**40)
        monkeypatch.setattr(memory.psutil, "Process", counted)
        pids = [child.pid for child in children]
        first = governor._rss_bound(pids)
        for _ in range(3):
            again = governor._rss_bound(pids)
        assert sorted(made) == sorted(pids)  # one handle per worker, made at the first watch only
        # What fresh handles bound (a sleeping child's resident size holds still; this process's
        # own growth is within a few MiB between the readings).
        fresh = max(0, memory._rss(original()) - governor._rss_baseline) + sum(
            original(pid).memory_info().rss for pid in pids
        )
        assert abs(again - fresh) < 8 * 2**20 and abs(first - fresh) < 8 * 2**20
        gone = original(pids[0]).memory_info().rss
        children[0].kill()
        children[0].wait()
        alone = governor._rss_bound(pids)  # the gone worker adds nothing (its handle reads no process)
        assert abs((again - alone) - gone) < 8 * 2**20
        governor._rss_bound(pids[1:])  # a pid no longer asked about is dropped
        assert list(governor._procs) == pids[1:]
    finally:
        for child in children:
            child.kill()
            child.wait()
