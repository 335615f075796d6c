"""A tensor whose bytes are not in this process yet: copied once, straight into the writer's buffer.

    worker (a Saver's, or save()'s kept one)                 the caller (holds the tensor)
    ────────────────────────────────────────                 ─────────────────────────────
    ShardWriter: record template's prefix ──▶ gathered
                 PendingTensor.fill(offset, n, address) ◀── process_vm_readv, 1 MiB at a time,
                     address = the aligned O_DIRECT buffer          into the buffer itself
                     (or a reused 1 MiB scratch before a buffered write: tmpfs)
                 hash the piece there, while it is in the cache
                 record template's suffix

No page of fresh memory is touched per tensor: the bytes land where they are written from. A
:class:`PendingTensor` carries only what a record needs (dtype, sizes, strides, nbytes) and how to
copy its storage's bytes (in storage order: what torch.save writes).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["SCRATCH_BYTES", "PendingTensor", "scratch"]

# What a buffered stream is filled through, a piece at a time: small enough to stay in a core's
# cache between the copy in, the hash and the write; kept by the thread for the next piece.
SCRATCH_BYTES = 1024 * 1024

_local = threading.local()


@dataclass(frozen=True, slots=True)
class PendingTensor:
    """A plain CPU tensor of ``dtype``, ``shape`` and ``strides`` whose storage is exactly its
    ``nbytes`` (contiguous, or a dense permutation), not yet copied here. ``fill(offset, n,
    address)`` copies bytes ``offset:offset + n`` of its storage to ``address`` in this process
    (and raises OSError where it cannot: the owner is gone, or freed the tensor)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    nbytes: int
    fill: Callable[[int, int, int], None]
    # The owner's tensor's (DCP records it in .metadata, as stock's save does from the tensor).
    requires_grad: bool = False

    def is_pinned(self) -> bool:
        return False

    def materialize(self) -> torch.Tensor:
        """The tensor itself, copied into fresh memory (for the paths that need one: a cast, a
        compressed record, a record class torch.save must write)."""
        raw = torch.empty(self.nbytes, dtype=torch.uint8)
        if self.nbytes:
            self.fill(0, self.nbytes, raw.data_ptr())
        return torch.as_strided(raw.view(self.dtype), self.shape, self.strides)


def scratch() -> tuple[memoryview, int]:
    """This thread's scratch (:data:`SCRATCH_BYTES`, made once, reused by every later write): a
    view of it and its address."""
    kept = getattr(_local, "scratch", None)
    if kept is None:
        buffer = bytearray(SCRATCH_BYTES)
        kept = (memoryview(buffer), ctypes.addressof((ctypes.c_char * SCRATCH_BYTES).from_buffer(buffer)))
        _local.scratch = kept
    return kept
