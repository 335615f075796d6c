"""What one process holds that a job can be charged for, read from ``/proc/<pid>/smaps``.

PSS splits a shared page among every process on the node that maps it, not only among the job's
own processes. Program code (torch's shared libraries: ~130 MiB resident in a process that has
imported torch) is mapped by every Python process using torch, so a process's PSS moves by tens of
MiB when an unrelated torch process starts or exits: measured, 329 MiB alone, 223 MiB beside four
other torch processes, 329 MiB again once they exit. A job's own memory did not change; a ceiling
counted in plain PSS would abort a job because a neighbour ended.

So the charge is PSS without the file-backed pages of program code: every mapping of a file that
this process maps executable somewhere (shared libraries, the interpreter), except the pages of
those mappings this process alone has dirtied (relocations, globals: its own memory). Everything
else counts as PSS: the heap and anonymous memory (shared only with the job's own forks), shared
memory, and any data file mapped in (a source read through mmap: its pages count once among the
job's processes that map it). What the charge leaves out is loading code, which every process
pays once and shares; not what a job's memory limit is about.

Reading ``smaps`` costs ~4-9 ms of CPU for a process that has imported torch (one text record
per mapping, hundreds of them; parsed in Python), ``smaps_rollup`` ~1.8 ms (the kernel still walks
every page table), ``/proc/<pid>/status`` and ``stat`` ~0.01 ms (counters the kernel keeps). So
:class:`ChargeReader` reads a process in full once, and then adds to that exact charge only what
no neighbour can move:

- anonymous and shared-memory pages (``Pss_Anon + Pss_Shmem`` from ``smaps_rollup``): anonymous
  pages are shared only with the process's own forks, whose starts and exits are the tree's own
  changes (they force a rollup of every process);
- file pages by their resident size (``RssFile`` growth, never below the exact reading): a data
  file mapped in (a source) is charged at most in full; a neighbour mapping or unmapping the same
  libraries moves PSS but not RSS;
- while a process's counters show no fault beyond what its resident anonymous size grew by
  (``/proc/<pid>/stat`` minor faults, ``status`` RssAnon/RssShmem/RssFile), even the rollup is
  skipped: the charge is the last rollup's plus that growth plus every fault that did not add a
  resident page (an upper bound on pages copied on write). Past a few faults, a shrink, or a
  second since the last rollup, the rollup is read.

A reading is an upper bound of the exact charge within a few hundred KiB a process, never below
it by more than the pages a sibling copied on write since its last rollup; before acting on a
breach the governor reads every process in full.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

__all__ = ["CHEAP", "FULL", "ROLLUP", "ChargeReader", "charged_memory"]

_HEADER_FIELDS = 5  # start-end perms offset dev inode [path]


def charged_memory(pid: int) -> tuple[int, int]:
    """(charged, private) bytes of process ``pid``; (0, 0) once it is gone.

    ``charged`` is its PSS without program code (module docstring); ``private`` is its USS, the
    pages no other process maps (which worker to stop when the ceiling is crossed). Where smaps
    cannot be read (another user's process, no procfs), RSS stands for both: it over-counts,
    never under-counts.
    """
    charged, private, _ = _exact(pid)
    return charged, private


def _exact(pid: int) -> tuple[int, int, int]:
    """(charged, private, pss) from the full smaps listing (PSS = RSS where smaps is unreadable)."""
    try:
        with open(f"/proc/{pid}/smaps", "rb") as smaps:
            text = smaps.read()
    except (FileNotFoundError, ProcessLookupError):
        return 0, 0, 0
    except OSError:
        rss, _ = _resident(pid)
        return rss, rss, rss
    return _charge_and_pss(text)


def _rollup_anon(pid: int) -> tuple[int, int] | None:
    """(Pss_Anon + Pss_Shmem, private) bytes from ``/proc/<pid>/smaps_rollup``; None where the
    kernel has no rollup or no per-kind split (before Linux 5.9), or it cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as rollup:
            text = rollup.read()
    except OSError:
        return None
    anon = private = 0
    split = False
    for line in text.splitlines():
        head, _, rest = line.partition(b":")
        if head in (b"Pss_Anon", b"Pss_Shmem"):
            anon += int(rest.split()[0])
            split = True
        elif head in (b"Private_Clean", b"Private_Dirty"):
            private += int(rest.split()[0])
    return (anon * 1024, private * 1024) if split else None


# A process's exact charge is read again at least this often (seconds), one process per reading:
# the growth in RssFile (code paged in) it may have added is an over-count, never an under-count.
_CODE_REFRESH_S = 5.0
# A process is rolled up (smaps_rollup) at least this often, and whenever it faulted in more than
# _FAULT_SLACK bytes beyond what its resident anonymous memory grew by since the last rollup.
_ROLLUP_REFRESH_S = 1.0
_FAULT_SLACK = 512 * 1024
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

CHEAP, ROLLUP, FULL = 0, 1, 2  # how a reading reads one process (ChargeReader.plan)


@dataclass(slots=True)
class _Counters:
    """O(1) counters of one process: bytes of RssAnon + RssShmem, bytes of RssFile, minor faults."""

    anon: int
    file: int
    faults: int


@dataclass(slots=True)
class _Known:
    exact: int  # the charge of the last full reading
    exact_anon: int  # Pss_Anon + Pss_Shmem then
    exact_file: int  # RssFile then
    at: float  # when
    charged: int  # the charge of the last rollup (or full reading)
    private: int
    counters: _Counters  # the counters then
    rolled_at: float
    rolled_anon: int  # Pss_Anon + Pss_Shmem then


class ChargeReader:
    """The charges of a process tree, read cheaply and repeatedly (module docstring).

    :meth:`plan` says how a reading reads each process: in full (``FULL``) a process never read in
    full, the one whose full reading is oldest once older than ``_CODE_REFRESH_S``, or all of them
    when the caller asks for an exact reading (before acting on a breach); ``ROLLUP`` every
    process once the set of processes changed (a fork or exit moves the anonymous shares);
    otherwise ``CHEAP`` (the counters decide, :meth:`charge`). :meth:`charge` reads one process
    (thread-safe for distinct pids: the reads release the GIL in the kernel).
    """

    def __init__(self) -> None:
        self._known: dict[int, _Known] = {}
        self._members: frozenset[int] = frozenset()
        self.full_reads = 0  # how many processes were read in full, over all readings
        self.rollups = 0  # how many were rolled up (counted by charge)
        # A rollup saw shared anonymous pages turn private (copy on write): the other sharers'
        # shares grew too, so the next reading rolls every process up.
        self._shares_moved = False
        self.readings = 0

    def plan(self, pids: Sequence[int], *, exact: bool = False) -> list[int]:
        """For each of ``pids``: how this reading reads it (``CHEAP``, ``ROLLUP`` or ``FULL``)."""
        now = time.monotonic()
        members = frozenset(pids)
        self.readings += 1
        if exact:
            plan = [FULL] * len(pids)
        else:
            changed = members != self._members or self._shares_moved
            self._shares_moved = False
            plan = [FULL if pid not in self._known else ROLLUP if changed else CHEAP for pid in pids]
            known = [(self._known[pid].at, i) for i, pid in enumerate(pids) if pid in self._known]
            if known and FULL not in plan:
                at, oldest = min(known)
                if now - at >= _CODE_REFRESH_S:
                    plan[oldest] = FULL
        self._members = members
        self._known = {pid: known for pid, known in self._known.items() if pid in members}
        self.full_reads += plan.count(FULL)
        return plan

    def charge(self, pid: int, how: int) -> tuple[int, int]:
        """(charged, private) bytes of ``pid``, read as ``how`` says (:meth:`plan`); (0, 0) once
        it is gone. Exact where the kernel offers no rollup or the process was never read in full."""
        known = self._known.get(pid)
        if how != FULL and known is not None:
            counters = _counters(pid)
            if counters is None:
                return 0, 0
            cheap = self._cheap(known, counters) if how == CHEAP else None
            if cheap is not None:
                return cheap
            rollup = _rollup_anon(pid)
            if rollup is not None:
                anon, private = rollup
                self.rollups += 1
                charged = max(0, known.exact + anon - known.exact_anon + max(0, counters.file - known.exact_file))
                if (anon - known.rolled_anon) - (counters.anon - known.counters.anon) > _FAULT_SLACK:
                    self._shares_moved = True
                known.charged, known.private, known.counters = charged, private, counters
                known.rolled_at, known.rolled_anon = time.monotonic(), anon
                return charged, private
        return self._full(pid)

    def _cheap(self, known: _Known, now: _Counters) -> tuple[int, int] | None:
        then = known.counters
        grown = now.anon - then.anon
        faults = (now.faults - then.faults) * _PAGE
        if grown < 0 or faults - grown > _FAULT_SLACK or time.monotonic() - known.rolled_at >= _ROLLUP_REFRESH_S:
            return None  # pages freed (maybe shared ones) or copied on write: read the rollup
        # Every fault that did not add a resident page may have copied a shared one (upper bound).
        copied = max(0, faults - grown)
        files = max(0, now.file - known.exact_file) - max(0, then.file - known.exact_file)
        return known.charged + grown + copied + files, known.private + grown + copied

    def _full(self, pid: int) -> tuple[int, int]:
        counters = _counters(pid)
        rollup = _rollup_anon(pid)
        charged, private, pss = _exact(pid)
        if counters is None or not (pss or private):
            self._known.pop(pid, None)
            return charged, private
        if rollup is not None:
            now = time.monotonic()
            anon = rollup[0]
            self._known[pid] = _Known(charged, anon, counters.file, now, charged, private, counters, now, anon)
        return charged, private


def _counters(pid: int) -> _Counters | None:
    """RssAnon + RssShmem, RssFile and minor faults of ``pid``; None once it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            text = status.read()
        with open(f"/proc/{pid}/stat", "rb") as stat:
            faults = int(stat.read().rpartition(b")")[2].split()[7])
    except (OSError, ValueError, IndexError):
        return None
    anon = file = 0
    for line in text.splitlines():
        if line.startswith((b"RssAnon:", b"RssShmem:")):
            anon += int(line.split()[1]) * 1024
        elif line.startswith(b"RssFile:"):
            file = int(line.split()[1]) * 1024
    return _Counters(anon, file, faults)


def _charge(text: bytes) -> tuple[int, int]:
    """Sum one smaps listing: (charged, private) in bytes."""
    charged, private, _ = _charge_and_pss(text)
    return charged, private


def _charge_and_pss(text: bytes) -> tuple[int, int, int]:
    """Sum one smaps listing: (charged, private, PSS) in bytes, in one pass."""
    mappings: list[tuple[bytes, int, int, int]] = []  # path, Pss, Private_Clean + Private_Dirty, Private_Dirty
    code: set[bytes] = set()
    path = b""
    pss = private = dirty = 0
    for line in text.splitlines():
        head, _, rest = line.partition(b" ")
        if head.endswith(b":"):
            if head == b"Pss:":
                pss = int(rest.split()[0])
            elif head == b"Private_Clean:":
                private += int(rest.split()[0])
            elif head == b"Private_Dirty:":
                value = int(rest.split()[0])
                private += value
                dirty += value
            continue
        if b"-" not in head:  # VmFlags and the like
            continue
        if path or pss or private:
            mappings.append((path, pss, private, dirty))
        fields = line.split(None, _HEADER_FIELDS)
        path = fields[_HEADER_FIELDS] if len(fields) > _HEADER_FIELDS else b""
        if path.startswith(b"/") and b"x" in fields[1]:
            code.add(path)
        pss = private = dirty = 0
    mappings.append((path, pss, private, dirty))
    charged = sum(dirty if mapped in code else pss for mapped, pss, _, dirty in mappings)
    total = sum(pss for _, pss, _, _ in mappings)
    return charged * 1024, sum(private for _, _, private, _ in mappings) * 1024, total * 1024


def _resident(pid: int) -> tuple[int, int]:
    try:
        rss = int(psutil.Process(pid).memory_info().rss)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return 0, 0
    return rss, rss
