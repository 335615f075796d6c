"""The lean per-key path of a DCP save: write items and ``Metadata`` built directly.

DCP's planner builds, for every key, a ``WriteItem`` with its ``TensorWriteData``, a
``TensorStorageMetadata``, then copies both while deduplicating, validating and rewriting index
hints; the worker pickles all of it to the coordinator, which unpickles and merges it. For many
small tensors that costs more than writing them. Here a worker writes its task's records
(:meth:`ShardWriter.write_records`) and notes one flat tuple per key::

    value:  (fqn, offset, length)
    tensor: (fqn, dtype, requires_grad, pinned, size, chunk offsets or None, chunk sizes, offset, length)

from which :func:`build` makes, in one pass, the merged ``Metadata`` and the ``WriteResult``
lists that DCP's own planner and writer would have produced for the same state dict
(``tests/test_lean.py`` compares them), sharing one ``TensorProperties`` per dtype. The worker
builds its whole keys' entries itself and sends them pickled (:func:`encode`), so the
coordinator's share of a key is splicing bytes; only chunks of split tensors, which join chunks
from other parts, are built in the coordinator.

Values DCP plans specially (DTensor, ShardedTensor and other tensor subclasses, objects with
``__create_write_items__``) send the task through :func:`partial_save` instead.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from parallel_dcp import _compat
from parallel_dcp.engine.chunks import Chunk
from parallel_dcp.engine.pool import gc_paused
from parallel_dcp.formats.metadata_pickle import dict_fragment
from parallel_dcp.storage.manifest import FileDigest
from parallel_dcp.storage.pending import PendingTensor
from parallel_dcp.storage.read_ahead import StreamedTensor
from parallel_dcp.storage.side_index import Segment, rows_of, segment
from parallel_dcp.storage.writers import ShardWriter

__all__ = ["LeanPart", "build", "encode", "lean_eligible", "write_part"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
# What write_part writes as a tensor record: a tensor, one whose bytes are read ahead from a file,
# or one another process holds (a Saver's).
_TENSORS = (torch.Tensor, StreamedTensor, PendingTensor)


@dataclass(slots=True)
class LeanPart:
    """What one task wrote: its file, one tuple per value and per tensor (see the module doc)."""

    file: str
    values: list[tuple[str, int, int]] = field(default_factory=list)
    tensors: list[tuple[Any, ...]] = field(default_factory=list)
    digests: dict[str, FileDigest] = field(default_factory=dict)
    descriptors: list[str] | None = None  # every record's transform (compressed), or None
    # After :func:`encode`: the whole keys' entries of .metadata, pickled, as (place of the first
    # key in the job, (``state_dict_metadata``, ``planner_data``, ``storage_data``)) per run of
    # neighbouring keys; ``values`` and ``tensors`` then hold only chunks. Bytes as encoded; each
    # wrapped in ``pickle.PickleBuffer`` to travel home, where it is a read-only view of the buffer
    # the pool read it into (jobs/dcp_commit.py).
    runs: list[tuple[int, tuple[Any, Any, Any]]] = field(default_factory=list)
    # After :func:`encode`: each run's keys as side-index columns (storage/side_index.py), or None
    # where they cannot be described (a compressed part, an unknown dtype): then no index is written.
    columns: list[Segment] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # Its fields in a tuple: a dataclass with slots otherwise pickles through copyreg's Python
        # code, which the coordinator pays again to unpickle each task's part (12 -> 7 us hot).
        fields = (self.file, self.values, self.tensors, self.digests, self.descriptors, self.runs, self.columns)
        return (LeanPart, fields)


def lean_eligible(values: Iterable[Any]) -> bool:
    """True when DCP's default planner would plan every one of ``values`` as a plain tensor or a
    pickled value (nothing it hands to ``__create_write_items__`` or to ShardedTensor's rules)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if type(value) not in _PLAIN:
                return False
        elif hasattr(value, "__create_write_items__"):
            return False
    return True


def file_name(part_idx: int, file_tag: str) -> str:
    """The shard name :func:`partial_save` gives part ``part_idx`` (``FileSystemWriter``'s first file)."""
    prefix = f"__{part_idx}_{file_tag}_" if file_tag else f"__{part_idx}_"
    return f"{prefix}0{DEFAULT_SUFFIX}"


def write_part(
    writer: ShardWriter,
    whole: dict[str, Any],
    chunks: Sequence[tuple[Chunk, torch.Tensor | StreamedTensor | PendingTensor]],
    part_idx: int,
    file_tag: str,
    stated: Callable[[str], TensorProperties | None] | None = None,
) -> LeanPart:
    """Write one task's keys and chunks as one shard file, laid out as :func:`partial_save` lays
    it out (values first, then whole tensors in order, then chunks). Each tensor's
    ``requires_grad`` and ``pin_memory`` are the tensor's own, or what ``stated`` says of its key
    (a DCP source's ``.metadata``: ``Source.stated_properties``), as ``dcp.save`` records a
    tensor with those properties."""
    name = file_name(part_idx, file_tag)
    values = [(key, value) for key, value in whole.items() if not isinstance(value, _TENSORS)]
    tensors = [(key, value) for key, value in whole.items() if isinstance(value, _TENSORS)]
    placed = writer.write_records(
        name, [_pickled(v) for _, v in values], [t for _, t in tensors] + [t for _, t in chunks]
    )
    part = LeanPart(name)
    for (key, _), (offset, length) in zip(values, placed, strict=False):
        part.values.append((key, offset, length))
    at = iter(placed[len(values) :])
    for key, tensor in tensors:
        offset, length = next(at)
        size = tuple(tensor.shape)
        grad, pinned = _flags(key, tensor, stated)
        part.tensors.append((key, tensor.dtype, grad, pinned, size, None, size, offset, length))
    for chunk, tensor in chunks:
        offset, length = next(at)
        grad, pinned = _flags(chunk.key, tensor, stated)
        part.tensors.append(
            (
                chunk.key,
                tensor.dtype,
                grad,
                pinned,
                chunk.shape,
                chunk.offsets,
                chunk.sizes,
                offset,
                length,
            )
        )
    part.digests = writer.digests()
    part.descriptors = writer.descriptors()
    return part


def _flags(key: str, tensor: Any, stated: Callable[[str], TensorProperties | None] | None) -> tuple[bool, bool]:
    """``(requires_grad, pin_memory)`` recorded for ``key``: as stated by the source, else the tensor's."""
    found = stated(key) if stated is not None else None
    if found is not None:
        return bool(found.requires_grad), bool(found.pin_memory)
    return tensor.requires_grad, tensor.is_pinned()


def encode(part: LeanPart, mapping: Mapping[str, tuple[Any, ...]], positions: Mapping[str, int]) -> LeanPart:
    """``part`` with its whole keys' ``.metadata`` entries built and pickled here, in the worker
    (see :mod:`parallel_dcp.formats.metadata_pickle`), one piece per run of keys that are
    neighbours in ``positions`` (the job's order), so the coordinator can put every piece in
    its place. ``mapping`` gives each key's ``planner_data`` (its path in the nesting; ``(key,)``
    when absent). Chunks of split tensors stay tuples: their entries join chunks from other parts
    in the coordinator."""
    with gc_paused():  # thousands of small objects: no collection walking the worker's heap
        return _encode(part, mapping, positions)


def _encode(part: LeanPart, mapping: Mapping[str, tuple[Any, ...]], positions: Mapping[str, int]) -> LeanPart:
    whole = [t for t in part.tensors if t[5] is None]
    chunks = [t for t in part.tensors if t[5] is not None]
    metadata, (writes,) = build([LeanPart(part.file, part.values, whole, descriptors=part.descriptors)])
    entries = metadata.state_dict_metadata
    stored = {w.index.fqn: w for w in writes}  # one record per whole key
    runs: list[tuple[int, tuple[bytes, bytes, bytes]]] = []
    rows = rows_of(part.values, whole) if part.descriptors is None else None
    columns: list[Segment] | None = None if rows is None else []
    ordered = sorted(entries, key=positions.__getitem__)
    start = 0
    for end in range(1, len(ordered) + 1):
        if end < len(ordered) and positions[ordered[end]] == positions[ordered[end - 1]] + 1:
            continue
        keys = ordered[start:end]
        if rows is not None and columns is not None:
            described = segment(rows, keys)
            if described is None:
                columns = None
            else:
                columns.append(described)
        runs.append(
            (
                positions[keys[0]],
                (
                    dict_fragment({key: entries[key] for key in keys}),
                    dict_fragment({key: mapping.get(key, (key,)) for key in keys}),
                    dict_fragment({stored[key].index: stored[key].storage_data for key in keys}),
                ),
            )
        )
        start = end
    return LeanPart(part.file, [], chunks, part.digests, descriptors=part.descriptors, runs=runs, columns=columns)


def _pickled(value: Any) -> io.BytesIO:
    data = io.BytesIO()
    torch.save(value, data)  # what DCP's planner does with a value (DefaultSavePlanner.transform_object)
    return data


def _compressed_info(descriptors: list[str], file: str, offset: int, length: int) -> Any:
    return _compat.storage_info(file, offset, length, descriptors)


def build(parts: Sequence[LeanPart]) -> tuple[Metadata, list[list[WriteResult]]]:
    """The merged ``Metadata`` (``planner_data`` and ``storage_data`` not yet set) and each part's
    ``WriteResult`` list, as :func:`partial_save` and :func:`merge_metadata` would give them.

    Raises:
        ValueError: two parts hold the same key (other than chunks of one tensor).
    """
    properties: dict[tuple[Any, ...], TensorProperties] = {}
    sizes: dict[tuple[int, ...], torch.Size] = {}
    state: dict[str, Any] = {}
    all_writes: list[list[WriteResult]] = []
    size_of = sizes.get
    plain_info = _compat.storage_info_class()
    for part in parts:
        descriptors = part.descriptors
        # a compressed part's records each carry its transform; plain ones leave the field out
        storage_info = plain_info if descriptors is None else functools.partial(_compressed_info, descriptors)

        writes: list[WriteResult] = []
        for key, offset, length in part.values:
            if key in state:
                raise ValueError(f"parts are not disjoint: {key!r} appears in two parts")
            state[key] = BytesStorageMetadata()
            info = storage_info(part.file, offset, length)
            writes.append(WriteResult(index=MetadataIndex(key), size_in_bytes=length, storage_data=info))
        for key, dtype, grad, pinned, shape, offsets, chunk_sizes, offset, length in part.tensors:
            props = properties.get((dtype, grad, pinned))
            if props is None:
                props = properties[(dtype, grad, pinned)] = TensorProperties(
                    dtype=dtype, layout=torch.strided, requires_grad=grad, pin_memory=pinned
                )
            whole = size_of(shape) or sizes.setdefault(shape, torch.Size(shape))
            at = offsets if offsets is not None else (0,) * len(shape)
            chunk = ChunkStorageMetadata(
                offsets=size_of(at) or sizes.setdefault(at, torch.Size(at)),
                sizes=size_of(chunk_sizes) or sizes.setdefault(chunk_sizes, torch.Size(chunk_sizes)),
            )
            meta = state.get(key)
            if meta is None:
                meta = state[key] = TensorStorageMetadata(properties=props, size=whole, chunks=[])
            elif offsets is None or not isinstance(meta, TensorStorageMetadata) or meta.size != whole:
                raise ValueError(f"parts are not disjoint: {key!r} appears in two parts")
            index = MetadataIndex(key, None, len(meta.chunks))
            # The chunk's shared offsets, not a copy: pickling .metadata writes each distinct one once.
            object.__setattr__(index, "offset", chunk.offsets)
            meta.chunks.append(chunk)
            info = storage_info(part.file, offset, length)
            writes.append(WriteResult(index=index, size_in_bytes=length, storage_data=info))
        all_writes.append(writes)
    return Metadata(state_dict_metadata=state), all_writes
