"""A file-format source (safetensors, torch.save, dequantized) seen as a DCP checkpoint, so that
:class:`~parallel_dcp.FastReader` serves stock ``torch.distributed.checkpoint.load`` from it.

    Source (headers only) ── source_metadata: one whole chunk per tensor, values as bytes
      │ DCP's planner decides what each rank reads (a ReadItem: a region of a stored tensor)
      ▼
    read_source_items: regions whose bytes lie plainly in a file → formats/range_read: whole
      tensors and row ranges straight into the planner's tensor; a part of each row through
      a staging buffer of the rows it spans (in pieces of at most PIECE_BYTES), then copied;
      a computed tensor (dequantized) → Source.read, then the region copied (and cast); the
      temporaries admitted under the reader's memory_limit first
"""

from __future__ import annotations

import concurrent.futures as cf
import io
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.formats.aliased_targets import check_no_aliases
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.key_paths import NonStringKey, first_non_string
from parallel_dcp.formats.range_read import Piece, RawRange, pieces_of, read_pieces, region_pieces, staging_bytes
from parallel_dcp.storage.read_choice import ReadChoice, read_choice
from parallel_dcp.storage.read_probe import probe_memory

__all__ = ["read_source_items", "source_metadata", "source_read_choice"]


def source_metadata(source: Source) -> Metadata:
    """The ``Metadata`` a DCP planner needs: every tensor one chunk of its whole shape, every
    value a bytes entry, the source's nesting as ``planner_data`` (a key that is not a string
    under its str() name, as stock ``dcp.save`` records it: a template holding the int key
    fills it, a load without one gets the string, as from a DCP checkpoint)."""
    tensors: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    for key, entry in source.entries.items():
        origin = torch.Size([0] * len(entry.shape))
        size = torch.Size(entry.shape)
        tensors[key] = TensorStorageMetadata(
            TensorProperties(dtype=entry.dtype), size, [ChunkStorageMetadata(origin, size)]
        )
        storage[MetadataIndex(key, origin)] = key
    for key in source.values:
        tensors[key] = BytesStorageMetadata()
        storage[MetadataIndex(key)] = key
    mapping = {k: source.mapping.get(k, (k,)) for k in tensors}
    if first_non_string(mapping, mapping) is not None:  # (an optimizer's int keys) named as stock DCP names them
        mapping = {k: tuple(str(p) if type(p) is NonStringKey else p for p in path) for k, path in mapping.items()}
    return Metadata(tensors, planner_data=mapping, storage_data=storage, storage_meta=StorageMeta())


def _row_range(item: ReadItem, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(first row, rows) when the region is whole rows along the first dimension (the only
    regions that are one contiguous byte range); None otherwise."""
    offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
    if not shape:
        return (0, 1)
    if any(o != 0 for o in offsets[1:]) or tuple(lengths[1:]) != tuple(shape[1:]):
        return None
    return offsets[0], lengths[0]


def read_source_items(
    source: Source,
    ranges: dict[str, RawRange],
    plan: LoadPlan,
    planner: LoadPlanner,
    threads: int,
    io_mode: str,
    memory_limit: int | None = None,
) -> int:
    """Read every item of ``plan`` into the planner's tensors (committed once all are read);
    values are handed to ``planner.load_bytes``; ``ranges``: the source's ``raw_ranges()``.
    Returns the items read straight from the files.

    What the reading threads hold beside the planner's tensors (a staging buffer for a region
    that is not whole rows, bounded by the rows it spans in pieces; a computed tensor, whole)
    is admitted under ``memory_limit`` before any read: fewer threads where they do not all fit.

    Raises:
        CorruptCheckpointError: an item names a key the source does not hold, or a file is
            shorter than its tensors need.
        MemoryLimitExceeded: one thread's temporaries alone do not fit under ``memory_limit``.
    """
    pieces: list[Piece] = []
    computed: list[tuple[ReadItem, torch.Tensor]] = []
    committed: list[tuple[ReadItem, torch.Tensor]] = []
    for item in plan.items:
        key = item.storage_index.fqn
        if item.type == LoadItemType.BYTE_IO:
            if key not in source.values:
                raise CorruptCheckpointError(f"{source.path} holds no value {key!r}")
            source.load_values([key])
            buffer = io.BytesIO()
            torch.save(source.values[key], buffer)
            buffer.seek(0)
            planner.load_bytes(item, buffer)
            continue
        entry = source.entries.get(key)
        if entry is None:
            raise CorruptCheckpointError(f"{source.path} holds no tensor {key!r}")
        target = planner.resolve_tensor(item).detach()
        committed.append((item, target))
        where = ranges.get(key)
        if where is None:
            computed.append((item, target))
            continue
        rows = _row_range(item, entry.shape)
        if rows is None:  # a part of each row: the rows it spans, read in bounded pieces
            start = tuple(item.storage_offsets)
            pieces += region_pieces(key, where.file, where.offset, entry.dtype, entry.shape, start, target)
            continue
        row = entry.nbytes // entry.shape[0] if entry.shape and entry.shape[0] else 0
        pieces += pieces_of(key, where.file, where.offset + rows[0] * row, entry.dtype, target)
    check_no_aliases(plan.items, [target for _, target in committed], [item for item, _ in committed])
    stage = staging_bytes(pieces)
    read_pieces(pieces, _fitting(threads, stage, memory_limit, pieces[0].key if pieces else ""), io_mode)
    if computed:
        needs = {item.storage_index.fqn: source.copied_bytes(item.storage_index.fqn) for item, _ in computed}
        largest = max(needs, key=lambda k: needs[k])
        workers = _fitting(min(threads, len(computed)), needs[largest], memory_limit, largest)
        with cf.ThreadPoolExecutor(max_workers=workers) as pool:
            for future in [pool.submit(_read_region, source, item, target) for item, target in computed]:
                future.result()
        source.release()
    for item, target in committed:
        planner.commit_tensor(item, target)
    return len(committed) - len(computed)


def source_read_choice(
    source: Source,
    ranges: dict[str, RawRange],
    plan: LoadPlan,
    io_asked: str,
    threads: int,
    memory_limit: int | None,
) -> ReadChoice:
    """How the files of ``plan``'s tensors are read (storage.read_choice: for ``io="auto"``
    measured once per file system and process, on those files). Under ``memory_limit`` the
    measurement's buffers must fit beside nothing else (it runs before any read); where they do
    not, auto keeps its rule (direct for large files) instead of measuring."""
    files = list(dict.fromkeys(ranges[i.storage_index.fqn].file for i in plan.items if i.storage_index.fqn in ranges))
    if io_asked == "auto" and memory_limit is not None and probe_memory(threads) > memory_limit:
        return ReadChoice("auto", "direct", "no room under the memory limit to measure: direct for large files")
    return read_choice(io_asked, source.location, files, streams=threads)


def _fitting(threads: int, per_thread: int, memory_limit: int | None, key: str) -> int:
    """How many of ``threads``, each holding ``per_thread`` bytes, fit under ``memory_limit``."""
    if memory_limit is None or not per_thread:
        return threads
    budget = MemoryGovernor(memory_limit)
    budget.check_item(key, per_thread)
    return max(1, min(threads, memory_limit // per_thread))


def _read_region(source: Source, item: ReadItem, target: torch.Tensor) -> None:
    key = item.storage_index.fqn
    region = source.read([key])[key]
    for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        region = region.narrow(dim, offset, length)
    target.copy_(region)
    del region
