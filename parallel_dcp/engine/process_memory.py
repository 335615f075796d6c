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
"""

from __future__ import annotations

import psutil

__all__ = ["charged_memory"]

_HEADER_FIELDS = 5  # start-end perms offset dev inode [path]


def charged_memory(pid: int) -> tuple[int, int]:
    """(charged, private) bytes of process ``pid``; (0, 0) once it is gone.

    ``charged`` is its PSS without program code (module docstring); ``private`` is its USS, the
    pages no other process maps (which worker to stop when the ceiling is crossed). Where smaps
    cannot be read (another user's process, no procfs), RSS stands for both: it over-counts,
    never under-counts.
    """
    try:
        with open(f"/proc/{pid}/smaps", "rb") as smaps:
            text = smaps.read()
    except (FileNotFoundError, ProcessLookupError):
        return 0, 0
    except OSError:
        return _resident(pid)
    return _charge(text)


def _charge(text: bytes) -> tuple[int, int]:
    """Sum one smaps listing: (charged, private) in bytes."""
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
    return charged * 1024, sum(private for _, _, private, _ in mappings) * 1024


def _resident(pid: int) -> tuple[int, int]:
    try:
        rss = int(psutil.Process(pid).memory_info().rss)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return 0, 0
    return rss, rss
