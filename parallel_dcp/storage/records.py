"""torch.save records for many small tensors without torch.save's per-call cost.

DCP writes every tensor as one ``torch.save`` zip record. For a tensor of a few KiB, torch.save's
Python pickler, its zip writer's ~40 small writes and its serialization id cost ~100 us, twenty
times the bytes. With the CRC off (parallel_dcp's default), what torch.save writes for a plain CPU
tensor depends only on its dtype, shape and strides, except for the tensor's bytes themselves::

    torch.save(t) == prefix(class) + bytes of t's storage + suffix(class)

so the record of a *class* is made once, by torch.save itself, from an uninitialised tensor of the
same dtype, shape and strides, and split around its storage's bytes; every tensor of the class is
then written as ``prefix``, its storage's bytes (straight from the tensor, no copy) and ``suffix``.
The only difference from a fresh torch.save is the serialization id, a random number every
torch.save draws and no reader checks (torch.load only logs it): a template's id is replaced by
digits derived from the rest of its record, so a record's bytes depend on the tensor alone, not on
which process first wrote its class (a template built in one worker and not in another made two
saves of one state dict differ by that id).

Only what ``tests/test_records.py`` compares bit for bit against torch.save takes this path (the
dtypes of :data:`LEAN_DTYPES`, strided CPU tensors whose storage is exactly their bytes, at
offset 0, no conjugate or negative bit, at most :data:`LEAN_MAX_BYTES`) and only while torch.save's
CRC is off; anything else is written by torch.save as before (:func:`template_for` says None).
"""

from __future__ import annotations

import hashlib
import io
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LEAN_DTYPES", "LEAN_MAX_BYTES", "Template", "class_template", "storage_bytes", "template_for"]

# The round-trip matrix's dtypes (tests/test_roundtrip.py), each checked by tests/test_records.py.
LEAN_DTYPES = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    }
)
# Building a template writes a tensor of the class once; above this the per-call cost of
# torch.save is negligible beside the bytes, so large tensors keep going through it.
LEAN_MAX_BYTES = 4 * 1024 * 1024
_CACHE_LIMIT = 4096
_LOCAL_HEADER = struct.Struct("<4s5H3I2H")


@dataclass(frozen=True, slots=True)
class Template:
    """A torch.save record split around its tensor's bytes."""

    prefix: bytes
    suffix: bytes
    nbytes: int

    def size(self) -> int:
        return len(self.prefix) + self.nbytes + len(self.suffix)


_cache: dict[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int], Template | None] = {}


def _crc_off() -> bool:
    getter = getattr(torch.serialization, "get_crc32_options", None)
    return getter is not None and not getter()


def _alignment() -> int:
    try:
        from torch.utils.serialization import config

        return int(config.save.storage_alignment)
    except (ImportError, AttributeError):
        return -1


def lean_eligible(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` (already detached) is one of the tested cases."""
    return (
        type(tensor) is torch.Tensor
        and tensor.dtype in LEAN_DTYPES
        and tensor.layout == torch.strided
        and tensor.device.type == "cpu"
        and not tensor.requires_grad
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not tensor.is_quantized
        and not _has_names(tensor)
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.nbytes
        and tensor.nbytes <= LEAN_MAX_BYTES
    )


def _has_names(tensor: torch.Tensor) -> bool:
    has_names = getattr(tensor, "has_names", None)  # named tensors are gone from newer torch
    return bool(has_names()) if has_names is not None else False


def template_for(tensor: torch.Tensor) -> Template | None:
    """The record template of ``tensor``'s class, or None when torch.save must write it."""
    if not _crc_off() or not lean_eligible(tensor):
        return None
    key = (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), _alignment())
    if key in _cache:
        return _cache[key]
    template = _build(tensor)
    if len(_cache) >= _CACHE_LIMIT:
        _cache.clear()  # a job of ever new shapes: keep memory bounded, rebuild on demand
    _cache[key] = template
    return template


def class_template(dtype: torch.dtype, shape: tuple[int, ...], strides: tuple[int, ...]) -> Template | None:
    """The record template of the class (``dtype``, ``shape``, ``strides``) whatever its size, for
    a tensor whose bytes are elsewhere (:class:`~parallel_dcp.storage.pending.PendingTensor`);
    None when torch.save must write it.

    Up to :data:`LEAN_MAX_BYTES` this is :func:`template_for`'s template. Above, torch.save writes
    an uninitialised tensor of the class (its pages never touched: no memory) into a stream that
    keeps every write but the one of the storage's bytes, which torch.save makes in one piece."""
    key = (dtype, tuple(shape), tuple(strides), _alignment())
    if key in _cache:
        return _cache[key]
    if not _crc_off() or dtype not in LEAN_DTYPES or _fills_uninitialised():
        return None
    dummy = torch.empty_strided(tuple(shape), tuple(strides), dtype=dtype)
    if dummy.nbytes <= LEAN_MAX_BYTES:
        return template_for(dummy)
    template = _build_around(dummy)
    if len(_cache) >= _CACHE_LIMIT:
        _cache.clear()
    _cache[key] = template
    return template


def _fills_uninitialised() -> bool:
    """torch fills every new tensor (deterministic mode's fill_uninitialized_memory): a dummy of
    a large class would then be written in full."""
    try:
        from torch.utils import deterministic

        return bool(torch.are_deterministic_algorithms_enabled() and deterministic.fill_uninitialized_memory)  # type: ignore[attr-defined]
    except (ImportError, AttributeError):
        return True


class _CutStream:
    """What torch.save writes, but for the one write of ``nbytes`` at ``address`` (the storage)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.address, self.nbytes = address, nbytes
        self.before: list[bytes] = []
        self.after: list[bytes] = []
        self.cuts = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes == self.nbytes and view.nbytes and _address(view) == self.address:
            self.cuts += 1
        else:
            (self.after if self.cuts else self.before).append(bytes(view))
        return view.nbytes

    def flush(self) -> None:
        """Nothing is buffered."""


def _build_around(dummy: torch.Tensor) -> Template | None:
    cut = _CutStream(dummy.data_ptr(), dummy.nbytes)
    torch.save(dummy, cut)  # type: ignore[arg-type]
    if cut.cuts != 1:
        return None  # not written in one piece: torch.save writes this class
    prefix, suffix = b"".join(cut.before), b"".join(cut.after)
    record = _Gapped(prefix, dummy.nbytes, suffix)
    start = _data_offset(record)
    if start != len(prefix):
        return None
    found = _serialization_id(record, start, start + dummy.nbytes)
    if found is not None:  # in the suffix: after the tensor's bytes
        at, digits = found[0] - start - dummy.nbytes, found[1]
        suffix = suffix[:at] + digits + suffix[at + len(digits) :]
    return Template(prefix, suffix, dummy.nbytes)


class _Gapped(io.RawIOBase):
    """A record read as a file whose tensor bytes (``gap`` of them, after ``prefix``) are not
    there: zipfile reads only the headers around them."""

    def __init__(self, prefix: bytes, gap: int, suffix: bytes) -> None:
        self.prefix, self.gap, self.suffix = prefix, gap, suffix
        self.size = len(prefix) + gap + len(suffix)
        self.position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.position = [offset, self.position + offset, self.size + offset][whence]
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer: Any) -> int:
        data = self.span(self.position, min(self.size, self.position + len(buffer)))
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)

    def span(self, start: int, end: int) -> bytes:
        """Bytes ``start:end`` (zeros in the gap; only headers are asked for)."""
        head = len(self.prefix)
        tail = head + self.gap
        out = self.prefix[start:end] if start < head else b""
        if end > head and start < tail:
            out += bytes(min(end, tail) - max(start, head))
        if end > tail:
            out += self.suffix[max(start, tail) - tail : end - tail]
        return out

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: slice) -> bytes:
        return self.span(*index.indices(self.size)[:2])


def _address(view: memoryview) -> int:
    import numpy

    return int(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data)


def storage_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor``'s storage, in storage order (what torch.save writes), without a copy."""
    if tensor.nbytes == 0:
        return memoryview(b"")
    raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    return memoryview(raw.numpy()).cast("B")  # type: ignore[arg-type]


def _build(tensor: torch.Tensor) -> Template | None:
    dummy = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype)
    if dummy.untyped_storage().nbytes() != tensor.nbytes:
        return None
    buffer = io.BytesIO()
    torch.save(dummy, buffer)
    record = buffer.getvalue()
    start = _data_offset(record)
    if start is None:
        return None
    end = start + tensor.nbytes
    if record[start:end] != storage_bytes(dummy).tobytes():
        return None  # not the layout this module knows: torch.save writes this class
    record = _fixed_serialization_id(record, start, end)
    return Template(record[:start], record[end:], tensor.nbytes)


def _members(record: bytes | _Gapped) -> list[zipfile.ZipInfo] | None:
    try:
        with zipfile.ZipFile(record if isinstance(record, _Gapped) else io.BytesIO(record)) as archive:
            return archive.infolist()
    except zipfile.BadZipFile:
        return None


def _payload_offset(record: bytes | _Gapped, info: zipfile.ZipInfo) -> int | None:
    """Where the bytes of the zip member ``info`` start in ``record`` (after its local header)."""
    header = record[info.header_offset : info.header_offset + _LOCAL_HEADER.size]
    if len(header) != _LOCAL_HEADER.size:
        return None
    signature, *_, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    if signature != b"PK\x03\x04":
        return None
    return int(info.header_offset + _LOCAL_HEADER.size + name_length + extra_length)


def _data_offset(record: bytes | _Gapped) -> int | None:
    """Where the bytes of the one storage record (``<archive>/data/0``) start in ``record``."""
    members = _members(record) or []
    infos = [i for i in members if i.filename.endswith("/data/0")]
    names = [i.filename for i in members if "/data/" in i.filename]
    if len(infos) != 1 or len(names) != 1:
        return None
    return _payload_offset(record, infos[0])


def _fixed_serialization_id(record: bytes, data_start: int, data_end: int) -> bytes:
    """``record`` with its serialization id (random digits, after the tensor's bytes at
    ``data_start:data_end``) replaced by as many digits taken from a hash of the record without
    the id and the tensor's bytes; as it is where there is no such member or its CRC is set (it
    would no longer match)."""
    found = _serialization_id(record, data_start, data_end)
    if found is None:
        return record
    start, digits = found
    return record[:start] + digits + record[start + len(digits) :]


def _serialization_id(record: bytes | _Gapped, data_start: int, data_end: int) -> tuple[int, bytes] | None:
    """Where the serialization id lies in ``record`` and the digits that replace it (see
    :func:`_fixed_serialization_id`), or None to keep the record as it is."""
    ids = [i for i in _members(record) or [] if i.filename.endswith("/.data/serialization_id")]
    if len(ids) != 1 or ids[0].CRC != 0 or ids[0].compress_type != zipfile.ZIP_STORED:
        return None
    start = _payload_offset(record, ids[0])
    if start is None or start < data_end:
        return None
    end = start + ids[0].file_size
    hashed = record[:data_start] + record[data_end:start] + record[end:]
    digits = "".join(str(b % 10) for b in hashlib.blake2b(hashed, digest_size=64).digest())
    if end - start > len(digits) or end > len(record):
        return None
    return start, digits[: end - start].encode()
