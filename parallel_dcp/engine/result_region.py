"""Where one run's results are mapped in the coordinator: one reserved address range, unmapped once.

A worker's result comes with a memory file of its large bytes (engine/messages.py), which the
coordinator maps, every page at once (``MAP_POPULATE``: the memory governor charges the pages to
the coordinator from the moment it holds them). Mapped each on its own, each result was unmapped
on its own when its last view went, at the commit: one ``munmap`` a result, a TLB flush each in a
process of many threads (a Saver's save of 50,000 keys cut into 64 tasks: ~65 us of CPU a result,
all on the save's serial path). Here a run's results go side by side into one reserved range:

    reserve   mmap(PROT_NONE, anonymous, MAP_NORESERVE)    1 GiB of addresses, no memory
    result    mmap(fd, MAP_FIXED | MAP_SHARED | MAP_POPULATE) at the next free page: charged now
    end       the last view of any result in it gone: one munmap of the whole range

No address of a range is used twice: a view reads the bytes of its own result, or nothing is
mapped there any more because no view is left. The range's pages are freed together, when the
run's last result is dropped (a Saver's results all live until its commit). A result too large
for a range (a quarter of it) gets a mapping of its own, as before.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import weakref
from typing import Any

__all__ = ["ResultNotMapped", "ResultRegion", "mapping_libc"]


class ResultNotMapped(OSError):
    """This process (the coordinator) could not map a worker's result: its own address space or
    memory, not the worker's failure (the worker replied, and lives)."""

    def __init__(self, error: int) -> None:
        super().__init__(
            error,
            f"cannot map a worker's result into this process: {os.strerror(error)} (this process's address "
            "space or memory is exhausted: a ulimit -v, or the memory limit's room taken by the caller)",
        )


# Addresses reserved a range: no memory (PROT_NONE, MAP_NORESERVE), only page-table room when used.
SPAN = 1 << 30
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_PROT_NONE = 0
_RESULT = mmap.MAP_SHARED | mmap.MAP_POPULATE | _MAP_FIXED  # (see engine/messages.py's _SHARED_NOW)
_PAGE = mmap.PAGESIZE
_AREA = ctypes.c_char * SPAN


@functools.cache
def mapping_libc() -> Any:
    """libc with ``mmap`` and ``munmap`` typed (shared with engine/messages.py)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _failed(address: int | None) -> bool:
    return address is None or address == ctypes.c_void_p(-1).value  # MAP_FAILED


def _unmap(ranges: list[tuple[int, int]]) -> None:
    for address, length in ranges:
        if length:
            mapping_libc().munmap(address, length)


class ResultRegion:
    """One run's results, mapped side by side (:meth:`map`); drop it at the run's end: its ranges
    are unmapped when the last view of a result in them goes."""

    def __init__(self) -> None:
        self._whole: memoryview | None = None  # the current range, viewed whole (never read whole)
        self._base = 0
        self._at = 0  # the next free offset in it
        self._ranges: list[tuple[int, int]] = []  # what its finalizer unmaps
        self._unreservable = False  # the kernel refused a range: map each result on its own

    def map(self, fd: int, size: int) -> memoryview | None:
        """The first ``size`` bytes of memory file ``fd``, mapped read-only and populated at the next
        free page of the current range; None where the result is too large for a range, or where no
        range could be reserved (the caller maps it on its own).

        Raises:
            ResultNotMapped: the kernel refused the mapping (the range is then closed: no later result goes
                into it, and its finalizer leaves the refused pages alone).
        """
        pages = -(-size // _PAGE) * _PAGE
        if pages > SPAN // 4 or self._unreservable:
            return None
        if self._whole is None or self._at + pages > SPAN:
            try:
                self._reserve()
            except OSError:
                # No room for a range's addresses (a process under ``ulimit -v``): this run's
                # results are mapped each on its own, as before ranges.
                self._unreservable = True
                return None
        assert self._whole is not None  # (for mypy: _reserve made it)
        at, address = self._at, self._base + self._at
        got = mapping_libc().mmap(address, size, mmap.PROT_READ, _RESULT, fd, 0)
        if _failed(got) or got != address:
            error = ctypes.get_errno()
            # A failed MAP_FIXED may have unmapped our reservation there, and the kernel may give
            # those addresses to anyone: never unmap them later.
            self._ranges[:] = [(self._base, at), (address + pages, SPAN - at - pages)]
            self._whole = None
            raise ResultNotMapped(error)
        self._at += pages
        return self._whole[at : at + size]

    def _reserve(self) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        base = mapping_libc().mmap(None, SPAN, _PROT_NONE, flags, -1, 0)
        if _failed(base):
            error = ctypes.get_errno()
            raise OSError(error, f"cannot reserve addresses for workers' results: {os.strerror(error)}")
        area = _AREA.from_address(base)
        self._ranges = [(base, SPAN)]
        # Unmapped when the last view of it goes (every view is a slice of this one); the process's end unmaps it too.
        weakref.finalize(area, _unmap, self._ranges).atexit = False
        self._whole = memoryview(area).cast("B").toreadonly()
        self._base, self._at = base, 0
