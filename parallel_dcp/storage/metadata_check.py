"""Every name, size and offset of an unpickled ``.metadata`` checked, in a few passes over plain columns.

A checkpoint of optimizer state has tens of thousands of keys, each one whole chunk in one record.
Checked one object at a time through the general geometry (storage/geometry.py), that took more
than unpickling the file. So:

    state_dict_metadata ── one pass: a key of one whole chunk with int sizes is checked inline
      │                    (dtype, sizes, chunk at the origin); any other through check_chunks
      ▼
    storage_data ── one pass: names (each distinct one checked once), offsets, lengths as columns
      │
      ├─ records: columns sorted by (file, offset) with numpy; no two may share a byte
      ├─ bytes: what each tensor needs against what its records hold
      └─ planner_data: the nesting, proven in bulk (storage/planner_bulk.py), else
         path by path (geometry.check_planner_data), which names what is wrong

What is refused is exactly what the object-by-object check refused (tests/test_metadata_safety.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.storage.geometry import MAX_PATH_DEPTH, PairBudget, check_chunks, check_planner_data, describe_index
from parallel_dcp.storage.location import check_name
from parallel_dcp.storage.planner_bulk import bulk_planner_data

__all__ = ["WholeRecords", "check_metadata_fields"]

# A zstd frame is blocks of at most 128 KiB of output, each behind a 3-byte header: what a
# compressed record's stored bytes can decompress to, at most (a claimed size past it is a lie).
_ZSTD_BLOCK_BYTES = 128 * 1024
_ZSTD_MOST_OUT_PER_BYTE = _ZSTD_BLOCK_BYTES // 3 + 1
# Offsets, lengths and element counts are compared as int64; none can reach this.
_MAX_COORD = 1 << 62
_INT = {int}


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True, slots=True)
class WholeRecords:
    """What the check found in passing, as plain columns, for a reader of many small records (so it
    need not walk the metadata's objects again: each first touch of one is a cache miss):

    - ``tensors``: key -> (dtype, shape as a tuple) of each tensor key stored as one whole chunk
      at the origin, with int sizes;
    - ``records``: (key, file name, offset, length, storage info) of each uncompressed record
      stored at the origin (every offset of its index 0), in ``storage_data``'s order.

    A key in both has its one chunk in that record; its name, offset and length are checked.
    """

    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    records: list[tuple[str, str, int, int, Any]]


def check_metadata_fields(metadata: Metadata, file: object) -> WholeRecords:
    """See storage.metadata.check_metadata (which turns a malformed object's AttributeError or
    TypeError into CorruptCheckpointError); what it found in passing."""
    tensors = metadata.state_dict_metadata
    if not isinstance(tensors, dict):
        raise CorruptCheckpointError(f"{file}: state_dict_metadata is not a mapping")
    whole: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    needed = _check_tensors(tensors, file, whole)
    storage = metadata.storage_data or {}
    if not isinstance(storage, dict):
        raise CorruptCheckpointError(f"{file}: storage_data is not a mapping")
    records: list[tuple[str, str, int, int, Any]] = []
    stored, compressed = _check_storage(storage, file, records)
    # What a reader allocates is bounded by what is stored (and check_shards bounds that by the
    # files' real sizes): a tensor's chunks tile it (check_chunks), and each chunk's bytes are in
    # its records.
    for key, need in needed.items():
        have = stored.get(key, 0)
        if need <= have:
            continue
        numel = math.prod(getattr(tensors[key], "size", ()))
        if key not in compressed:
            raise CorruptCheckpointError(
                f"{file}: key {key!r} claims {numel} elements but {have} stored bytes: impossible sizes"
            )
        if need > _ZSTD_MOST_OUT_PER_BYTE * have + _ZSTD_BLOCK_BYTES:
            raise CorruptCheckpointError(
                f"{file}: key {key!r} claims {numel} elements ({need} bytes) but its {have} stored zstd bytes can "
                f"hold at most {_ZSTD_MOST_OUT_PER_BYTE}x that: impossible sizes"
            )
    keys = list(tensors)
    if not bulk_planner_data(metadata.planner_data, keys, MAX_PATH_DEPTH):  # the common case, in bulk
        check_planner_data(metadata.planner_data, keys, file)
    return WholeRecords(whole, records)


def _check_tensors(
    tensors: dict[Any, Any], file: object, whole: dict[str, tuple[torch.dtype, tuple[int, ...]]]
) -> dict[str, int]:
    """Each tensor key's chunks tile it; the bytes each tensor key needs. Adds to ``whole`` the
    (dtype, shape) of each key stored as one whole chunk at the origin."""
    pairs = PairBudget()
    needed: dict[str, int] = {}
    size_type, chunk_type, dtype_type = torch.Size, ChunkStorageMetadata, torch.dtype
    numels: dict[torch.Size, int | None] = {}  # sizes met, all dims ints > 0: their element counts
    shapes: dict[torch.Size, tuple[int, ...]] = {}  # the same sizes, as plain tuples
    zeros: dict[int, torch.Size] = {}  # the origin of each rank
    for key, meta in tensors.items():
        if type(key) is not str and not isinstance(key, str):
            raise CorruptCheckpointError(f"{file}: a key is not a string ({key!r})")
        if type(meta) is TensorStorageMetadata:  # the common case first: one whole chunk, int sizes
            size, chunks = meta.size, meta.chunks
            dtype = getattr(meta.properties, "dtype", None)
            if type(dtype) is dtype_type and type(size) is size_type and type(chunks) is list and len(chunks) == 1:
                numel = numels.get(size)
                if numel is None and {*map(type, size)} <= _INT and min(size, default=1) > 0:
                    count = math.prod(size)
                    numel = numels[size] = count if count < _MAX_COORD else None
                chunk = chunks[0]
                if (
                    numel is not None
                    and type(chunk) is chunk_type
                    and type(chunk.sizes) is size_type
                    and chunk.sizes == size
                    and chunk.offsets
                    == (zeros.get(len(size)) or zeros.setdefault(len(size), size_type([0] * len(size))))
                    and type(chunk.offsets) is size_type
                ):
                    needed[key] = numel * dtype.itemsize
                    shape = shapes.get(size)
                    whole[key] = (dtype, shape if shape is not None else shapes.setdefault(size, tuple(size)))
                    continue
        if isinstance(meta, TensorStorageMetadata):
            dtype = getattr(meta.properties, "dtype", None)
            if not isinstance(dtype, torch.dtype) or not all(_count(n) for n in meta.size):
                raise CorruptCheckpointError(f"{file}: key {key!r} has an impossible dtype or size {meta.size}")
            check_chunks(key, meta.size, meta.chunks, file, pairs)
            needed[key] = math.prod(meta.size) * dtype.itemsize
        elif not isinstance(meta, BytesStorageMetadata):
            raise CorruptCheckpointError(f"{file}: key {key!r} has storage metadata of type {type(meta).__name__}")
    return needed


def _check_storage(
    storage: dict[Any, Any], file: object, at_origin: list[tuple[str, str, int, int, Any]]
) -> tuple[dict[str, int], set[str]]:
    """Every record's name plain, offset and length possible, no two records sharing a byte; the
    bytes stored for each key, and the keys with compressed records. Adds to ``at_origin`` each
    uncompressed record stored at the origin (see WholeRecords)."""
    stored: dict[str, int] = {}
    compressed: set[str] = set()
    plain: dict[str, int] = {}  # names already checked (a shard holds thousands of records), numbered
    names: list[int] = []
    offsets: list[int] = []
    lengths: list[int] = []
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        number = plain.get(name) if type(name) is str else None
        if number is None:
            check_name(name, f"{file} (key {getattr(index, 'fqn', index)!r})")
            number = plain[name] = len(plain)  # type: ignore[index]  # check_name passed: a str
        offset: Any = getattr(info, "offset", None)
        length: Any = getattr(info, "length", None)
        if not (type(offset) is int and type(length) is int and 0 <= offset < _MAX_COORD and 0 <= length < _MAX_COORD):
            if not (_count(offset) and _count(length)) or max(offset, length) >= _MAX_COORD:
                raise CorruptCheckpointError(
                    f"{file} (key {getattr(index, 'fqn', index)!r}): impossible offset {offset!r} or length {length!r}"
                )
            offset, length = int(offset), int(length)  # an int of a subclass
        fqn = getattr(index, "fqn", None)
        key = fqn if type(fqn) is str else str(fqn)
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors:
            if not isinstance(descriptors, (list, tuple)) or not all(isinstance(d, str) for d in descriptors):
                raise CorruptCheckpointError(f"{file} (key {fqn!r}): impossible transform descriptors {descriptors!r}")
            # a compressed record holds fewer bytes than its tensor; its reader bounds what it
            # decompresses by the tensor's size instead (storage/compression.py)
            compressed.add(key)
        else:
            origin = getattr(index, "offset", None)
            if type(origin) is torch.Size and not any(origin) and type(fqn) is str:
                at_origin.append((fqn, name, offset, length, info))  # type: ignore[arg-type]  # a str: checked
        stored[key] = stored.get(key, 0) + length
        names.append(number)
        offsets.append(offset)
        lengths.append(length)
    _check_records(storage, names, offsets, lengths, file)
    return stored, compressed


def _check_records(
    storage: dict[Any, Any], names: list[int], offsets: list[int], lengths: list[int], where: object
) -> None:
    """No two records (two keys, or two chunks of one key) share bytes of a shard (the same
    offset, or ranges that overlap): each key's chunk is read from its own record, checked
    against its own dtype and shape.

    Raises:
        CorruptCheckpointError: naming both keys.
    """
    if len(names) < 2:
        return
    name = numpy.array(names, dtype=numpy.int64)
    start = numpy.array(offsets, dtype=numpy.int64)
    length = numpy.array(lengths, dtype=numpy.int64)
    order = numpy.lexsort((length, start, name))
    name, start, length = name[order], start[order], length[order]
    same_file = name[1:] == name[:-1]
    clash = same_file & ((start[1:] < start[:-1] + length[:-1]) | (start[1:] == start[:-1]))
    if not clash.any():
        return
    at = int(numpy.argmax(clash))
    indexes = list(storage)
    first, second = indexes[int(order[at])], indexes[int(order[at + 1])]
    file_name = storage[first].relative_path
    raise CorruptCheckpointError(
        f"{where}: {describe_index(first)} and {describe_index(second)} share bytes of {file_name} "
        f"(records at bytes {int(start[at])} and {int(start[at + 1])}): one record cannot hold two chunks"
    )
