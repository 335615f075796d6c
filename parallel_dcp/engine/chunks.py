"""Split one huge tensor into row ranges that different tasks write as DCP chunks.

A tensor larger than the chunk threshold becomes ``n`` contiguous ranges along dimension 0 (or
the first dimension long enough, when dimension 0 is too short; a 0-dim or one-row tensor is
never split). Each range is its own unit of work, written (by
:mod:`parallel_dcp.formats.dcp_format`) as a ``SHARD`` write item with its offsets, exactly as
DCP records a sharded tensor: the merged ``.metadata`` holds one ``TensorStorageMetadata`` whose ``chunks`` list every
range, so stock ``dcp.load`` reassembles it into a plain tensor or any other sharding.

    threshold = min(max(total / workers / 2, 32 MiB), memory each task may use)   (or chunk_size=)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = [
    "MIN_CHUNK_BYTES",
    "Chunk",
    "ChunkUnit",
    "Splittable",
    "chunk_count",
    "chunk_threshold",
    "exact_storage",
    "lazy_bits",
    "resolved",
    "split",
]

# Below this, splitting costs more in per-item overhead than it gains in balance.
MIN_CHUNK_BYTES = 32 * 1024 * 1024
# Chunks smaller than this, forced by a tight memory limit, would be thousands of tiny records.
MIN_MEMORY_CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Chunk:
    """Rows ``start:stop`` of ``key`` along ``dim``; ``shape`` is the whole tensor's."""

    key: str
    dim: int
    start: int
    stop: int
    shape: tuple[int, ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(self.start if d == self.dim else 0 for d in range(len(self.shape)))

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.stop - self.start if d == self.dim else n for d, n in enumerate(self.shape))

    def nbytes(self, itemsize: int) -> int:
        return math.prod(self.sizes) * itemsize

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This chunk of the whole tensor (a view)."""
        return tensor.narrow(self.dim, self.start, self.stop - self.start)


class ChunkUnit(str):
    """The identity of a chunk's unit of work: it reads as ``key[dim:start:stop]`` (in messages and
    listings) but is equal only to the unit of the same chunk, never to a plain string, so a key
    literally named ``a[0:0:16]`` cannot take the place of a range of ``a`` in any mapping."""

    chunk: Chunk

    def __new__(cls, chunk: Chunk) -> ChunkUnit:
        unit = super().__new__(cls, f"{chunk.key}[{chunk.dim}:{chunk.start}:{chunk.stop}]")
        unit.chunk = chunk
        return unit

    def __eq__(self, other: object) -> bool:
        return type(other) is ChunkUnit and self.chunk == other.chunk

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((ChunkUnit, self.chunk))

    def __reduce__(self) -> tuple[type[ChunkUnit], tuple[Chunk]]:
        return (ChunkUnit, (self.chunk,))


def exact_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when its storage is exactly its bytes; for a contiguous view into a larger
    storage (a row range of a tensor), an alias over just its bytes (no copy). Other views are
    returned as they are (the writer copies them). The alias requires grad where ``tensor`` does.

    DCP copies any tensor whose storage is larger than its elements, so that ``torch.save`` does not
    write the whole storage: a chunk of a 10 GiB embedding would otherwise cost a copy of itself.
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0 or not tensor.is_contiguous() or tensor.untyped_storage().nbytes() == nbytes:
        return tensor
    flat_bytes = tensor.detach().reshape(-1).view(torch.uint8)  # numpy has no bfloat16 / float8: bytes
    alias = torch.from_numpy(flat_bytes.numpy()).view(tensor.dtype).reshape(tensor.shape)
    # (.metadata records requires_grad, as stock's save does from the tensor it was given)
    return alias.requires_grad_() if tensor.requires_grad else alias


def lazy_bits(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[bool, bool] | None:
    """(its conjugate bit, its negative bit) where ``tensor`` (of ``dtype``) is a lazy view, whose
    bytes are not its values (``x.conj()``; ``x.conj().imag`` and ``torch._neg_view(x)``; also
    ``detach``, ``torch.load`` and ``nn.Parameter`` of one, which are no views); None otherwise.
    One call into torch a tensor (~0.3 us; only a complex tensor can have its conjugate bit set)."""
    neg = tensor.is_neg()
    conj = dtype.is_complex and tensor.is_conj()
    return (conj, neg) if neg or conj else None


def resolved(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in memory of their own where it is a lazy view (its conjugate or
    negative bit set: ``x.conj()``, ``x.conj().imag``, whose bytes are not its values; a copy);
    ``tensor`` itself otherwise. A writer that copies a tensor's bytes must take these instead."""
    return tensor.resolve_conj().resolve_neg()


def chunk_threshold(total_bytes: int, workers: int, task_budget: int) -> int:
    """Tensors larger than this are split: half a balanced share, at least ``MIN_CHUNK_BYTES``,
    and never more than one task may hold under the memory limit (unless that leaves less than
    ``MIN_MEMORY_CHUNK_BYTES``: then the limit is too low for any chunk, and the item is left
    whole to fail early with a clear error)."""
    balanced = max(total_bytes // max(workers, 1) // 2, MIN_CHUNK_BYTES)
    return balanced if task_budget < MIN_MEMORY_CHUNK_BYTES else min(balanced, task_budget)


class Splittable(Protocol):
    """What :func:`split` needs to know of a tensor (a format's ``Entry`` is one)."""

    @property
    def key(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def nbytes(self) -> int: ...


def chunk_count(entry: Splittable, threshold: int) -> int:
    """At most how many chunks :func:`split` makes of ``entry`` (1: it stays whole), from the
    shape alone: a planner admits this many units before it builds them (a hostile checkpoint's
    claimed size must not make the coordinator build millions of chunks)."""
    found = _dim_and_count(entry, threshold)
    return found[1] + 1 if found is not None else 1  # aligning the bounds may add the last one


def _dim_and_count(entry: Splittable, threshold: int) -> tuple[int, int] | None:
    """The dimension :func:`split` cuts and into how many ranges (before alignment, which only
    merges bounds); None when ``entry`` stays whole."""
    if entry.nbytes <= threshold or not entry.shape or entry.shape[0] <= 1:
        return None
    wanted = math.ceil(entry.nbytes / threshold)
    dim = next((d for d, n in enumerate(entry.shape) if n >= wanted), None)
    if dim is None:  # no dimension has that many rows: split the longest as far as it goes
        dim = max(range(len(entry.shape)), key=lambda d: entry.shape[d])
    rows = entry.shape[dim]
    count = min(wanted, rows)
    row_bytes = entry.nbytes // rows
    if row_bytes > threshold // 8:
        # Rows are coarse (4 experts of an MoE weight): the largest chunk, a whole number of
        # rows, can overshoot by up to a row; take enough chunks that it fits.
        count = min(max(count, math.ceil(rows / max(1, threshold // max(1, row_bytes)))), rows)
    return (dim, count) if count >= 2 else None


def split(entry: Splittable, threshold: int, align: Callable[[int], int] | None = None) -> list[Chunk]:
    """The chunks of ``entry`` (empty when it stays whole: small enough, 0-dim or one row).

    ``align(dim)``: chunk bounds along ``dim`` fall on multiples of it (a block-quantized weight's
    block rows), the last chunk ending at the tensor's end.
    """
    found = _dim_and_count(entry, threshold)
    if found is None:
        return []
    dim, count = found
    rows = entry.shape[dim]
    bounds = [i * rows // count for i in range(count + 1)]
    step = align(dim) if align is not None else 1
    if step > 1:
        bounds = sorted({min(rows, round(b / step) * step) for b in bounds} | {0, rows})
        if len(bounds) < 3:
            return []
    return [Chunk(entry.key, dim, bounds[i], bounds[i + 1], entry.shape) for i in range(len(bounds) - 1)]
