"""What a worker's C allocator does with memory it frees: given back to the kernel, so a task
holds what its plan counts (the largest of its reads, not their sum) and nothing after it.

glibc's malloc serves a request of at least its mmap threshold with a mapping of its own, which
``free`` unmaps at once; a smaller one comes from the heap, whose freed chunks stay in the process
until reused or trimmed. The threshold starts at 128 KiB and is dynamic: freeing a mapped chunk
larger than it raises it to that chunk's size (up to 32 MiB). After a process has freed one 8 MiB
tensor, every later 8 MiB read comes from the heap, and there a freed read is not reused by the
next read of the same size (torch allocates with ``posix_memalign``, which asks for more than the
hole the last one left): the heap grows by read after read until holes happen to merge. A forked
worker inherits its caller's raised threshold (a script that saved, then diffs), and a fresh one
raises its own at its first freed read. Measured (round nine's review, F7): a ``diff`` worker hashing 8
reads of 8 MiB in one task held 42 MiB of private heap (50 MiB when forked from a caller that had
saved them first), where the plan counts 8; a 2-worker diff under 100 MiB breached at 110 MiB.

:func:`fix_mmap_threshold` pins the threshold at glibc's starting value (``mallopt``
M_MMAP_THRESHOLD, which also turns the raising off) as a worker starts, however it was started
(fork, fork server, spawn): every allocation of 128 KiB or more is then a mapping of its own,
returned when freed, and smaller ones stay on the heap's fast path (many small tensors never
reach the threshold), trimmed between tasks (:func:`return_freed_memory`). Trimming after every
read instead cost 0.6-3.4 ms a call in a worker's heap and still left two reads' worth resident.

Not covered (open): malloc looks in its free lists before it maps, whatever the threshold. A worker
forked from a caller whose heap holds large free chunks (tensors it allocated from the heap after
its own threshold was raised, then freed) still serves reads from those inherited holes, and a
freed one is not always the one the next read takes: a verify against a reference after a save in
the same interpreter measured up to 61 MiB in a worker where one 8 MiB read was planned. Fencing
those chunks off at the worker's start, or starting such workers from the fork server (a fresh
heap), would close it; neither is done here.

The caller's own process is left as its owner set it: ``mallopt`` cannot be undone (the dynamic
threshold does not come back), and changing the allocator of a training process for good is not
a checkpoint library's call. Where the caller's process reads (``load`` without workers, a
coordinator), the governor charges what it actually grows by.

On a C library other than glibc both are no-ops: musl maps large allocations at a fixed threshold
of its own and has no ``malloc_trim``; elsewhere there is no ``mallopt`` to call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

__all__ = ["MMAP_THRESHOLD_BYTES", "fix_mmap_threshold", "return_freed_memory"]

# glibc's own starting threshold (DEFAULT_MMAP_THRESHOLD_MIN): what it uses until a free raises it.
MMAP_THRESHOLD_BYTES = 128 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


@functools.cache
def _glibc() -> Any:
    """The C library where it is glibc (it has ``gnu_get_libc_version``), else None."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name, use_errno=True) if name else None
    return libc if libc is not None and hasattr(libc, "gnu_get_libc_version") else None


def fix_mmap_threshold() -> bool:
    """Pin this process's mmap threshold at :data:`MMAP_THRESHOLD_BYTES`, the dynamic raising off
    (a worker, as it starts). Returns whether glibc took it (False: not glibc, nothing done)."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1)


def return_freed_memory() -> None:
    """Give freed heap pages back to the OS between tasks, so the governor sees real usage."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
