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

Longer than 300 lines because a template is only as safe as the checks of torch.save's zip layout
that made it (which write is the tensor's bytes, where its member and the serialization id lie),
and those checks read the record without its bytes (:class:`_Spliced`): apart, a change of one
would silently leave the other checking a layout it no longer builds.
"""

from __future__ import annotations

import hashlib
import io
import math
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "LEAN_DTYPES",
    "LEAN_MAX_BYTES",
    "Template",
    "class_template",
    "fills_uninitialised",
    "storage_bytes",
    "template_for",
]

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
# Building a template runs torch.save once for the class (the tensor's bytes left out as they are
# written: no copy of them is held); above this the per-call cost of torch.save is negligible
# beside the bytes, so large tensors keep going through it.
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


def class_template(
    dtype: torch.dtype, shape: tuple[int, ...], strides: tuple[int, ...] | None = None
) -> Template | None:
    """The record every CPU tensor of ``dtype``, ``shape`` and ``strides`` (contiguous when None;
    else a dense permutation: a storage exactly its bytes) gets from the shard writer
    (:func:`template_for` up to :data:`LEAN_MAX_BYTES`, torch.save's own record above), split
    around its bytes, so that a record can be written from bytes that never become a tensor
    (storage.read_ahead). None where the writer would not write the class that way: the CRC on
    (the record then depends on the bytes), a dtype not checked bit for bit.

    Above :data:`LEAN_MAX_BYTES` the record is what torch.save writes for an uninitialised tensor of
    the class, with the data's one write left out rather than copied (no byte of it is read while
    the CRC is off), so torch.save's own serialization id is kept: what the writer's torch.save of
    the real tensor gives, bit for bit (``tests/test_read_ahead.py``).
    """
    if not _crc_off() or dtype not in LEAN_DTYPES or fills_uninitialised():
        return None
    shape = tuple(shape)
    stride = tuple(strides) if strides is not None else tuple(torch.empty(shape, dtype=dtype, device="meta").stride())
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes <= LEAN_MAX_BYTES:
        return template_for(torch.empty_strided(shape, stride, dtype=dtype))
    key = (dtype, shape, stride, _alignment())
    if key not in _cache:
        dummy = torch.empty_strided(shape, stride, dtype=dtype)  # never touched: no memory taken
        if dummy.untyped_storage().nbytes() != nbytes:
            return None  # a storage larger than the elements: DCP clones such a tensor
        if len(_cache) >= _CACHE_LIMIT:
            _cache.clear()
        _cache[key] = _build_unread(dummy, nbytes)
    return _cache[key]


def fills_uninitialised() -> bool:
    """torch fills every new tensor (deterministic mode's fill_uninitialized_memory): a dummy of a
    large class would then be written in full, in memory nobody budgeted."""
    try:
        from torch.utils import deterministic

        return bool(torch.are_deterministic_algorithms_enabled() and deterministic.fill_uninitialized_memory)  # type: ignore[attr-defined]
    except (ImportError, AttributeError):
        return True


class _Capture:
    """A stream torch.save writes to: every write kept, except the one of the storage's bytes (the
    write of ``nbytes`` right after the local header of the ``data/0`` member: an earlier write of
    the same size, such as a 2-byte one before a 2-byte tensor's, is kept)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.before = bytearray()
        self.after = bytearray()
        self.skipped = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes == self.nbytes and not self.skipped and _ends_with_data_header(self.before):
            self.skipped += 1
        else:
            (self.after if self.skipped else self.before).extend(view)
        return view.nbytes

    def flush(self) -> None:
        """Nothing is buffered."""


def _ends_with_data_header(prefix: bytes | bytearray) -> bool:
    """Whether ``prefix`` ends with the whole local header of the storage's member (``.../data/0``)."""
    at = prefix.rfind(b"PK\x03\x04")
    if at < 0 or len(prefix) - at < _LOCAL_HEADER.size:
        return False
    _, *_, name_length, extra_length = _LOCAL_HEADER.unpack_from(prefix, at)
    name = bytes(prefix[at + _LOCAL_HEADER.size : at + _LOCAL_HEADER.size + name_length])
    return at + _LOCAL_HEADER.size + name_length + extra_length == len(prefix) and name.endswith(b"/data/0")


def _build_unread(dummy: torch.Tensor, nbytes: int) -> Template | None:
    capture = _Capture(nbytes)
    torch.save(dummy, capture)  # type: ignore[arg-type]
    if capture.skipped != 1:
        return None  # the storage's record was not written where this module expects it
    return Template(bytes(capture.before), bytes(capture.after), nbytes)


def storage_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor``'s storage, in storage order (what torch.save writes), without a copy."""
    if tensor.nbytes == 0:
        return memoryview(b"")
    raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    return memoryview(raw.numpy()).cast("B")  # type: ignore[arg-type]


def _build(tensor: torch.Tensor) -> Template | None:
    """The template of ``tensor``'s class, made by torch.save of an untouched tensor of the class
    whose bytes are left out as they are written (:class:`_Capture`): building it holds no copy
    of the tensor's bytes. Made whole (in a buffer, taken out with ``getvalue``, sliced, compared
    and joined again), a 3 MiB template took four to five copies at once, 12-16 MiB in a worker
    whose task admission had counted none of them (a gpt-oss MXFP4 dequantize over its limit)."""
    dummy = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype)
    nbytes = tensor.nbytes
    if dummy.untyped_storage().nbytes() != nbytes:
        return None
    capture = _Capture(nbytes)
    torch.save(dummy, capture)  # type: ignore[arg-type]
    if capture.skipped:
        prefix, suffix = bytes(capture.before), bytes(capture.after)
    else:  # no bytes to leave out (an empty tensor) or not the layout this module knows
        record = bytes(capture.before)
        start = _data_offset(_Spliced(record, 0, b"")) if nbytes == 0 else None
        if start is None:
            return None  # torch.save writes this class
        prefix, suffix = record[:start], record[start:]
    if _data_offset(_Spliced(prefix, nbytes, suffix)) != len(prefix):
        return None
    return Template(prefix, _fixed_serialization_id(prefix, nbytes, suffix), nbytes)


class _Spliced(io.RawIOBase):
    """A record read as ``prefix``, ``gap`` zero bytes (the tensor's place, never allocated) and
    ``suffix``: what zipfile needs to list the members of a template's record."""

    def __init__(self, prefix: bytes, gap: int, suffix: bytes) -> None:
        super().__init__()
        self.prefix, self.gap, self.suffix = prefix, gap, suffix
        self.size = len(prefix) + gap + len(suffix)
        self.position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, base + offset)
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.at(self.position, view.nbytes)
        view[: len(data)] = data
        self.position += len(data)
        return len(data)

    def at(self, offset: int, length: int) -> bytes:
        """``length`` bytes of the record from ``offset`` (fewer at its end)."""
        end = min(self.size, offset + length)
        after = len(self.prefix) + self.gap
        out = self.prefix[offset:end]
        if end > len(self.prefix) and offset < after:
            out += bytes(min(end, after) - max(offset, len(self.prefix)))
        if end > after:
            out += self.suffix[max(0, offset - after) : end - after]
        return out


def _members(record: _Spliced) -> list[zipfile.ZipInfo] | None:
    try:
        with zipfile.ZipFile(record) as archive:
            return archive.infolist()
    except zipfile.BadZipFile:
        return None


def _payload_offset(record: _Spliced, info: zipfile.ZipInfo) -> int | None:
    """Where the bytes of the zip member ``info`` start in ``record`` (after its local header)."""
    header = record.at(info.header_offset, _LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size:
        return None
    signature, *_, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    if signature != b"PK\x03\x04":
        return None
    return int(info.header_offset + _LOCAL_HEADER.size + name_length + extra_length)


def _data_offset(record: _Spliced) -> int | None:
    """Where the bytes of the one storage record (``<archive>/data/0``) start in ``record``."""
    members = _members(record) or []
    infos = [i for i in members if i.filename.endswith("/data/0")]
    names = [i.filename for i in members if "/data/" in i.filename]
    if len(infos) != 1 or len(names) != 1:
        return None
    return _payload_offset(record, infos[0])


def _fixed_serialization_id(prefix: bytes, nbytes: int, suffix: bytes) -> bytes:
    """``suffix`` (what follows the tensor's ``nbytes`` bytes after ``prefix`` in a record) with the
    serialization id (random digits) replaced by as many digits taken from a hash of the record
    without the id and the tensor's bytes; as it is where there is no such member after the
    tensor's bytes or its CRC is set (it would no longer match)."""
    record = _Spliced(prefix, nbytes, suffix)
    ids = [i for i in _members(record) or [] if i.filename.endswith("/.data/serialization_id")]
    if len(ids) != 1 or ids[0].CRC != 0 or ids[0].compress_type != zipfile.ZIP_STORED:
        return suffix
    start = _payload_offset(record, ids[0])
    if start is None or start < len(prefix) + nbytes:
        return suffix
    start -= len(prefix) + nbytes  # in the suffix from here on
    end = start + ids[0].file_size
    hashed = prefix + suffix[:start] + suffix[end:]
    digits = "".join(str(b % 10) for b in hashlib.blake2b(hashed, digest_size=64).digest())
    if end - start > len(digits) or end > len(suffix):
        return suffix
    return suffix[:start] + digits[: end - start].encode() + suffix[end:]
