"""An in-memory state dict as a source: workers forked after it exists read it copy-on-write.

Opening it is the first per-key cost of a save (50,000 keys before any worker starts), so it is
one pass over the flattened keys: each tensor is checked, listed (its ``Entry``) and sized (bytes
written, bytes a worker copies) at once, into columns the planner reads instead of asking each
key again (``tensor_sizes``, ``plain_tensors``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from parallel_dcp.engine.chunks import Chunk, exact_storage, lazy_bits, resolved
from parallel_dcp.formats import lean
from parallel_dcp.formats.base import Entry, Source
from parallel_dcp.formats.validate import check_tensor, flatten_checked

__all__ = ["MemorySource"]

# Entry's slots' setters, which its frozen constructor reaches through object.__setattr__: the
# pass below sets them directly, skipping the constructor's shape check (a tensor torch made passed
# torch's own), at half its cost, once per key of a 50,000-key save.
_SETTERS = tuple(Entry.__dict__[name].__set__ for name in ("key", "dtype", "shape", "file"))


@dataclass
class MemorySource(Source):
    """Wraps a (nested) state dict; checked and flattened the way DCP flattens it."""

    state_dict: Any = None
    _flat: dict[str, Any] = field(default_factory=dict, repr=False)
    # Per tensor key, from the opening pass: (Entry.nbytes, copied_bytes).
    _sizes: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)
    _plain: bool = True
    # The lazy views (engine/chunks.lazy_bits) by key, with their (conjugate, negative) bits:
    # their bytes are not their values, so a worker resolves each into a copy, charged.
    _lazy: dict[str, tuple[bool, bool]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.kind = "memory"
        flat, self.mapping = flatten_checked(self.state_dict, check_tensors=False)  # checked below
        self._flat = flat
        entries, values, sizes = self.entries, self.values, self._sizes
        tensor, plain_types, strided = torch.Tensor, lean._PLAIN, torch.strided
        new, (set_key, set_dtype, set_shape, set_file) = object.__new__, _SETTERS
        plain = True
        lazy = self._lazy = {}
        for key, value in flat.items():
            if not isinstance(value, tensor):
                values[key] = value
                continue
            # The common case in three attribute reads; anything else gets the full check and its message.
            if not (value.is_cpu and value.layout == strided and not value.is_quantized):
                check_tensor(key, value)
            entry = entries[key] = new(Entry)  # Entry(key, value.dtype, tuple(value.shape)), unchecked
            set_key(entry, key)
            set_dtype(entry, dtype := value.dtype)
            try:
                set_shape(entry, tuple(value.shape))
            except RuntimeError:  # a tensor with no shape (nested): its own message
                check_tensor(key, value)
                raise
            set_file(entry, "")
            # Contiguous: written from the shared pages as it is (copied_bytes 0). This class's
            # rule, not an override's: a subclass re-sizes in its own pass.
            if type(value) in plain_types:
                sizes[key] = (value.nbytes, 0 if value.is_contiguous() else MemorySource.copied_bytes(self, key))
            else:  # a subclass (DTensor, ...): its global shape, sized as the planner sizes it
                plain = False
                sizes[key] = (entry.nbytes, MemorySource.copied_bytes(self, key))
            bits = lazy_bits(value, dtype)
            if bits is not None:  # a lazy view: copied, resolved (see _lazy)
                lazy[key] = bits
                sizes[key] = (sizes[key][0], sizes[key][0])
        self._plain = plain

    def keys(self) -> tuple[str, ...]:
        """Every key, tensors and values, in the order DCP flattens them (stock's ``.metadata`` order)."""
        return tuple(self._flat)

    def plain_tensors(self) -> bool:
        return self._plain

    def tensor_sizes(self) -> dict[str, tuple[int, int]]:
        return self._sizes

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        if self._lazy:
            return {key: exact_storage(self._resolved(key, self._flat[key])) for key in keys}
        return {key: exact_storage(self._flat[key]) for key in keys}

    def read_chunk(self, chunk: Chunk) -> torch.Tensor:
        return exact_storage(self._resolved(chunk.key, chunk.of(self._flat[chunk.key])))

    def _resolved(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (``key``'s, or a chunk of it) as its values: a lazy view's resolved into a
        copy (charged: ``copied_bytes``, ``chunk_memory``), anything else as it is."""
        return resolved(tensor) if key in self._lazy else tensor

    def chunk_memory(self, chunk: Chunk) -> int:
        # A row range of a contiguous tensor is aliased as it is; any other chunk is copied by DCP.
        if chunk.key in self._lazy:
            return chunk.nbytes(self.entries[chunk.key].dtype.itemsize)
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
        if key in self._lazy:
            return int(tensor.nbytes)
        if tensor.is_contiguous() or tensor.untyped_storage().nbytes() == tensor.nbytes:
            return 0
        return int(tensor.nbytes)

    # DCP's writer clones one tensor at a time and drops the clone once it is written, but the
    # clones are not counted as transient: freed blocks of that size stay in the worker's heap
    # (measured: 48 strided 4 MiB views in tasks sized as if transient went 12% over the limit).
