"""What ``/proc`` says of one process's memory: its O(1) counters, its ``smaps_rollup`` and its full
``smaps`` listing summed into the charge (process_memory.py: the charge model, and the reader that
decides which of these to read for each process of a job; own_charge.py: a worker reading itself).

Costs here (a process that imported torch): counters ~0.03 ms, rollup 0.6-1.5 ms (more where it
maps a large inherited state dict), full listing 4-9 ms.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

__all__ = [
    "FAULT_SLACK",
    "PAGE",
    "AnonymousPages",
    "Counters",
    "charge_and_pss",
    "charged_memory",
    "counter_drift",
    "exact_charge",
    "exact_reading",
    "read_counters",
    "rollup_anon",
    "smaps_charge",
    "smaps_sums",
]

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# How far a process's counters may stray from its pages without its charge being read again: its
# drift past this calls for a rollup, its file pages moved past it for a full reading.
FAULT_SLACK = 512 * 1024
_HEADER_FIELDS = 5  # start-end perms offset dev inode [path]


def charged_memory(pid: int) -> tuple[int, int]:
    """(charged, private) bytes of process ``pid``; (0, 0) once it is gone.

    ``charged`` is its PSS without program code (process_memory's module docstring); ``private`` is its USS, the
    pages no other process maps (which worker to stop when the ceiling is crossed). Where smaps
    cannot be read (another user's process, no procfs), RSS stands for both: it over-counts,
    never under-counts.
    """
    charged, private, _ = exact_charge(pid)
    return charged, private


def exact_charge(pid: int) -> tuple[int, int, int]:
    """(charged, private, pss) from the full smaps listing (PSS = RSS where smaps is unreadable)."""
    charged, private, pss, _ = exact_reading(pid)
    return charged, private, pss


@dataclass(frozen=True, slots=True)
class AnonymousPages:
    """What a full smaps listing says of a process's anonymous pages, in bytes (who grew:
    engine/breach.py): ``resident`` (``Anonymous``: what RssAnon counts), ``private`` (of them,
    mapped by this process alone: in each mapping, at most its private bytes) and ``huge`` (of
    them, in transparent huge pages: one fault each maps 512 pages)."""

    resident: int
    private: int
    huge: int


def exact_reading(pid: int) -> tuple[int, int, int, AnonymousPages | None]:
    """:func:`exact_charge`, and the process's :class:`AnonymousPages` (None where smaps is
    unreadable, or the process is gone).

    The listing is summed as it is read, a buffer at a time: read whole and split into lines, it
    held ~3.7 times its size in the reading process (the coordinator: 0.5 MiB of listing for a
    test process of 700 mappings late in a suite run, 1.7 MiB for 2,400), on each of the threads
    reading workers at once, and grew the coordinator by 1.8-6.4 MiB that no plan counts
    (COORDINATOR_RUN_BYTES: a one-worker save measured 6.4 MiB over it beside 1,860 mappings)."""
    try:
        with open(f"/proc/{pid}/smaps", "rb", buffering=_LISTING_BUFFER) as smaps:
            return _sum_listing(smaps)
    except (FileNotFoundError, ProcessLookupError):
        return 0, 0, 0, None
    except OSError:
        rss, _ = _resident(pid)
        return rss, rss, rss, None


def rollup_anon(pid: int) -> tuple[int, int, int] | None:
    """(Pss_Anon + Pss_Shmem, private, Anonymous - Pss_Anon) bytes from ``/proc/<pid>/smaps_rollup``;
    None where the kernel has no rollup or no per-kind split (before Linux 5.9), or it cannot be
    read. The last is what other processes hold of the anonymous pages this one maps (a page
    mapped by k processes: k-1 of its k parts, at least what this one holds of it)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as rollup:
            text = rollup.read()
    except OSError:
        return None
    anon = shmem = private = resident = 0
    split = False
    for line in text.splitlines():
        head, _, rest = line.partition(b":")
        if head == b"Pss_Anon":
            anon = int(rest.split()[0])
            split = True
        elif head == b"Pss_Shmem":
            shmem = int(rest.split()[0])
        elif head in (b"Private_Clean", b"Private_Dirty"):
            private += int(rest.split()[0])
        elif head == b"Anonymous":
            resident = int(rest.split()[0])
    return ((anon + shmem) * 1024, private * 1024, max(0, resident - anon) * 1024) if split else None


@dataclass(slots=True)
class Counters:
    """O(1) counters of one process: bytes of RssAnon + RssShmem, bytes of RssFile, minor faults,
    and bytes of RssShmem alone."""

    anon: int
    file: int
    faults: int
    shmem: int = 0


def counter_drift(before: Counters | None, after: Counters | None) -> int | None:
    """How far a rollup read between the counters ``before`` and ``after`` may be off in what it
    says the other sharers hold (resident less PSS): what the process gained, freed or faulted in
    meanwhile; None where either is unknown."""
    if before is None or after is None:
        return None
    return abs(after.anon - before.anon) + max(0, after.faults - before.faults) * PAGE


def read_counters(pid: int) -> Counters | None:
    """RssAnon + RssShmem, RssFile and minor faults of ``pid``; None once it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            text = status.read()
        with open(f"/proc/{pid}/stat", "rb") as stat:
            faults = int(stat.read().rpartition(b")")[2].split()[7])
    except (OSError, ValueError, IndexError):
        return None
    found = _RSS.search(text)
    if found is None:  # a kernel thread, or a zombie: no resident pages
        return Counters(0, 0, faults, 0)
    anon, file, shmem = (int(kib) * 1024 for kib in found.groups())
    return Counters(anon + shmem, file, faults, shmem)


# (one search, not a loop over the ~55 lines of ``status``: 51 -> ~30 us a process)
_RSS = re.compile(rb"RssAnon:\s+(\d+) kB\nRssFile:\s+(\d+) kB\nRssShmem:\s+(\d+) kB")


def smaps_charge(text: bytes) -> tuple[int, int]:
    """Sum one smaps listing: (charged, private) in bytes."""
    charged, private, _ = charge_and_pss(text)
    return charged, private


def charge_and_pss(text: bytes) -> tuple[int, int, int]:
    """Sum one smaps listing: (charged, private, PSS) in bytes, in one pass."""
    charged, private, pss, _ = smaps_sums(text)
    return charged, private, pss


_PSS, _PRIVATE_CLEAN, _PRIVATE_DIRTY, _ANONYMOUS, _HUGE = range(5)
_SUMMED = {
    b"Pss:": _PSS,
    b"Private_Clean:": _PRIVATE_CLEAN,
    b"Private_Dirty:": _PRIVATE_DIRTY,
    b"Anonymous:": _ANONYMOUS,
    b"AnonHugePages:": _HUGE,
}


def smaps_sums(text: bytes) -> tuple[int, int, int, AnonymousPages]:
    """Sum one smaps listing: (charged, private, PSS) in bytes and its :class:`AnonymousPages`, in one pass."""
    return _sum_listing(text.splitlines())


# What one full reading holds of the listing at a time (exact_reading): a few records' worth.
_LISTING_BUFFER = 64 * 1024


def _sum_listing(lines: Iterable[bytes]) -> tuple[int, int, int, AnonymousPages]:
    """(charged, private, PSS) in bytes of a listing's lines and its :class:`AnonymousPages`,
    holding one line and a sum per file (whether a file is program code is known only once all
    its mappings were seen)."""
    per_path: dict[bytes, list[int]] = {}  # path -> [Pss, Private_Dirty] of its mappings, kB
    code: set[bytes] = set()
    path = b""
    pss = private = dirty = anon = huge = 0
    all_private = anon_total = anon_private = huge_total = 0
    for line in lines:
        head, _, rest = line.partition(b" ")
        field = _SUMMED.get(head)  # (one lookup: most of the ~25 lines a mapping are none of these)
        if field is not None:
            value = int(rest.split()[0])
            if field == _PSS:
                pss = value
            elif field == _PRIVATE_CLEAN:
                private += value
            elif field == _PRIVATE_DIRTY:
                private += value
                dirty += value
            elif field == _ANONYMOUS:
                anon = value
            else:
                huge = value
            continue
        if head.endswith(b":"):
            continue
        if b"-" not in head:  # VmFlags and the like
            continue
        _add(per_path, path, pss, dirty)
        all_private, anon_total, anon_private = (
            all_private + private,
            anon_total + anon,
            anon_private + min(anon, private),
        )
        huge_total += huge
        fields = line.split(None, _HEADER_FIELDS)
        path = fields[_HEADER_FIELDS].rstrip(b"\n") if len(fields) > _HEADER_FIELDS else b""
        if path.startswith(b"/") and b"x" in fields[1]:
            code.add(path)
        pss = private = dirty = anon = huge = 0
    _add(per_path, path, pss, dirty)
    all_private, anon_total, anon_private = all_private + private, anon_total + anon, anon_private + min(anon, private)
    huge_total += huge
    charged = sum(sums[1] if mapped in code else sums[0] for mapped, sums in per_path.items())
    total = sum(sums[0] for sums in per_path.values())
    pages = AnonymousPages(anon_total * 1024, anon_private * 1024, huge_total * 1024)
    return charged * 1024, all_private * 1024, total * 1024, pages


def _add(per_path: dict[bytes, list[int]], path: bytes, pss: int, dirty: int) -> None:
    sums = per_path.setdefault(path, [0, 0])
    sums[0] += pss
    sums[1] += dirty


def _resident(pid: int) -> tuple[int, int]:
    try:
        rss = int(psutil.Process(pid).memory_info().rss)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return 0, 0
    return rss, rss
