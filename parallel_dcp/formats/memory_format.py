"""An in-memory state dict as a source: workers forked after it exists read it copy-on-write."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from parallel_dcp.chunks import Chunk
from parallel_dcp.formats.base import Source, entry_of
from parallel_dcp.validate import flatten_checked

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

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        return {key: self._flat[key] for key in keys}

    def read_chunk(self, chunk: Chunk) -> torch.Tensor:
        return chunk.of(self._flat[chunk.key])

    def chunk_memory(self, chunk: Chunk) -> int:
        return chunk.nbytes(self.entries[chunk.key].dtype.itemsize)  # DCP copies the view

    def copied_bytes(self, key: str) -> int:
        """Bytes a writer must copy before writing ``key``: DCP clones a tensor whose storage is
        not exactly its own elements (a view, a slice, a transposed tensor); others are written
        from the shared pages as they are."""
        tensor = self._flat[key]
        return tensor.nbytes if tensor.untyped_storage().nbytes() != tensor.nbytes else 0
