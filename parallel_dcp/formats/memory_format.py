"""An in-memory state dict as a source: workers forked after it exists read it copy-on-write."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from parallel_dcp.engine.chunks import Chunk, exact_storage
from parallel_dcp.formats import lean
from parallel_dcp.formats.base import Source, entry_of
from parallel_dcp.formats.validate import flatten_checked

__all__ = ["MemorySource"]


@dataclass
class MemorySource(Source):
    """Wraps a (nested) state dict; checked and flattened the way DCP flattens it."""

    state_dict: Any = None
    _flat: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.kind = "memory"
        flat, self.mapping = flatten_checked(self.state_dict)
        self._flat = flat
        for key, value in flat.items():
            if isinstance(value, torch.Tensor):
                self.entries[key] = entry_of(key, value)
            else:
                self.values[key] = value

    def keys(self) -> tuple[str, ...]:
        """Every key, tensors and values, in the order DCP flattens them (stock's ``.metadata`` order)."""
        return tuple(self._flat)

    def plain_tensors(self) -> bool:
        return lean.lean_eligible(self._flat[key] for key in self.entries)

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        return {key: exact_storage(self._flat[key]) for key in keys}

    def read_chunk(self, chunk: Chunk) -> torch.Tensor:
        return exact_storage(chunk.of(self._flat[chunk.key]))

    def chunk_memory(self, chunk: Chunk) -> int:
        # A row range of a contiguous tensor is aliased as it is; any other chunk is copied by DCP.
        if chunk.dim == 0 and self._flat[chunk.key].is_contiguous():
            return 0
        return chunk.nbytes(self.entries[chunk.key].dtype.itemsize)

    def copied_bytes(self, key: str) -> int:
        """Bytes a writer must copy before writing ``key``: DCP clones a tensor whose storage is
        larger than its elements (a strided slice), so that ``torch.save`` does not write the whole
        storage; a tensor whose storage is exactly its bytes (contiguous, or a transposed or
        permuted whole tensor) is written from the shared pages as it is, and so is a contiguous
        slice of a larger storage (through an alias: see ``exact_storage``)."""
        tensor = self._flat[key]
        if tensor.is_contiguous() or tensor.untyped_storage().nbytes() == tensor.nbytes:
            return 0
        return int(tensor.nbytes)

    # DCP's writer clones one tensor at a time and drops the clone once it is written, but the
    # clones are not counted as transient: freed blocks of that size stay in the worker's heap
    # (measured: 48 strided 4 MiB views in tasks sized as if transient went 12% over the limit).
