"""An in-memory state dict read by workers that did not fork from its owner (``parallel_dcp.Saver``).

    coordinator (holds the state dict)             worker (started before the state dict existed)
    ──────────────────────────────────             ──────────────────────────────────────────────
    flatten, check; per tensor: address,           unpickles the source: entries, values, layouts
    shape, strides, dtype (no bytes)  ── pickle ─▶ read(keys): a fresh buffer per tensor, filled by
                                                   process_vm_readv from the coordinator (one copy,
                                                   GIL released), viewed with the same strides

The worker copies a tensor's bytes instead of sharing its pages, so every read is charged in full
(``copied_bytes``, ``chunk_memory``): admission plans for it. The coordinator must keep the tensors
alive and unchanged until the save returns (it does: the caller is inside ``save``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from parallel_dcp.engine.chunks import Chunk
from parallel_dcp.engine.remote_memory import read_into
from parallel_dcp.errors import InvalidStateDictError
from parallel_dcp.formats import lean
from parallel_dcp.formats.memory_format import MemorySource

__all__ = ["RemoteMemorySource"]


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where a tensor (or a view of one) lies in the coordinator: first element, sizes, strides."""

    address: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int

    @property
    def span(self) -> int:
        """Bytes from the first element to past the last (a view's gaps included)."""
        if math.prod(self.sizes) == 0:
            return 0
        return (1 + sum((n - 1) * s for n, s in zip(self.sizes, self.strides, strict=True))) * self.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * self.itemsize

    def narrow(self, chunk: Chunk) -> _Layout:
        sizes = chunk.sizes
        return _Layout(
            self.address + chunk.start * self.strides[chunk.dim] * self.itemsize, sizes, self.strides, self.itemsize
        )

    def memory(self) -> int:
        """What a worker allocates: the span copied, and DCP's copy of a view with gaps."""
        return self.span + (self.nbytes if self.span != self.nbytes else 0)


@dataclass
class RemoteMemorySource(MemorySource):
    """A :class:`MemorySource` whose pickled form carries where each tensor lies, not its bytes."""

    _owner: int = 0
    _layouts: dict[str, _Layout] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._owner = os.getpid()
        for key in self.entries:
            tensor = self._flat[key]
            if type(tensor) not in lean._PLAIN or tensor.device.type != "cpu":
                raise InvalidStateDictError(
                    f"{key!r} is a {type(tensor).__name__} on {tensor.device}: a Saver writes plain CPU tensors; "
                    "save this state dict with parallel_dcp.save"
                )
            self._layouts[key] = _Layout(
                tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size()
            )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["state_dict"] = None
        state["_flat"] = {}
        return state

    def plain_tensors(self) -> bool:
        return True

    def copied_bytes(self, key: str) -> int:
        return self._layouts[key].memory()

    def chunk_memory(self, chunk: Chunk) -> int:
        return self._layouts[chunk.key].narrow(chunk).memory()

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        return {key: self._fetch(key, self._layouts[key]) for key in keys}

    def read_chunk(self, chunk: Chunk) -> torch.Tensor:
        return self._fetch(chunk.key, self._layouts[chunk.key].narrow(chunk))

    def _fetch(self, key: str, layout: _Layout) -> torch.Tensor:
        dtype = self.entries[key].dtype
        if layout.nbytes == 0:
            return torch.empty(layout.sizes, dtype=dtype)
        buffer = torch.empty(layout.span, dtype=torch.uint8)
        read_into(self._owner, layout.address, layout.span, buffer.data_ptr())
        flat = buffer.view(dtype)
        if layout.span == layout.nbytes and _contiguous(layout):
            return flat.view(layout.sizes)
        return torch.as_strided(flat, layout.sizes, layout.strides)


def _contiguous(layout: _Layout) -> bool:
    expected = 1
    for n, s in reversed(list(zip(layout.sizes, layout.strides, strict=True))):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True
