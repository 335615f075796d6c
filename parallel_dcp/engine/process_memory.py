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

Reading ``smaps`` costs ~9 ms of CPU for a process that has imported torch (one text record per
mapping, hundreds of them; parsed in Python), so a watchdog reading 64 workers that way spends
~0.6 s per reading. :class:`ChargeReader` reads it once per process, to learn how much of its PSS
is program code, and from then on reads ``smaps_rollup`` (the kernel's totals, one short record:
~1 ms): the charge is the exact charge of the last full reading plus how far PSS moved since.
What that misses is only a change in the code's share (a neighbour mapping the same libraries
started or exited, the tree grew); full readings catch up with it (see ChargeReader).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

__all__ = ["ChargeReader", "charged_memory"]

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


def _rollup(pid: int) -> tuple[int, int] | None:
    """(pss, private) from ``/proc/<pid>/smaps_rollup``; (0, 0) once the process is gone; None
    where the kernel has no rollup (before Linux 4.14) or it cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as rollup:
            text = rollup.read()
    except ProcessLookupError:
        return 0, 0
    except OSError:
        return None if psutil.pid_exists(pid) else (0, 0)
    pss = private = 0
    for line in text.splitlines():
        head, _, rest = line.partition(b":")
        if head == b"Pss":
            pss = int(rest.split()[0])
        elif head in (b"Private_Clean", b"Private_Dirty"):
            private += int(rest.split()[0])
    return pss * 1024, private * 1024


# A process's code share is read again at least this often (seconds), one process per reading: a
# neighbour that maps the same libraries moves it without the job doing anything.
_CODE_REFRESH_S = 5.0
# After the tree changed (a worker started or exited; the code is shared among more or fewer
# processes), every process is read in full again, at most this often while it keeps changing.
_MEMBERSHIP_REFRESH_S = 1.0


@dataclass(slots=True)
class _Known:
    code: int  # PSS the charge leaves out (program code), as of ``at``
    at: float


class ChargeReader:
    """The charges of a process tree, read cheaply and repeatedly (module docstring).

    :meth:`plan` says which processes a reading must read in full: a process never read in full;
    every process once the set of processes changed (at most every ``_MEMBERSHIP_REFRESH_S``);
    otherwise the one whose full reading is oldest, once older than ``_CODE_REFRESH_S``; or all
    of them when the caller asks for an exact reading (before acting on a breach). :meth:`charge`
    reads one process (thread-safe for distinct pids: the reads release the GIL in the kernel).
    """

    def __init__(self) -> None:
        self._known: dict[int, _Known] = {}
        self._members: frozenset[int] = frozenset()
        self._all_read_at = float("-inf")
        self.full_reads = 0  # how many processes were read in full, over all readings
        self.readings = 0

    def plan(self, pids: Sequence[int], *, exact: bool = False) -> list[bool]:
        """For each of ``pids``: whether this reading reads it in full."""
        now = time.monotonic()
        members = frozenset(pids)
        if members != self._members and now - self._all_read_at >= _MEMBERSHIP_REFRESH_S:
            exact = True
        if exact:
            self._members, self._all_read_at = members, now
            self._known = {pid: known for pid, known in self._known.items() if pid in members}
            self.readings += 1
            self.full_reads += len(pids)
            return [True] * len(pids)
        full = [pid not in self._known for pid in pids]
        known = [(self._known[pid].at, i) for i, pid in enumerate(pids) if pid in self._known]
        if known and not any(full):
            at, oldest = min(known)
            full[oldest] = now - at >= _CODE_REFRESH_S
        self.readings += 1
        self.full_reads += sum(full)
        return full

    def charge(self, pid: int, full: bool) -> tuple[int, int]:
        """(charged, private) bytes of ``pid``: exact when ``full`` (or no rollup is readable),
        else the last exact charge plus PSS's move since (never below zero)."""
        known = self._known.get(pid)
        if not full and known is not None:
            rollup = _rollup(pid)
            if rollup is not None:
                pss, private = rollup
                return (max(0, pss - known.code), private) if pss or private else (0, 0)
        charged, private, pss = _exact(pid)
        if pss or private:
            self._known[pid] = _Known(code=max(0, pss - charged), at=time.monotonic())
        return charged, private


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
