"""The watchdog's cheap bound (resident sizes) keeps each process's ``statm`` open from one watch
to the next, bounds the same tree as psutil reads it, and counts a reaped worker as nothing, even
where its pid is taken again."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil
import pytest

from parallel_dcp.engine import memory, resident
from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.engine.resident import ResidentSizes

_SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _open_statm(pid: int) -> list[str]:
    """The statm files this process has open for ``pid``."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return [name for name in names if name == f"/proc/{pid}/statm"]


def test_the_rss_bound_opens_each_statm_once_and_drops_the_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    real_open = os.open

    def counted(path: str, flags: int, *args: int) -> int:
        opened.append(path)
        return real_open(path, flags, *args)

    children = [subprocess.Popen(_SLEEPER) for _ in range(2)]
    try:
        governor = MemoryGovernor(2**40)
        monkeypatch.setattr(resident.os, "open", counted)
        pids = [child.pid for child in children]
        first = governor._rss_bound(pids)
        for _ in range(3):
            again = governor._rss_bound(pids)
        assert sorted(opened) == sorted(f"/proc/{pid}/statm" for pid in pids)  # once each, at the first watch
        # What psutil reads (a sleeping child's resident size holds still; this process's own
        # growth is within a few MiB between the readings).
        fresh = max(0, psutil.Process().memory_info().rss - governor._rss_baseline) + sum(
            psutil.Process(pid).memory_info().rss for pid in pids
        )
        assert abs(again - fresh) < 8 * 2**20 and abs(first - fresh) < 8 * 2**20
        gone = psutil.Process(pids[0]).memory_info().rss
        children[0].kill()
        children[0].wait()
        alone = governor._rss_bound(pids)  # the reaped worker adds nothing
        assert abs((again - alone) - gone) < 8 * 2**20
        governor._rss_bound(pids[1:])  # a pid no longer asked about: its statm is closed
        assert _open_statm(pids[0]) == [] and len(_open_statm(pids[1])) == 1
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_a_kept_statm_never_reads_another_process_that_took_the_pid() -> None:
    sizes = ResidentSizes()
    child = subprocess.Popen(_SLEEPER)
    try:
        assert sizes.read([child.pid])[0] > 0
    finally:
        child.kill()
        child.wait()
    # The kernel ties the open file to the process, not the pid: once it is reaped, the read
    # fails, whatever runs under that pid later, and the process counts 0.
    assert sizes.read([child.pid]) == [0]
    sizes.close()
    assert _open_statm(child.pid) == []


class _HeldClock:
    """The ``time`` module with ``monotonic`` held at ``now``."""

    def __init__(self, now: float) -> None:
        self._now = now

    def monotonic(self) -> float:
        return self._now

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def test_the_first_watch_reads_nothing_the_baseline_just_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The baseline is read as the governor is made; a watch right after it, with the resident
    sizes far under the limit, reads no smaps (it found nothing added, and a rollup of a process
    holding a state dict costs milliseconds every save of a Saver). Once the relaxed interval has
    passed, it reads again (for the reported peak)."""
    child = subprocess.Popen(_SLEEPER)
    try:
        governor = MemoryGovernor(2**40)
        made = time.monotonic()
        readings = governor._charges.readings
        workers = {child.pid: (0, ("key",))}
        # The governor's clock held where it was made, however slowly a loaded machine runs this
        # (its own module's clock only: a clock held for the whole process could stall a timed wait).
        monkeypatch.setattr(memory, "time", _HeldClock(made))
        governor.watch(workers)
        governor._next_sample = 0.0
        governor.watch(workers)
        assert governor._charges.readings == readings
        monkeypatch.setattr(memory, "time", _HeldClock(governor._next_relaxed + 0.001))
        governor._next_sample = 0.0
        governor.watch(workers)
        assert governor._charges.readings == readings + 1
    finally:
        child.kill()
        child.wait()


def test_a_reading_for_the_peak_taken_aside_runs_on_another_thread_and_charges_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``watch(aside=True)`` (a Saver's pool): the reading the resident sizes do not call for is taken
    on the governor's own thread, and counts in the peak once acted on (``finish``) as a reading
    taken on this thread would."""
    child = subprocess.Popen(_SLEEPER)
    try:
        governor = MemoryGovernor(2**40)
        workers = {child.pid: (0, ("key",))}
        threads: list[int] = []
        plan = governor._charges.plan

        def recorded(*args: object, **kwargs: object) -> list[int]:
            threads.append(threading.get_ident())
            return plan(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(governor._charges, "plan", recorded)
        governor._next_sample = governor._next_relaxed = 0.0  # a reading for the peak is due
        governor.watch(workers, aside=True)
        governor.finish(workers)
        assert len(threads) == 1 and threads[0] != threading.get_ident()
        here = governor.read(workers).added  # the same idle tree, read on this thread
        assert threads[1] == threading.get_ident()
        assert governor.peak > 0 and abs(governor.peak - here) < 8 * 2**20
    finally:
        child.kill()
        child.wait()
