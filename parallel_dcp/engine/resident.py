"""Resident sizes of a few processes, read every 50 ms by the memory watchdog's cheap bound.

The watchdog proves the tree under its ceiling from resident sizes while it can (a process is
never charged more than its RSS). psutil's ``memory_info`` opens, reads and parses
``/proc/PID/statm`` each time: ~70 us a process on this project's 2-core VM, ~20 readings a
second, the largest part of the governor's time beside a Saver's workers. Here each process's
``statm`` is opened once and read again with one ``pread`` (~1 us). A kept descriptor reads only
the process it was opened for: once that process is reaped the read fails (ESRCH) and the process
counts for nothing, even where its pid is reused meanwhile (a kept psutil handle would read the
new process).
"""

from __future__ import annotations

import errno
import os
import weakref
from collections.abc import Sequence

__all__ = ["ResidentSizes"]

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _close_all(fds: dict[int, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


class ResidentSizes:
    """``read(pids)``: each process's resident bytes; a process that is gone (or cannot be read)
    counts 0. Descriptors of pids no longer asked about are closed; the rest by :meth:`close` or
    when this object is collected."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self._finalizer = weakref.finalize(self, _close_all, self._fds)

    def of(self, pid: int) -> int:
        """One process's resident bytes (0: gone)."""
        fd = self._fds.get(pid)
        if fd is None:
            try:
                fd = os.open(f"/proc/{pid}/statm", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return 0
            self._fds[pid] = fd
        try:
            fields = os.pread(fd, 128, 0).split()
        except OSError as error:
            if error.errno not in (errno.ESRCH, errno.ENOENT):
                raise
            return 0
        return int(fields[1]) * _PAGE if len(fields) > 1 else 0

    def read(self, pids: Sequence[int]) -> list[int]:
        """The resident bytes of each of ``pids``; the descriptors of other pids are closed."""
        for pid in [p for p in self._fds if p not in pids]:
            os.close(self._fds.pop(pid))
        return list(map(self.of, pids))

    def close(self) -> None:
        self._finalizer()
