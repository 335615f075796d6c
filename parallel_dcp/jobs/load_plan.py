"""What a load reads and into what: the checks of a caller's ``into`` tensors, one read request per
stored chunk, and whole small records planned as column entries (jobs/load.py runs them).

A small record (one uncompressed whole-tensor record of at most SMALL_RECORD bytes) is planned
as an entry tuple, no read item or request object per key: with 50,000 keys each object costs
more than reading the record (formats/small_reads.py reads them by runs).
"""

from __future__ import annotations

from itertools import chain
from operator import add, itemgetter
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from parallel_dcp.engine.chunks import lazy_bits
from parallel_dcp.errors import CorruptCheckpointError, InvalidStateDictError, dtype_name
from parallel_dcp.formats import fast_read
from parallel_dcp.formats.read_units import SMALL_RECORD
from parallel_dcp.storage.location import Location, Remote
from parallel_dcp.storage.metadata_check import WholeRecords

__all__ = [
    "check_into_target",
    "check_target",
    "plan_requests",
    "shard_ends",
    "shard_files",
    "small_records",
    "small_targets",
]

_OFFSET, _LENGTH, _KEY = itemgetter(0), itemgetter(1), itemgetter(2)  # of a small record's entry


def check_into_target(key: str, value: Any, meta: TensorStorageMetadata) -> None:
    check_target(key, value, meta.properties.dtype, tuple(meta.size))


def check_target(key: str, value: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """An ``into`` tensor must match what is loaded exactly (``dtype``: the stored one, or the
    ``dtype=`` cast): load fills, it never casts into another dtype or reshapes."""
    if (  # the common case, checked quickly: a dense tensor never shares memory with itself
        type(value) is torch.Tensor
        and value.dtype == dtype
        and value.shape == shape
        and value.is_contiguous()
        and not value.is_meta
        and lazy_bits(value, dtype) is None
    ):
        return
    if not isinstance(value, torch.Tensor):
        raise InvalidStateDictError(
            f"into[{key!r}] is a {type(value).__name__}, but the checkpoint holds a {dtype_name(dtype)} "
            f"tensor {list(shape)}"
        )
    if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
        raise InvalidStateDictError(
            f"into[{key!r}] is a {type(value).__name__}: load fills plain tensors; for DTensors use "
            "torch.distributed.checkpoint.load with storage_reader=parallel_dcp.FastReader(path)"
        )
    if value.dtype != dtype:
        raise InvalidStateDictError(
            f"into[{key!r}] has dtype {dtype_name(value.dtype)} but the checkpoint holds {dtype_name(dtype)} "
            "(load never casts)"
        )
    if value.is_meta:
        raise InvalidStateDictError(
            f"into[{key!r}] is on the meta device: it has no memory to fill (allocate it first, e.g. "
            "module.to_empty(device='cpu'))"
        )
    if _overlaps_itself(value):
        raise InvalidStateDictError(
            f"into[{key!r}] has elements that share memory (strides {list(value.stride())}, e.g. from expand()): "
            "load cannot fill it; pass a tensor of its own (.clone() or .contiguous())"
        )
    if not value.is_contiguous() and (value.requires_grad or isinstance(value, torch.nn.Parameter)):
        raise InvalidStateDictError(
            f"into[{key!r}] is a non-contiguous tensor that requires grad: load fills tensors in place and "
            "autograd forbids that here; pass a contiguous one (or load into its .data)"
        )
    if tuple(value.shape) != shape:
        raise InvalidStateDictError(
            f"into[{key!r}] has shape {list(value.shape)} but the checkpoint holds {list(shape)}"
        )
    if lazy_bits(value, dtype) is not None:  # its bytes are not its values: filled, it read back negated
        raise InvalidStateDictError(
            f"into[{key!r}] is a lazy view (its conjugate or negative bit is set: x.conj(), x.conj().imag): "
            "load fills the memory under it, whose values are not its own; pass a tensor of its own "
            "(.resolve_conj() / .resolve_neg(), or the tensor it views)"
        )


def _overlaps_itself(tensor: torch.Tensor) -> bool:
    """True when two elements of ``tensor`` may share memory: a stride of 0 (``expand``), or a
    stride smaller than the span of the dimensions inside it (``unfold``). Slices, transposes and
    narrowed views pass; only a hand-made ``as_strided`` interleaving could be refused wrongly."""
    dims = sorted((abs(s), n) for s, n in zip(tensor.stride(), tensor.shape, strict=True) if n > 1)
    extent = 0  # the span, in elements, of the dims already placed
    for stride, size in dims:
        if stride <= extent:
            return True
        extent += stride * (size - 1)
    return False


def plan_requests(
    metadata: Metadata,
    selected: list[str],
    targets: dict[str, torch.Tensor],
    where: Location,
    rooms: dict[str, torch.Tensor] | None = None,
) -> list[fast_read.Request]:
    """One request per stored chunk each key of ``selected`` overlaps (a whole-tensor chunk: its
    read item directly; a fresh target in its room, ``rooms``, is seated by the reader:
    formats/seated.py); the caller leaves out the keys of whole small records (read as columns,
    formats/small_reads.py: no read item per key)."""
    rooms = rooms or {}
    storage = metadata.storage_data or {}
    out: list[fast_read.Request] = []
    origins: dict[int, torch.Size] = {}  # one per rank, shared by every read item
    tensors = metadata.state_dict_metadata
    for key in selected:
        meta = tensors[key]
        if not isinstance(meta, TensorStorageMetadata):
            index = MetadataIndex(key)
            zero = torch.Size([0])
            item = ReadItem(LoadItemType.BYTE_IO, index, zero, index, zero, zero)
            out.append(fast_read.Request(item, _info(storage, index, where), (), None, None))
            continue
        target = targets[key]
        chunks = meta.chunks
        rank = len(meta.size)
        origin = origins.get(rank) or origins.setdefault(rank, torch.Size([0] * rank))
        if len(chunks) == 1 and chunks[0].offsets == origin and chunks[0].sizes == meta.size:
            info = _info(storage, MetadataIndex(key, origin), where)
            index = MetadataIndex(key, origin)
            item = ReadItem(LoadItemType.TENSOR, index, origin, index, origin, meta.size)
            # the whole stored chunk into the whole target: no region to cut
            # (detached: the same memory, filled without autograd seeing an in-place write to a leaf)
            room = rooms.get(key)  # a fresh target: seated by its own object (no autograd to keep out)
            whole_chunk = (
                item,
                info,
                tuple(meta.size),
                meta.properties.dtype,
                target if room is not None else target.detach(),
            )
            out.append(fast_read.Request(*whole_chunk, room=room))
            continue
        target = target.detach()
        items = create_read_items_for_chunk_list(key, meta, [ChunkStorageMetadata(origin, meta.size)])
        sizes = {tuple(c.offsets): tuple(c.sizes) for c in meta.chunks}
        for item in items:
            region = target
            for dim, (offset, length) in enumerate(zip(item.dest_offsets, item.lengths, strict=True)):
                if offset != 0 or length != region.shape[dim]:
                    region = region.narrow(dim, offset, length)
            chunk = sizes[tuple(item.storage_index.offset or ())]
            out.append(
                fast_read.Request(item, _info(storage, item.storage_index, where), chunk, meta.properties.dtype, region)
            )
    return out


def small_records(
    columns: WholeRecords, selected: list[str], dense: dict[str, tuple[torch.Tensor, int]]
) -> dict[str, list[fast_read.Entry]]:
    """By file, an entry for each selected tensor stored whole (one chunk at the origin) in one
    uncompressed record of at most SMALL_RECORD bytes, whose target is a dense CPU tensor of its
    dtype and shape (``dense``): from the columns the metadata check left (no object of the
    metadata touched again, no read item or request per key)."""
    small: dict[str, list[fast_read.Entry]] = {}
    records = columns.records
    if len(selected) < len(records) // 8:  # a few keys of many: each goes the general way
        return small
    whole = columns.tensors.get
    target_of = dense.get
    for key, name, offset, length, info in records:
        target = target_of(key)
        if target is None or length > SMALL_RECORD:
            continue
        stored = whole(key)
        if stored is None:  # not one whole chunk: the general way
            continue
        entry = (offset, length, key, target[0], info, stored[0], stored[1], target[1])
        found = small.get(name)
        if found is None:
            small[name] = [entry]
        else:
            found.append(entry)
    return small


def small_targets(columns: WholeRecords, chosen: dict[str, Any]) -> tuple[dict[str, list[fast_read.Entry]], list[str]]:
    """For a load ``into``: by file, an entry for each key of ``chosen`` (flattened ``into``)
    stored whole in one uncompressed record of at most SMALL_RECORD bytes (as small_records) whose
    value is a plain dense CPU tensor of the stored dtype and shape; and the other keys of
    ``chosen``, in its order (for the full checks and the general requests).

    One pass over the columns does what would otherwise be four over the keys (present in the
    checkpoint, a tensor key, its target checked, planned as a small record), and no object is
    made per key but its entry: each is a cost a key, and with 50,000 keys as much as the read.
    Anything not plainly fine is left to the general path, which checks it and says what is wrong."""
    small: dict[str, list[fast_read.Entry]] = {}
    records = columns.records
    if len(chosen) < len(records) // 8:  # a few keys of many: each goes the general way
        return small, list(chosen)
    whole = columns.tensors.get
    target_of = chosen.get
    tensor = torch.Tensor
    last: str | None = None  # a shard's records come one after the other: its list looked up once a run
    found: list[fast_read.Entry] = []
    for key, name, offset, length, info in records:
        value = target_of(key)
        if type(value) is not tensor or length > SMALL_RECORD:
            continue
        stored = whole(key)
        if stored is None:  # not one whole chunk: the general way
            continue
        dtype, shape = stored
        # (a CPU tensor is never a meta one: its data address is real)
        if (
            value.dtype == dtype
            and value.shape == shape
            and value.is_contiguous()
            and value.is_cpu
            and lazy_bits(value, dtype) is None
        ):
            if name is not last:
                found = small.setdefault(name, [])
                last = name
            found.append((offset, length, key, value, info, dtype, shape, value.data_ptr()))
    # every key planned once (a set: a key met in two records is not counted twice)
    planned = set(map(_KEY, chain.from_iterable(small.values())))
    if len(planned) == len(chosen):
        return small, []
    return small, [key for key in chosen if key not in planned]


def shard_ends(requests: list[fast_read.Request], small: dict[str, list[fast_read.Entry]]) -> dict[str, int]:
    """The end of the last byte the plan reads from each shard."""
    ends = {name: max(map(add, map(_OFFSET, entries), map(_LENGTH, entries))) for name, entries in small.items()}
    for request in requests:
        name, end = request.info.relative_path, int(request.info.offset) + int(request.info.length)
        if end > ends.get(name, -1):
            ends[name] = end
    return ends


def shard_files(where: Location, requests: list[fast_read.Request], small: dict[str, list[Any]]) -> list[Path]:
    """The local shard files the requests read (none on object storage)."""
    if isinstance(where, Remote):
        return []
    names = [*small, *(str(r.info.relative_path) for r in requests)]
    return [where / name for name in dict.fromkeys(names)]


def _info(storage: dict[Any, Any], index: MetadataIndex, where: Location) -> Any:
    info = storage.get(index)
    if info is None:
        raise CorruptCheckpointError(
            f"{where} is damaged: .metadata records no shard for {index.fqn!r} at {list(index.offset or [])}"
        )
    return info
