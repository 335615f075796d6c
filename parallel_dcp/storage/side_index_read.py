"""The side index (storage/side_index.py) read without trusting it, in place of unpickling ``.metadata``.

    .metadata (already open) ── size and xxh3_64 ──┐
    .parallel_dcp.columns (open_bounded) ──────────┤ header: magic, version, counts; the file's size
      │ sizes bounded under the memory limit       │ must be exactly what the counts say
      ▼                                            ▼
    the hash it holds == the hash of the .metadata opened? else None (the caller unpickles)
      │
      ▼
    every column range-checked as the object check does (storage/metadata_check.py): names plain
    and distinct, kinds and dtypes known, offsets and lengths possible, a tensor's bytes within its
    record, no two records sharing a byte ── then the columns a load reads (WholeRecords)

An index that fails any of this is not used (:func:`read_index` returns None): the caller reads
``.metadata`` as before, whose own checks then decide. :func:`examine_index` is the same look and
also says which check failed first (storage/side_index_use.IndexUse: what ``ReadStats.index``,
``inspect`` and ``verify`` report). :func:`parse_index` raises instead, naming
what is wrong (for tests and tools).

Longer than 300 lines because the checks over the columns (one per check of metadata_check.py)
and the reader that relies on them are one unit: a check moved away is a check a reader can skip.
Each check names itself where it fails, for the same reason: a reason given apart from its check
could tell another story than the check did.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy
import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from parallel_dcp import _compat
from parallel_dcp.engine.memory import default_limit, format_bytes
from parallel_dcp.errors import CorruptCheckpointError, ParallelDCPError, UnsafeCheckpointError
from parallel_dcp.storage.location import check_name
from parallel_dcp.storage.metadata_check import WholeRecords
from parallel_dcp.storage.safe_reader import open_bounded
from parallel_dcp.storage.side_index import (
    DTYPES,
    FLAG_PINNED,
    FLAG_REQUIRES_GRAD,
    HEADER,
    INDEX_FILE,
    KIND_VALUE,
    MAGIC,
    VERSION,
)
from parallel_dcp.storage.side_index_use import ABSENT, DAMAGED, OVER_BUDGET, STALE, UNSAFE, IndexUse

__all__ = [
    "INDEX_MEMORY_FACTOR",
    "SideIndex",
    "examine_index",
    "index_save_id",
    "index_state",
    "parse_index",
    "read_index",
]

# Read, the index becomes Python objects (names, tuples, dicts): budgeted like .metadata is
# (storage.metadata.METADATA_MEMORY_FACTOR), for a file about a third of its size.
INDEX_MEMORY_FACTOR = 16
_SMALL = 64 << 20
_MAX_COORD = 1 << 62
_MAX_NDIM = 64
_HASH_PIECE = 1 << 20
# (stock DCP writes no index; ours write none where an entry is split or compressed: side_index.py)
_NONE = f"no {INDEX_FILE} beside .metadata"
_TORCH_DTYPES = [getattr(torch, name, None) for name in DTYPES]


@dataclass(frozen=True, slots=True)
class SideIndex:
    """A checked index: each key's row, and the columns a load reads."""

    names: list[str]
    values: dict[str, int]  # the row of each value key
    kind: Any  # uint8 per row
    file: Any  # uint32 per row, into ``files``
    offset: Any
    length: Any
    files: list[str]
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]  # every tensor key
    flags: Any
    columns: WholeRecords  # as storage.metadata_check finds them in a .metadata
    rows: dict[str, int]  # each key's row, made when first asked for (few loads need it)

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.values

    def row(self, key: str) -> int:
        found = self.values.get(key)
        if found is not None:
            return found
        if not self.rows:
            self.rows.update(zip(self.names, range(len(self.names))))
        return self.rows[key]

    def metadata_for(self, keys: list[str]) -> Metadata:
        """The ``.metadata`` entries of ``keys`` (no ``planner_data``): what they would unpickle to."""
        state: dict[str, Any] = {}
        storage: dict[MetadataIndex, Any] = {}
        for key in keys:
            row = self.row(key)
            where = (self.files[int(self.file[row])], int(self.offset[row]), int(self.length[row]))
            if self.kind[row] == KIND_VALUE:
                state[key] = BytesStorageMetadata()
                storage[MetadataIndex(key)] = _compat.storage_info(*where)
                continue
            dtype, shape = self.tensors[key]
            flags = int(self.flags[row])
            size = torch.Size(shape)
            origin = torch.Size([0] * len(shape))
            properties = TensorProperties(
                dtype=dtype,
                layout=torch.strided,
                requires_grad=bool(flags & FLAG_REQUIRES_GRAD),
                pin_memory=bool(flags & FLAG_PINNED),
            )
            state[key] = TensorStorageMetadata(properties, size, [ChunkStorageMetadata(origin, size)])
            storage[MetadataIndex(key, origin, 0)] = _compat.storage_info(*where)
        return Metadata(state_dict_metadata=state, planner_data={}, storage_data=storage)


def read_index(directory: Path, metadata: BinaryIO, size: int, memory_limit: int | None) -> SideIndex | None:
    """The index beside ``directory/.metadata`` when it describes the ``.metadata`` open as
    ``metadata`` (``size`` bytes; read to its end for the hash, then rewound), else None."""
    return examine_index(directory, metadata, size, memory_limit)[0]


def examine_index(
    directory: Path, metadata: BinaryIO, size: int, memory_limit: int | None
) -> tuple[SideIndex | None, IndexUse]:
    """:func:`read_index`, and why it is None (storage.side_index_use.IndexUse: the first check
    that failed); the checks and what they refuse are read_index's."""
    name = directory / INDEX_FILE
    if not os.path.lexists(name):
        return None, IndexUse(ABSENT, _NONE)
    total = 0
    try:
        with open_bounded(name) as stream:
            total = stream.raw.size  # type: ignore[attr-defined]
            need = total * INDEX_MEMORY_FACTOR
            limit = memory_limit if memory_limit is not None else default_limit() if need > _SMALL else need
            if total < HEADER.size:
                return None, IndexUse(DAMAGED, f"{total} bytes, shorter than its header", total)
            if need > limit:
                over = f"reading it needs up to {format_bytes(need)}, more than the memory limit {format_bytes(limit)}"
                return None, IndexUse(OVER_BUDGET, over, total)
            head = HEADER.unpack(stream.read(HEADER.size))
            if head[0] != MAGIC or head[1] != VERSION or _expected(head) != total:
                return None, IndexUse(DAMAGED, _bad_header(head, total), total)
            if head[3] != size:
                return None, IndexUse(STALE, f"bound to a .metadata of {head[3]} bytes; this one has {size}", total)
            data = stream.read(total)
        # the body's own hash first: a flipped byte in the index (no manifest covers it) is never used
        if len(data) + HEADER.size != total:
            return None, IndexUse(DAMAGED, f"shorter than its {total} bytes when read", total)
        if xxhash.xxh3_64_intdigest(data) != head[11]:
            return None, IndexUse(DAMAGED, "its columns do not hash to the xxh3_64 in its header", total)
        if _hash(metadata) != head[4]:
            return None, IndexUse(
                STALE, "bound to other .metadata bytes of the same size (their xxh3_64 differs)", total
            )
        return parse_index(head, data, name), IndexUse(None, "", total)
    except UnsafeCheckpointError as exc:  # a symlink, FIFO or directory in its place: never opened
        return None, IndexUse(UNSAFE, str(exc), total)
    except (ParallelDCPError, OSError, ValueError) as exc:  # damaged, vanished: .metadata decides
        if not os.path.lexists(name):
            return None, IndexUse(ABSENT, f"{INDEX_FILE} went away while it was read")
        return None, IndexUse(DAMAGED, f"{type(exc).__name__}: {exc}", total)
    finally:
        metadata.seek(0)


def index_state(directory: Path, memory_limit: int | None = None) -> IndexUse:
    """Whether the index beside ``directory/.metadata`` describes it, as a load would find (for
    inspect and verify; ``.metadata`` opened by the one rule, as a load opens it)."""
    with open_bounded(directory / ".metadata", buffering=_HASH_PIECE) as metadata:
        return examine_index(directory, metadata, metadata.raw.size, memory_limit)[1]  # type: ignore[attr-defined]


def _bad_header(head: tuple[Any, ...], total: int) -> str:
    """Which of the header's checks failed (magic, version, the size its counts make)."""
    if head[0] != MAGIC:
        return f"not an index: it starts {bytes(head[0])!r}, not {MAGIC!r}"
    if head[1] != VERSION:
        return f"version {head[1]}; this reader reads version {VERSION}"
    return f"its header's counts make {_expected(head)} bytes; the file has {total}"


def index_save_id(path: Path) -> str | None:
    """The id of the save that wrote the index at ``path`` (a local file), None when unreadable:
    an index left in place by a save killed before its ``.metadata`` is that save's leftover."""
    try:
        with open_bounded(path) as stream:
            total = stream.raw.size  # type: ignore[attr-defined]
            if total < HEADER.size:
                return None
            head = HEADER.unpack(stream.read(HEADER.size))
            if head[0] != MAGIC or _expected(head) != total or head[10] > 256:
                return None
            stream.seek(total - head[10])
            tag: bytes = stream.read(head[10])
            return tag.decode("ascii")
    except (ParallelDCPError, OSError, ValueError):
        return None


def _hash(stream: BinaryIO) -> int:
    hasher = xxhash.xxh3_64()
    while piece := stream.read(_HASH_PIECE):
        hasher.update(piece)
    return int(hasher.intdigest())


def _expected(head: tuple[Any, ...]) -> int:
    """The size a file with the header's counts has (each count bounded first: no overflow)."""
    keys, _, dims, names, file_names, tag = (int(n) for n in head[5:11])
    return HEADER.size + 8 * (2 * keys + dims) + 8 * keys + file_names + names + tag


def parse_index(head: tuple[Any, ...], data: bytes, where: object) -> SideIndex:
    """The checked columns of an index whose header is ``head`` and the rest ``data``.

    Raises:
        CorruptCheckpointError: naming the first impossible field.
    """
    keys, files, dims, names_size, files_size, _ = head[5:11]
    at = 0

    def take(count: int, dtype: Any) -> Any:
        nonlocal at
        array = numpy.frombuffer(data, dtype=dtype, count=count, offset=at)
        at += array.nbytes
        return array

    i8, u4, u1 = numpy.dtype("<i8"), numpy.dtype("<u4"), numpy.uint8
    offset, length, dim = take(keys, i8), take(keys, i8), take(dims, i8)
    file, kind, dtype, flags, ndim = take(keys, u4), take(keys, u1), take(keys, u1), take(keys, u1), take(keys, u1)
    file_blob = data[at : at + files_size]
    names_blob = data[at + files_size : at + files_size + names_size]
    file_names = _strings(file_blob, files, where, "file name")
    files_checked = [check_name(n, where) for n in file_names]
    if len(set(files_checked)) != len(files_checked):
        raise CorruptCheckpointError(f"{where}: a file name appears twice")
    names = _strings(names_blob, keys, where, "key")
    if keys and int(file.max()) >= files:
        raise CorruptCheckpointError(f"{where}: a record names file {int(file.max())} of {files}")
    if numpy.any(kind > KIND_VALUE) or numpy.any(flags > FLAG_REQUIRES_GRAD | FLAG_PINNED):
        raise CorruptCheckpointError(f"{where}: an unknown kind or flag")
    if numpy.any((offset < 0) | (offset >= _MAX_COORD) | (length < 0) | (length >= _MAX_COORD)):
        raise CorruptCheckpointError(f"{where}: an impossible offset or length")
    if numpy.any(ndim > _MAX_NDIM) or int(ndim.sum(dtype=numpy.int64)) != dims:
        raise CorruptCheckpointError(f"{where}: impossible ranks")
    if dims and (int(dim.min()) < 0 or int(dim.max()) >= _MAX_COORD):
        raise CorruptCheckpointError(f"{where}: an impossible dimension")
    values = kind == KIND_VALUE
    if numpy.any(values & ((ndim != 0) | (dtype != 0) | (flags != 0))):
        raise CorruptCheckpointError(f"{where}: a value with a dtype or shape")
    _check_records(file, offset, length, where)
    tensor_rows = numpy.flatnonzero(~values)
    tensors, whole = _tensors(names, tensor_rows, dtype, ndim, dim, length, where)
    value_rows = {names[r]: r for r in numpy.flatnonzero(values).tolist()}
    if len(tensors) + len(value_rows) != keys or any(name in tensors for name in value_rows):
        raise CorruptCheckpointError(f"{where}: a key appears twice")
    all_tensors = len(tensor_rows) == keys
    file_of = numpy.array(files_checked, dtype=object)
    records = list(
        zip(
            names if all_tensors else [names[r] for r in tensor_rows.tolist()],
            (file_of[file] if all_tensors else file_of[file[tensor_rows]]).tolist(),
            (offset if all_tensors else offset[tensor_rows]).tolist(),
            (length if all_tensors else length[tensor_rows]).tolist(),
            itertools.repeat(None),
        )
    )
    columns = WholeRecords(whole, records)
    return SideIndex(names, value_rows, kind, file, offset, length, files_checked, tensors, flags, columns, {})


def _strings(blob: bytes, count: int, where: object, what: str) -> list[str]:
    """The ``count`` strings ``blob`` holds, each UTF-8 and followed by a NUL."""
    if count == 0 and not blob:
        return []
    try:
        parts = blob.decode().split("\0")
    except UnicodeDecodeError as exc:
        raise CorruptCheckpointError(f"{where}: a {what} is not UTF-8 ({exc})") from None
    if len(parts) != count + 1 or parts[-1]:
        raise CorruptCheckpointError(f"{where}: {len(parts) - 1} {what}s where the header says {count}")
    parts.pop()
    return parts


def _check_records(file: Any, offset: Any, length: Any, where: object) -> None:
    """No two records share a byte of a file (as storage.metadata_check._check_records)."""
    if len(file) < 2:
        return
    order = numpy.lexsort((length, offset, file))
    f, s, n = file[order], offset[order], length[order]
    clash = (f[1:] == f[:-1]) & ((s[1:] < s[:-1] + n[:-1]) | (s[1:] == s[:-1]))
    if clash.any():
        at = int(numpy.argmax(clash))
        raise CorruptCheckpointError(f"{where}: two records share bytes (at byte {int(s[at + 1])} of a file)")


def _distinct_rows(table: Any) -> tuple[Any, Any]:
    """The first row of each distinct row of ``table`` (non-negative int64) and each row's place
    among them: the columns folded into one int64 key (mixed radix, renumbered when the next
    column would overflow it), then one 1-D unique (a row-wise unique sorts rows as bytes, ~10x
    slower)."""
    key = numpy.zeros(len(table), dtype=numpy.int64)
    bound = 1
    for column in table.T:
        radix = int(column.max()) + 1 if len(column) else 1
        if bound * radix >= _MAX_COORD:
            _, key = numpy.unique(key, return_inverse=True)
            key = key.reshape(-1).astype(numpy.int64)
            bound = int(key.max()) + 1 if len(key) else 1
            if bound * radix >= _MAX_COORD:  # a dimension near 2**62 and many shapes: compare rows as they are
                _, first, inverse = numpy.unique(table, axis=0, return_index=True, return_inverse=True)
                return first, inverse.reshape(-1)
        key = key * radix + column
        bound *= radix
    _, first, inverse = numpy.unique(key, return_index=True, return_inverse=True)
    return first, inverse.reshape(-1)


def _tensors(
    names: list[str], rows: Any, dtype: Any, ndim: Any, dim: Any, length: Any, where: object
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict[str, tuple[torch.dtype, tuple[int, ...]]]]:
    """(dtype, shape) of every tensor key, each distinct pair built once, and of those the keys
    ``.metadata``'s check finds whole (every dimension > 0); each tensor's bytes within its record."""
    starts = numpy.cumsum(ndim, dtype=numpy.int64) - ndim
    pairs = numpy.empty(len(names), dtype=object)
    positive = numpy.ones(len(names), dtype=bool)
    for rank in numpy.unique(ndim[rows]).tolist():
        these = rows[ndim[rows] == rank]
        table = numpy.empty((len(these), rank + 1), dtype=numpy.int64)
        table[:, 0] = dtype[these]
        if rank:
            table[:, 1:] = dim[starts[these, None] + numpy.arange(rank)]
        first, inverse = _distinct_rows(table)
        made = numpy.empty(len(first), dtype=object)
        need = numpy.empty(len(first), dtype=numpy.int64)
        for n, (code, *shape) in enumerate(table[first].tolist()):
            torch_dtype = _TORCH_DTYPES[code] if code < len(_TORCH_DTYPES) else None
            if torch_dtype is None:
                raise CorruptCheckpointError(f"{where}: dtype code {code} is not one this torch has")
            numel = 1
            for d in shape:
                numel *= d
            if numel * torch_dtype.itemsize >= _MAX_COORD:
                raise CorruptCheckpointError(f"{where}: the impossible shape {shape}")
            made[n] = (torch_dtype, tuple(shape))
            need[n] = numel * torch_dtype.itemsize
        short = need[inverse] > length[these]
        if short.any():
            key = names[int(these[int(numpy.argmax(short))])]
            raise CorruptCheckpointError(f"{where}: key {key!r} needs more bytes than its record holds")
        pairs[these] = made[inverse]
        if rank:
            positive[these] = (table[:, 1:] > 0).all(axis=1)
    tensor_names = names if len(rows) == len(names) else [names[r] for r in rows.tolist()]
    every = dict(zip(tensor_names, pairs[rows].tolist(), strict=True))
    whole_rows = rows[positive[rows]]
    if len(whole_rows) == len(rows):
        return every, every
    return every, {names[r]: every[names[r]] for r in whole_rows.tolist()}
