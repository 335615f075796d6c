"""A source seen under new names (what :func:`parallel_dcp.jobs.rename.rename_source` returns).

Only the selected keys, under their new names; every read, size and alignment is asked of the
inner source under the old name, so a rename never changes a byte.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from parallel_dcp.formats.base import Source

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import TensorProperties

    from parallel_dcp.engine.chunks import Chunk

__all__ = ["RenamedSource"]


@dataclass
class RenamedSource(Source):
    """A view of ``inner`` under new names: only the selected keys, renamed; reads go to the old names."""

    inner: Source | None = None
    old_names: dict[str, str] = field(default_factory=dict)  # new name -> source name

    def _inner(self) -> Source:
        assert self.inner is not None
        return self.inner

    def close(self) -> None:
        self._inner().close()

    def keys(self) -> tuple[str, ...]:
        """The selected keys, renamed, in the order they were selected."""
        return tuple(self.old_names)

    def stated_properties(self) -> Callable[[str], TensorProperties | None] | None:
        """The inner source's, asked under the old names."""
        inner = self._inner().stated_properties()
        if inner is None:
            return None
        old_names = self.old_names

        def stated(key: str) -> TensorProperties | None:
            old = old_names.get(key)
            return inner(old) if old is not None else None

        return stated

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        keys = list(keys)
        data = self._inner().read([self.old_names[k] for k in keys])
        return {k: data[self.old_names[k]] for k in keys}

    def copied_bytes(self, key: str) -> int:
        return self._inner().copied_bytes(self.old_names[key])

    def transient_bytes(self, key: str) -> int:
        return self._inner().transient_bytes(self.old_names[key])

    def read_chunk(self, chunk: Chunk) -> torch.Tensor:
        return self._inner().read_chunk(dataclasses.replace(chunk, key=self.old_names[chunk.key]))

    def chunk_memory(self, chunk: Chunk) -> int:
        return self._inner().chunk_memory(dataclasses.replace(chunk, key=self.old_names[chunk.key]))

    def split_alignment(self, key: str, dim: int) -> int:
        return self._inner().split_alignment(self.old_names[key], dim)

    def release(self) -> None:
        self._inner().release()

    def fingerprint(self) -> dict[str, Any]:
        return self._inner().fingerprint()
