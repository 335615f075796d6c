"""Output tensors for a load: large ones in anonymous memory the kernel may back with huge pages.

A load writes every byte of its outputs once, from the reading threads. With 4 KiB pages, 1 GiB is
262,144 page faults, each taking the process's memory-map lock; on a small VM that alone took as
long as reading the bytes (512 MiB from the page cache: 0.59-0.91 s into ``torch.empty``, 0.26-0.31 s
into memory advised ``MADV_HUGEPAGE``, same CPU seconds). Where transparent huge pages are off, or the
advice is refused, the memory is ordinary anonymous memory: nothing else changes.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

__all__ = ["HUGE_MIN_BYTES", "empty"]

# Below this a tensor holds at most one huge page: torch's own allocator is as good.
HUGE_MIN_BYTES = 4 << 20


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor; one of at least :data:`HUGE_MIN_BYTES` lives in a mapping of
    its own, advised for huge pages, and freed with the tensor."""
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_MIN_BYTES or advise is None:
        return torch.empty(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # huge pages off or unsupported: ordinary pages
        memory.madvise(advise)
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)
