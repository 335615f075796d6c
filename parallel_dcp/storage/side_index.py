"""A columnar side index beside ``.metadata``: what a load of many small records needs, without unpickling.

Unpickling a 50,000-key ``.metadata`` and checking its objects costs ~4 us a key, most of a
``load(into=)`` of optimizer state. Our writers also write ``.parallel_dcp.columns``: the same
entries as plain columns (numpy arrays, names as one UTF-8 blob, each ended by a NUL), no pickle in it. Layout (all
little-endian; the int64 sections first, so every array is aligned)::

    header   magic "PDCPCOL1", version u32, 0 u32,
             .metadata's size u64 and xxh3_64 u64,
             keys, files, dims, name bytes, file-name bytes, save-id bytes,
             xxh3_64 of everything after the header (u64 each)
    int64    offset[keys]  length[keys]  dims[dims]
    uint32   file[keys]                                   (into the file-name table)
    uint8    kind[keys] (0 tensor, 1 value)  dtype[keys] (DTYPES)  flags[keys]  ndim[keys]
    bytes    file names  key names (each followed by NUL)  save id

It describes only checkpoints whose every entry is one whole, uncompressed tensor record or one
pickled value: for anything else (split tensors, compressed records, tasks through DCP's
planner) no index is written. It is bound to the exact bytes of the ``.metadata`` written with it
by their size and hash: a reader uses it only when the ``.metadata`` it opened hashes to that
(storage/side_index_read.py); otherwise (stock rewrote the checkpoint, an old or damaged index)
it reads ``.metadata`` as before. Stock DCP ignores the file.

The index is renamed into place before ``.metadata`` (storage/local_staging.py): a committed
checkpoint has a matching index or none (an overwritten one's index fails the hash until then).
"""

from __future__ import annotations

import itertools
import struct
import sys
from collections.abc import Sequence
from typing import Any

import numpy
import torch
import xxhash

__all__ = [
    "DTYPES",
    "HEADER",
    "INDEX_FILE",
    "KIND_TENSOR",
    "KIND_VALUE",
    "MAGIC",
    "VERSION",
    "Row",
    "Segment",
    "assemble_index",
    "index_for",
    "int64_column",
    "rows_of",
    "segment",
]

INDEX_FILE = ".parallel_dcp.columns"
MAGIC = b"PDCPCOL1"
VERSION = 1
HEADER = struct.Struct("<8sII" + "Q" * 9)
KIND_TENSOR, KIND_VALUE = 0, 1
FLAG_REQUIRES_GRAD, FLAG_PINNED = 1, 2
# A dtype's code is its place here, for good (version 1): new dtypes go at the end. Names torch
# lacks are skipped by the writer (no index) and refused by the reader.
DTYPES = (
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "uint8", "int8", "int16",
    "int32", "int64", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "uint16", "uint32", "uint64", "complex32", "float8_e8m0fnu", "float4_e2m1fn_x2",
)  # fmt: skip
_CODES: dict[torch.dtype, int] = {
    dtype: code for code, name in enumerate(DTYPES) if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}

# One run of keys as a worker describes it: names (UTF-8, each followed by NUL), kind, dtype,
# flags, ndim (uint8 columns as bytes: read-only views of them once sent home), dims, offset,
# length (int64 arrays).
Segment = tuple[Any, Any, Any, Any, Any, Any, Any, Any]
# One key: kind, dtype code, flags, shape, offset, length.
Row = tuple[int, int, int, tuple[int, ...], int, int]


def rows_of(values: Sequence[tuple[str, int, int]], tensors: Sequence[tuple[Any, ...]]) -> dict[str, Row] | None:
    """Each key's row: values ``(key, offset, length)`` and whole tensors as lean.LeanPart holds
    them; None when one cannot be described (a dtype outside DTYPES, a rank over 255)."""
    rows: dict[str, Row] = {}
    for key, offset, length in values:
        rows[key] = (KIND_VALUE, 0, 0, (), offset, length)
    codes = _CODES
    for key, dtype, grad, pinned, shape, _, _, offset, length in tensors:
        code = codes.get(dtype)
        if code is None or len(shape) > 255:
            return None
        flags = (FLAG_REQUIRES_GRAD if grad else 0) | (FLAG_PINNED if pinned else 0)
        rows[key] = (KIND_TENSOR, code, flags, shape, offset, length)
    return rows


def segment(rows: dict[str, Row], order: Sequence[str]) -> Segment | None:
    """The columns of ``order``'s keys, in that order; None for a name that is not valid UTF-8 or
    holds a NUL (the names' separator)."""
    try:
        names = "\0".join(order).encode() + b"\0" if order else b""
    except UnicodeEncodeError:
        return None
    if names.count(0) != len(order):
        return None
    picked = [rows[key] for key in order]
    kind, dtype, flags, shape, offset, length = zip(*picked, strict=True) if picked else ((),) * 6
    return (
        names,
        bytes(kind),
        bytes(dtype),
        bytes(flags),
        bytes(map(len, shape)),
        numpy.array(list(itertools.chain.from_iterable(shape)), dtype=numpy.int64),
        numpy.array(offset, dtype=numpy.int64),
        numpy.array(length, dtype=numpy.int64),
    )


def assemble_index(pieces: Sequence[tuple[str, Segment]], metadata: bytes, save_id: str) -> bytes:
    """The index file for the ``.metadata`` bytes ``metadata``, from each run's (shard file name,
    segment), in ``.metadata``'s order."""
    return index_for(pieces, len(metadata), xxhash.xxh3_64_intdigest(metadata), save_id)


def index_for(pieces: Sequence[tuple[str, Segment]], size: int, digest: int, save_id: str) -> bytes:
    """:func:`assemble_index` for a ``.metadata`` of ``size`` bytes whose xxh3_64 is ``digest``
    (computed by the caller, which may hash it in pieces, and once for its manifest too). Each
    section is one join of the runs' columns in C (a 4 GiB model's ~550 runs: ~1 ms, against ~8
    for a call per run and column): the file is those sections, byte for byte what a column at a
    time would give."""
    files: dict[str, int] = {}
    numbers = [files.setdefault(name, len(files)) for name, _ in pieces]
    segments = [seg for _, seg in pieces]
    counts = list(map(_size, [seg[1] for seg in segments]))  # (the kind column: a byte a key)
    ids = numpy.repeat(numpy.array(numbers, dtype="<u4"), counts) if segments else numpy.zeros(0, "<u4")
    offsets, lengths, dims = (_int64_section([s[i] for s in segments]) for i in (6, 7, 5))
    small = [b"".join([s[i] for s in segments]) for i in (1, 2, 3, 4)]
    names = b"".join([s[0] for s in segments])
    file_names = "".join(f"{name}\0" for name in files).encode()
    tag = save_id.encode()
    body: list[bytes | memoryview] = [offsets, lengths, dims, ids.data.cast("B"), *small, file_names, names, tag]
    hasher = xxhash.xxh3_64()
    for piece in body:
        hasher.update(piece)
    header = (
        MAGIC,
        VERSION,
        0,
        size,
        digest,
        len(offsets) // 8,
        len(files),
        len(dims) // 8,
        len(names),
        len(file_names),
        len(tag),
    )
    return b"".join([HEADER.pack(*header, hasher.intdigest()), *body])


def _size(data: Any) -> int:
    """Bytes in ``data``: bytes, a view, or a ``pickle.PickleBuffer`` (a part that went home by no
    pipe, on writer threads, keeps its columns wrapped: jobs/dcp_commit.py)."""
    return memoryview(data).nbytes


def _int64_section(parts: list[Any]) -> memoryview:
    """The int64 columns ``parts`` (see :func:`int64_column`) as one little-endian section: one
    join of their bytes where each is little-endian int64 already (raw bytes from a worker of this
    little-endian machine, or such an array), else each converted and then joined."""
    if sys.byteorder == "little" and all(map(_raw_little_int64, parts)):
        return memoryview(b"".join(parts))
    converted = [numpy.ascontiguousarray(int64_column(part), dtype="<i8") for part in parts]
    return memoryview(b"".join(a.data.cast("B") for a in converted))


def _raw_little_int64(part: Any) -> bool:
    """Whether ``part``'s bytes, as they are, are little-endian int64s (on a little-endian machine):
    raw bytes (a column sent home as bytes: this machine's order) or a contiguous int64 array in it."""
    if isinstance(part, numpy.ndarray):
        return part.dtype == _INT64 and part.flags.c_contiguous
    view = memoryview(part)
    return view.format in ("B", "b", "c") and view.c_contiguous


_INT64 = numpy.dtype("=i8")


def int64_column(column: Any) -> Any:
    """An int64 column of a :data:`Segment` as an array: an array as it is, or (a column that
    travelled home as its raw bytes: jobs/dcp_commit.py ``out_of_band``) those bytes read as int64
    in this machine's order (the worker's: the same machine)."""
    if isinstance(column, numpy.ndarray) or memoryview(column).format not in ("B", "b", "c"):
        return numpy.asarray(column)
    return numpy.frombuffer(column, dtype=numpy.int64)
