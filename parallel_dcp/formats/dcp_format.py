"""DCP directories as a source: ``.metadata`` lists everything; workers read their keys with
``partial_load`` straight into tensors they allocate.

Keys whose ``chunks`` are several pieces (a DTensor or ShardedTensor save, or a tensor
parallel_dcp split) are reassembled by DCP's own planner into one plain tensor; a chunk of a key
(when the output splits it) is read from just the stored chunks that overlap it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from parallel_dcp.engine.chunks import Chunk
from parallel_dcp.engine.memory import ZSTD_DECOMPRESS_BYTES
from parallel_dcp.formats.base import Entry, Source
from parallel_dcp.formats.compressed_read import bounded_reader
from parallel_dcp.partial import extract_metadata, partial_load
from parallel_dcp.storage.compression import is_compressed
from parallel_dcp.storage.location import Location
from parallel_dcp.storage.metadata import SafeLoadPlanner, check_shards, read_metadata, reading
from parallel_dcp.storage.ownership import METADATA_FILE

__all__ = ["ChunkSavePlanner", "DcpSource", "is_dcp", "read_keys"]


def is_dcp(path: Location) -> bool:
    metadata = path / METADATA_FILE
    if isinstance(metadata, Path):  # a FIFO or a dangling link here is a DCP directory's, refused when opened
        return os.path.lexists(metadata) and not metadata.is_dir()
    return metadata.is_file()


def read_keys(
    path: Location, metadata: Metadata, keys: Iterable[str], into: dict[str, Any], *, trust_pickle: bool = False
) -> dict[str, Any]:
    """Load ``keys`` into ``into`` (preallocated tensors are filled in place; other values are set,
    unpickled with ``weights_only=True`` unless ``trust_pickle``)."""
    keys = list(keys)
    planner = SafeLoadPlanner(
        flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True, trust_pickle=trust_pickle
    )
    with reading(path, keys):
        return partial_load(extract_metadata(keys, metadata), bounded_reader(path), planner, state_dict=into)


class _LazyValues(Mapping[str, Any]):
    """The non-tensor values of a DCP checkpoint: their keys are known from ``.metadata``; a value
    is read (and safely unpickled) only when asked for, so listing or inspecting runs nothing."""

    def __init__(self, source: DcpSource, keys: list[str]) -> None:
        self._source = source
        self._keys = keys
        self._keys_set = frozenset(keys)  # (a set made per lookup made a conversion quadratic in values)
        self._loaded: dict[str, Any] = {}

    def load(self, keys: Iterable[str]) -> None:
        wanted = [k for k in keys if k in self and k not in self._loaded]
        if wanted:
            assert self._source.metadata is not None
            got = read_keys(
                self._source.location,
                self._source.metadata,
                wanted,
                {k: None for k in wanted},
                trust_pickle=self._source.trust_pickle,
            )
            self._loaded.update({k: got[k] for k in wanted})

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys_set:
            raise KeyError(key)
        self.load([key])
        return self._loaded[key]

    def __contains__(self, key: object) -> bool:
        return key in self._keys_set

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


@dataclass
class DcpSource(Source):
    """A committed DCP checkpoint; ``.metadata`` is read with the allow-list unpickler, its names
    and sizes checked; values are unpickled safely, and only when asked for."""

    metadata: Metadata | None = None

    def __post_init__(self) -> None:
        self.kind = "dcp"
        self.metadata = read_metadata(self.location)
        names = {str(info.relative_path) for info in (self.metadata.storage_data or {}).values()}
        self.files = [os.fspath(self.location / name) for name in [METADATA_FILE, *sorted(names)]]
        planner_data = self.metadata.planner_data or {}
        byte_keys = []
        for key, meta in self.metadata.state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata):
                self.entries[key] = Entry(key, meta.properties.dtype, tuple(meta.size), self.path)
            else:
                byte_keys.append(key)
        self.values = _LazyValues(self, byte_keys)  # type: ignore[assignment]
        self.mapping = {k: tuple(planner_data.get(k, (k,))) for k in self.metadata.state_dict_metadata}
        self._compressed = {
            index.fqn for index, info in (self.metadata.storage_data or {}).items() if is_compressed(info)
        }
        self._value_sizes: dict[str, int] | None = None  # made at the first value_bytes

    def keys(self) -> tuple[str, ...]:
        """``.metadata``'s order, tensors and values as saved (stock ``dcp_to_torch_save`` keeps it)."""
        assert self.metadata is not None
        return tuple(self.metadata.state_dict_metadata)

    def stated_properties(self) -> Callable[[str], TensorProperties | None]:
        """Each tensor's properties as ``.metadata`` records them (``requires_grad`` of a saved
        ``nn.Parameter``, ``pin_memory``): a conversion to DCP records the same."""
        assert self.metadata is not None
        stored = self.metadata.state_dict_metadata

        def stated(key: str) -> TensorProperties | None:
            meta = stored.get(key)
            return meta.properties if isinstance(meta, TensorStorageMetadata) else None

        return stated

    def check(self, keys: Iterable[str] | None = None) -> None:
        """Every shard the keys need exists and is as long as ``.metadata`` records."""
        assert self.metadata is not None
        check_shards(self.location, self.metadata, None if keys is None else list(keys))

    def load_values(self, keys: Iterable[str]) -> None:
        assert isinstance(self.values, _LazyValues)
        self.values.load(keys)

    def value_bytes(self, key: str) -> int:
        # All values' sizes in one pass over the records: a pass per value made planning a
        # conversion of many values quadratic (3,000 values: 6,000 records walked 3,000 times).
        if self._value_sizes is None:
            assert self.metadata is not None
            sizes: dict[str, int] = {}
            for index, info in (self.metadata.storage_data or {}).items():
                if index.fqn in self.values:
                    sizes[index.fqn] = sizes.get(index.fqn, 0) + int(info.length)
            self._value_sizes = sizes
        return self._value_sizes.get(key, 0)

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        assert self.metadata is not None
        out = {k: torch.empty(self.entries[k].shape, dtype=self.entries[k].dtype) for k in keys}
        read_keys(self.location, self.metadata, list(out), out, trust_pickle=self.trust_pickle)
        return out

    def read_chunk(self, chunk: Chunk) -> torch.Tensor:
        """Only the stored chunks that overlap ``chunk`` are read, straight into its tensor."""
        assert self.metadata is not None
        entry = self.entries[chunk.key]
        target = torch.empty(chunk.sizes, dtype=entry.dtype)
        planner = _ChunkLoadPlanner(chunk, target)
        with reading(self.location, [chunk.key]):
            partial_load(
                extract_metadata([chunk.key], self.metadata), bounded_reader(self.location), planner, state_dict={}
            )
        return target

    # DCP's reader loads a whole stored chunk (a torch.save record, read through a buffer of its
    # size) before copying the part it needs into the target, and drops both at once: a read
    # keeps the target and passes twice the largest stored chunk it touches through memory, one
    # chunk at a time (transient).
    def copied_bytes(self, key: str) -> int:
        return self.entries[key].nbytes + self._largest_stored_chunk(key)

    def chunk_memory(self, chunk: Chunk) -> int:
        return chunk.nbytes(self.entries[chunk.key].dtype.itemsize) + self._largest_stored_chunk(chunk.key)

    def transient_bytes(self, key: str) -> int:
        return self._largest_stored_chunk(key)

    def _largest_stored_chunk(self, key: str) -> int:
        assert self.metadata is not None
        meta = self.metadata.state_dict_metadata[key]
        assert isinstance(meta, TensorStorageMetadata)
        itemsize = meta.properties.dtype.itemsize
        # a compressed record is decompressed one at a time, bounded (formats/compressed_read.py)
        decompressing = ZSTD_DECOMPRESS_BYTES if key in self._compressed else 0
        return 2 * max((math.prod(c.sizes) * itemsize for c in meta.chunks), default=0) + decompressing


class _ChunkLoadPlanner(SafeLoadPlanner):
    """Loads the region ``chunk`` of one key (from however it was chunked) into ``target``."""

    def __init__(self, chunk: Chunk, target: torch.Tensor) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        self._chunk = chunk
        self._target = target

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        stored = self.metadata.state_dict_metadata[self._chunk.key]
        assert isinstance(stored, TensorStorageMetadata)
        wanted = ChunkStorageMetadata(offsets=torch.Size(self._chunk.offsets), sizes=torch.Size(self._chunk.sizes))
        return LoadPlan(create_read_items_for_chunk_list(self._chunk.key, stored, [wanted]))

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._target


class ChunkSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` for whole keys, plus one ``SHARD`` write item per chunk."""

    def __init__(self, chunks: Iterable[tuple[Chunk, torch.Tensor]]) -> None:
        super().__init__(flatten_state_dict=False)
        self._chunks = {(c.key, c.offsets): (c, t) for c, t in chunks}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        for chunk, tensor in self._chunks.values():
            offsets = torch.Size(chunk.offsets)
            items.append(
                WriteItem(
                    index=MetadataIndex(chunk.key, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(chunk.sizes)),
                        properties=TensorProperties.create_from_tensor(tensor),
                        size=torch.Size(chunk.shape),
                    ),
                )
            )
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        found = self._chunks.get((index.fqn, tuple(index.offset or ())))
        if found is not None:
            return found[1]
        return super().lookup_object(index)
