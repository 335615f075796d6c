"""Where a tensor's bytes lie inside one ``torch.save`` record, found without trusting the record.

A DCP shard is a run of records, one per stored chunk; each record is an uncompressed zip:

    <name>/data.pkl      the pickle: _rebuild_tensor_v2/v3(storage, offset, size, stride, ...)
    <name>/...           .format_version, .storage_alignment, byteorder (small entries)
    <name>/data/0        the storage's raw bytes (64-byte aligned)
    central directory    every entry's name, sizes and local header offset, then the end record

:func:`parse_record` reads the end record and the central directory (from the record's tail), the
local headers (from its head), and unpickles ``data.pkl`` with an unpickler that builds nothing:
it accepts only the rebuild functions, storage types and dtypes a tensor record needs, and
returns plain numbers. Every offset is checked to lie inside the record; the caller checks the
layout against ``.metadata``. A record that is a valid zip but not a plain tensor of one storage
gives None (it goes through DCP's own reader); one that is not a valid zip raises.

Longer than 300 lines because both parsers (a whole record; the head of a record still being
decompressed) share one allow-list unpickler and the zip structures.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["HEAD_BYTES", "TAIL_BYTES", "RecordLayout", "parse_head", "parse_record", "varying_spans"]

# How much of a record's head (local headers and data.pkl) and tail (central directory) is
# read to find its layout: a tensor record's pickle is ~200 bytes, its directory ~700.
HEAD_BYTES = 4096
TAIL_BYTES = 4096

_EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory, 22 bytes
_ZIP64_LOCATOR = struct.Struct("<4sIQI")  # 20 bytes
_ZIP64_EOCD = struct.Struct("<4sQHHIIQQQQ")  # 56 bytes
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # 46 bytes
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes
_MAX_ENTRIES = 64

_STORAGE_DTYPES: dict[str, torch.dtype] = {
    name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()
}


@dataclass(frozen=True, slots=True)
class RecordLayout:
    """A tensor record's layout; ``data_offset`` is where ``data/0`` starts, from the record's start."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    data_offset: int
    data_bytes: int


@dataclass(frozen=True, slots=True)
class _Storage:
    dtype: torch.dtype | None  # None: an untyped storage (v3 records carry the dtype apart)
    key: str
    nbytes_or_numel: int


@dataclass(frozen=True, slots=True)
class _Rebuilt:
    storage: _Storage
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class _StorageType:
    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype


class _NotATensorRecord(Exception):
    """A valid record whose pickle is more than a plain tensor: DCP's reader handles it."""


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(v) is int and v >= 0 for v in value):
        raise _NotATensorRecord(f"{what} is {value!r}")
    return value


def _rebuild(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> _Rebuilt:
    if not isinstance(storage, _Storage) or type(storage_offset) is not int or storage_offset < 0:
        raise _NotATensorRecord("not a storage")
    dtype = storage.dtype
    if dtype is None:  # _rebuild_tensor_v3(..., requires_grad, hooks, dtype[, metadata])
        if len(rest) < 3 or not isinstance(rest[2], torch.dtype):
            raise _NotATensorRecord("an untyped storage without a dtype")
        dtype = rest[2]
    # The tensor's metadata (v2: the argument after the hooks; v3: after the dtype): its conjugate
    # or negative bit, set where torch.save wrote a lazy view (x.conj()). Its bytes are not its
    # values then: DCP's own reader (torch.load) resolves them.
    at = 3 if storage.dtype is None else 2
    metadata = rest[at] if len(rest) > at else None
    if metadata:
        raise _NotATensorRecord(f"a lazy view ({metadata!r})")
    return _Rebuilt(storage, storage_offset, _ints(size, "size"), _ints(stride, "stride"), dtype)


class _LayoutUnpickler(pickle.Unpickler):
    """Resolves only what a plain tensor record names, to stand-ins that run nothing."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3"):
            return _rebuild
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch.storage" and name == "UntypedStorage":
            return _StorageType(None)
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _NotATensorRecord(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        if (
            not isinstance(pid, tuple)
            or len(pid) != 5
            or pid[0] != "storage"
            or not isinstance(pid[1], _StorageType)
            or not isinstance(pid[2], str)
            or type(pid[4]) is not int
        ):
            raise _NotATensorRecord(f"persistent id {pid!r}")
        return _Storage(pid[1].dtype, pid[2], pid[4])


def _end_record(tail: memoryview, length: int) -> tuple[int, int, int]:
    """(entries, directory size, directory offset) from the end of a record."""
    if len(tail) < _EOCD.size:
        raise ValueError("shorter than a zip end record")
    sig, _, _, _, entries, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, len(tail) - _EOCD.size)
    if sig != b"PK\x05\x06" or comment != 0:
        raise ValueError("no zip end record at the end")
    if cd_offset == 0xFFFFFFFF or cd_size == 0xFFFFFFFF or entries == 0xFFFF:
        at = len(tail) - _EOCD.size - _ZIP64_LOCATOR.size
        if at < 0:
            raise ValueError("zip64 locator missing")
        sig, _, eocd64, _ = _ZIP64_LOCATOR.unpack_from(tail, at)
        start = length - len(tail)
        if sig != b"PK\x06\x07" or not start <= eocd64 <= length - _ZIP64_EOCD.size:
            raise ValueError("bad zip64 locator")
        fields = _ZIP64_EOCD.unpack_from(tail, eocd64 - start)
        if fields[0] != b"PK\x06\x06":
            raise ValueError("bad zip64 end record")
        entries, cd_size, cd_offset = fields[7], fields[8], fields[9]
    return entries, cd_size, cd_offset


def _directory(tail: memoryview, length: int) -> dict[str, tuple[int, int, int, int]]:
    """name -> (compression, compressed size, size, local header offset) for every entry."""
    entries, cd_size, cd_offset = _end_record(tail, length)
    start = length - len(tail)
    if entries > _MAX_ENTRIES or cd_offset < start or cd_offset + cd_size > length:
        raise _NotATensorRecord("a zip directory beyond what a tensor record holds")
    found: dict[str, tuple[int, int, int, int]] = {}
    pos = cd_offset - start
    for _ in range(entries):
        fields = _CENTRAL.unpack_from(tail, pos)
        if fields[0] != b"PK\x01\x02":
            raise ValueError("bad central directory entry")
        method, csize, usize, nlen, xlen, clen, local = (
            fields[4],
            fields[8],
            fields[9],
            fields[10],
            fields[11],
            fields[12],
            fields[16],
        )
        name = bytes(tail[pos + _CENTRAL.size : pos + _CENTRAL.size + nlen]).decode("utf-8", "replace")
        extra = tail[pos + _CENTRAL.size + nlen : pos + _CENTRAL.size + nlen + xlen]
        usize, csize, local = _zip64_fields(extra, usize, csize, local)
        found[name] = (method, csize, usize, local)
        pos += _CENTRAL.size + nlen + xlen + clen
    return found


def _zip64_fields(extra: memoryview, usize: int, csize: int, local: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            values = list(struct.unpack_from(f"<{size // 8}Q", extra, pos + 4))
            if usize == 0xFFFFFFFF and values:
                usize = values.pop(0)
            if csize == 0xFFFFFFFF and values:
                csize = values.pop(0)
            if local == 0xFFFFFFFF and values:
                local = values.pop(0)
        pos += 4 + size
    return usize, csize, local


def _data_start(head: memoryview, local: int, name: str) -> int:
    if local + _LOCAL.size > len(head):
        raise _NotATensorRecord(f"{name}'s header lies beyond the first {len(head)} bytes")
    fields = _LOCAL.unpack_from(head, local)
    if fields[0] != b"PK\x03\x04" or fields[3] != 0:
        raise ValueError(f"bad local header for {name}")
    return int(local + _LOCAL.size + fields[9] + fields[10])


def parse_record(head: memoryview, tail: memoryview, length: int) -> RecordLayout | None:
    """The layout of a record of ``length`` bytes from its first and last bytes.

    Args:
        head: the record's first ``min(length, HEAD_BYTES)`` bytes (or all of them).
        tail: its last ``min(length, TAIL_BYTES)`` bytes (or all of them).

    Returns:
        The layout, every offset inside the record; None for a valid record that is not a plain
        tensor on one uncompressed storage (more entries, other pickled objects).

    Raises:
        ValueError: not a zip record (the caller names the key and file).
    """
    try:
        entries = _directory(tail, length)
        pickles = [n for n in entries if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise _NotATensorRecord("no single data.pkl")
        prefix = pickles[0][: -len("data.pkl")]
        storages = [n for n in entries if n.startswith(prefix + "data/")]
        method, csize, usize, local = entries[pickles[0]]
        start = _data_start(head, local, pickles[0])
        if method != 0 or csize != usize or start + usize > len(head):
            raise _NotATensorRecord("data.pkl compressed or beyond the head")
        rebuilt = _LayoutUnpickler(io.BytesIO(head[start : start + usize])).load()
        if not isinstance(rebuilt, _Rebuilt) or storages != [f"{prefix}data/{rebuilt.storage.key}"]:
            raise _NotATensorRecord("not one tensor on one storage")
        method, csize, usize, local = entries[storages[0]]
        data = _data_start(head, local, storages[0])
        if method != 0 or csize != usize or data + usize > length:
            raise ValueError("data/0 compressed or beyond the record")
    except _NotATensorRecord:
        return None
    except Exception as exc:  # a crafted data.pkl can raise anything (AttributeError, OverflowError, ...)
        raise ValueError(f"not a torch.save zip record: {type(exc).__name__}: {exc}") from exc
    storage = rebuilt.storage
    itemsize = rebuilt.dtype.itemsize
    if storage.dtype is not None and storage.nbytes_or_numel * itemsize != usize:
        raise ValueError(f"storage of {storage.nbytes_or_numel} elements but data/0 of {usize} bytes")
    if storage.dtype is None and storage.nbytes_or_numel != usize:
        raise ValueError(f"storage of {storage.nbytes_or_numel} bytes but data/0 of {usize} bytes")
    return RecordLayout(rebuilt.dtype, rebuilt.size, rebuilt.stride, rebuilt.storage_offset, data, usize)


def varying_spans(record: memoryview, layout: RecordLayout) -> list[tuple[int, int]] | None:
    """The byte spans, besides the data, in which two records of ``layout`` (as :func:`parse_record`
    found it in ``record``, a whole record) may differ and still parse alike: every entry's CRC-32
    (local header, data descriptor, central directory) and the bytes of a ``.data/serialization_id``
    entry (torch writes a new one per save). :func:`parse_record` reads none of them, so a record
    equal to ``record`` everywhere else has ``layout`` too. None when ``record`` is laid out in a
    way this does not vouch for (then each record is parsed on its own).
    """
    length = len(record)
    data_end = layout.data_offset + layout.data_bytes
    try:
        entries, _, cd_offset = _end_record(record, length)
        spans: list[tuple[int, int]] = []
        crcs: set[tuple[int, int]] = set()  # the CRC-32 fields themselves (parse_record never reads them)
        # what parse_record reads: data.pkl's header and pickle, data/0's header, the directory
        protected: list[tuple[int, int]] = [(cd_offset, length)]
        pos = cd_offset
        for _ in range(entries):
            fields = _CENTRAL.unpack_from(record, pos)
            if fields[0] != b"PK\x01\x02":
                return None
            flags, csize, usize, nlen, xlen, clen, local = (
                fields[3],
                fields[8],
                fields[9],
                fields[10],
                fields[11],
                fields[12],
                fields[16],
            )
            name = bytes(record[pos + _CENTRAL.size : pos + _CENTRAL.size + nlen]).decode("utf-8", "replace")
            extra = record[pos + _CENTRAL.size + nlen : pos + _CENTRAL.size + nlen + xlen]
            usize, csize, local = _zip64_fields(extra, usize, csize, local)
            spans += [(pos + 16, pos + 20), (local + 14, local + 18)]  # central and local CRC-32
            crcs |= {(pos + 16, pos + 20), (local + 14, local + 18)}
            start = _data_start(record, local, name)
            end = start + csize
            if name.endswith("/data.pkl"):
                protected.append((local, end))
            elif start == layout.data_offset:
                protected.append((local, start))
            if flags & 8:  # a data descriptor after the data: [signature] CRC-32, sizes
                at = end + 4 if bytes(record[end : end + 4]) == b"PK\x07\x08" else end
                spans.append((at, at + 4))
            if name.endswith("/.data/serialization_id"):
                if start < data_end or end > cd_offset:
                    return None
                spans.append((start, end))
            pos += _CENTRAL.size + nlen + xlen + clen
    except (struct.error, ValueError, _NotATensorRecord):
        return None
    if any(a < 0 or b > length or (a < data_end and b > layout.data_offset) for a, b in spans):
        return None
    # a span that is not a CRC-32 field must leave every byte parse_record reads alone (a crafted
    # directory could point a descriptor or an entry's bytes into them)
    if any(a < q and p < b for a, b in spans if (a, b) not in crcs for p, q in protected):
        return None
    return sorted(spans)


def parse_head(head: memoryview) -> RecordLayout | None:
    """The layout a record announces in its first bytes, for a record being decompressed whose end
    is not known yet: ``data.pkl`` (the first entry; torch writes sizes in data descriptors, so
    the pickle is read up to its STOP) and the local header of its storage's entry. This is only a
    prediction: the caller checks it with :func:`parse_record` once the whole record has passed.
    None: the head does not show a plain tensor record (the caller reads the record whole, bounded).

    Raises:
        ValueError: not a zip record.
    """
    try:
        fields = _LOCAL.unpack_from(head, 0)
        if fields[0] != b"PK\x03\x04":
            raise ValueError("no zip local header at the start")
        nlen, xlen = fields[9], fields[10]
        name = bytes(head[_LOCAL.size : _LOCAL.size + nlen]).decode("utf-8", "replace")
        if fields[3] != 0 or not (name.endswith("/data.pkl") and name.count("/") == 1):
            raise _NotATensorRecord("data.pkl is not the first, stored entry")
        rebuilt = _LayoutUnpickler(io.BytesIO(head[_LOCAL.size + nlen + xlen :])).load()
        if not isinstance(rebuilt, _Rebuilt):
            raise _NotATensorRecord("not one tensor")
        wanted = f"{name[: -len('data.pkl')]}data/{rebuilt.storage.key}".encode()
        raw = bytes(head)
        at = raw.find(wanted)
        while at >= 0:
            local = at - _LOCAL.size
            if local >= 0 and raw[local : local + 4] == b"PK\x03\x04":
                entry = _LOCAL.unpack_from(head, local)
                if entry[9] == len(wanted) and entry[3] == 0:
                    start = at + len(wanted) + entry[10]
                    break
            at = raw.find(wanted, at + 1)
        else:
            raise _NotATensorRecord("the storage's header lies beyond the head")
    except _NotATensorRecord:
        return None
    except Exception as exc:  # a crafted data.pkl can raise anything (AttributeError, OverflowError, ...)
        raise ValueError(f"not a torch.save zip record: {type(exc).__name__}: {exc}") from exc
    storage = rebuilt.storage
    itemsize = rebuilt.dtype.itemsize
    nbytes = storage.nbytes_or_numel * itemsize if storage.dtype is not None else storage.nbytes_or_numel
    return RecordLayout(rebuilt.dtype, rebuilt.size, rebuilt.stride, rebuilt.storage_offset, start, nbytes)


def contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def is_row_major(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True when ``stride`` lays ``size`` out densely in row-major order (size-1 dims aside)."""
    if len(size) != len(stride):
        return False
    return all(n == 1 or s == c for n, s, c in zip(size, stride, contiguous_strides(size), strict=True))
