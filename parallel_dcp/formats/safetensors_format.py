"""safetensors: one file, or a Hugging Face directory (``model.safetensors.index.json`` + shards).

Read through the safetensors library (headers for listing, ``safe_open`` mmap for data), or, for
a conversion with io direct/auto, large local files with O_DIRECT ranged reads straight into the
tensors (``use_direct_reads``); written one shard per task (a stream through the job's I/O layer,
or ``save_file``), in the layout Hugging Face tools expect: ``model-00001-of-00003.safetensors``
... plus the index's ``weight_map`` and ``total_size``.

Longer than 300 lines because it reads safetensors three ways (the library's mmap, O_DIRECT
ranged reads, ranged reads from object storage), checks untrusted headers, and writes it two
ways (a file, a stream).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from parallel_dcp._json import loads_json
from parallel_dcp.engine.chunks import Chunk
from parallel_dcp.errors import CorruptCheckpointError, UnsafeCheckpointError
from parallel_dcp.formats.base import Entry, FileFormat, Source
from parallel_dcp.formats.folder_files import chosen_files
from parallel_dcp.formats.range_read import RawRange
from parallel_dcp.formats.shard_index import check_index
from parallel_dcp.storage.direct_read import ShardFile, direct_read_memory
from parallel_dcp.storage.io_mode import uses_direct
from parallel_dcp.storage.location import MIN_PART_BYTES, Location, Remote, listdir, new_file_mode
from parallel_dcp.storage.manifest import EMBEDDED_KEY, FileDigest, Hasher, embedded_record, read_embedded
from parallel_dcp.storage.pinned_paths import open_source, opened_for_library
from parallel_dcp.storage.read_ahead import Span

__all__ = [
    "FORMAT",
    "INDEX_NAME",
    "LONE_NAME",
    "SafetensorsSource",
    "embedded_checksums",
    "header_metadata",
    "is_safetensors",
    "shard_names",
    "write",
    "write_shard",
    "write_stream",
]

INDEX_NAME = "model.safetensors.index.json"
LONE_NAME = "model.safetensors"  # a Hugging Face directory of one shard (transformers reads it before an index)
_SUFFIX = ".safetensors"
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,  # the MX formats' scales
}
# Names the format has whose torch dtype is not one of the above: F4's shape counts 4-bit
# elements, torch's float4_e2m1fn_x2 counts bytes of two; F6 packs across bytes.
_UNSUPPORTED = {"F4": "float4 packed two to a byte", "F6_E2M3": "float6", "F6_E3M2": "float6"}


def _dtype_problem(file: str, key: str, name: str) -> str:
    """Why a tensor of safetensors dtype ``name`` cannot be read here."""
    if name in _UNSUPPORTED:
        return (
            f"{file}: tensor {key!r} has dtype {name} ({_UNSUPPORTED[name]}), which parallel_dcp does not read; "
            "safetensors.torch.load_file may"
        )
    return f"{file}: tensor {key!r} has dtype {name}, which torch cannot hold"


_MAX_HEADER = 100 * 2**20  # the safetensors library's own limit
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_LFS_POINTER = b"version https://git-lfs"  # how a Git LFS pointer file starts


def is_safetensors(path: Location) -> bool:
    if path.is_dir():
        return any(n == INDEX_NAME or n.endswith(_SUFFIX) for n in listdir(path))
    return path.name.endswith(_SUFFIX)


def _local_header(path: str) -> tuple[int, dict[str, Any]]:
    """As :func:`_remote_header`, for a local file (two small reads)."""
    fd = open_source(path)
    try:
        return _remote_header(_LocalBytes(path, fd))  # type: ignore[arg-type]
    finally:
        os.close(fd)


class _LocalBytes:
    """The ``read_bytes(start, stop)`` of a local file, and its name, as a Remote gives them."""

    def __init__(self, path: str, fd: int) -> None:
        self.path, self.fd = path, fd

    def read_bytes(self, start: int, stop: int) -> bytes:
        return os.pread(self.fd, stop - start, start)

    def __str__(self) -> str:
        return self.path


def _lfs_pointer(file: str) -> str | None:
    """A Git LFS pointer in place of the file (a clone without git-lfs): named, with what to do."""
    try:
        fd = open_source(file)
    except (CorruptCheckpointError, OSError):
        return None
    try:
        start = os.pread(fd, len(_LFS_POINTER), 0)
    finally:
        os.close(fd)
    if start != _LFS_POINTER:
        return None
    return f"{file} is a Git LFS pointer, not the file's data: run git lfs pull (or download the file)"


def _coverage(file: str) -> str | None:
    """Why ``file`` is not covered by its header: shorter (truncated) or longer than the bytes its
    tensors' offsets end at; None when it is not that (or its header cannot be read at all)."""
    try:
        start, header = _local_header(file)
        size = os.path.getsize(file)
        end = max((int(info["data_offsets"][1]) for info in header.values()), default=0)
    except (CorruptCheckpointError, OSError, KeyError, IndexError, TypeError, ValueError):
        return None
    needed = start + end
    if size < needed:
        return f"{file} is truncated: its header says {needed} bytes, the file has {size}"
    if size > needed:
        return f"{file} has {size - needed} bytes after the {needed} its header covers (not a safetensors file)"
    return None


def _data_start(item: tuple[str, Any]) -> int:
    """Where a header entry's data starts (a malformed entry sorts first, to be refused by name)."""
    try:
        return int(item[1]["data_offsets"][0])
    except (KeyError, TypeError, ValueError, IndexError):
        return -1


def header_metadata(stated: list[dict[str, str]]) -> dict[str, str]:
    """What a safetensors output carries on of its source's ``__metadata__`` (``stated``: each
    shard's): every entry on which the shards that state it agree, except parallel_dcp's own
    checksums (:data:`EMBEDDED_KEY`), which describe the source's file and are made anew for the
    output. An entry the shards disagree on describes one shard, not the model: it is left out
    (output shards hold other tensors than the source's)."""
    merged: dict[str, str] = {}
    clashing: set[str] = {EMBEDDED_KEY}
    for metadata in stated:
        for key, value in metadata.items():
            if merged.setdefault(key, value) != value:
                clashing.add(key)
    return {key: value for key, value in merged.items() if key not in clashing}


def _remote_header(remote: Remote, *, keep_metadata: bool = False) -> tuple[int, dict[str, Any]]:
    """Where the data starts, and the JSON header (without ``__metadata__`` unless
    ``keep_metadata``): two ranged reads, no tensor bytes."""
    head = remote.read_bytes(0, 8)
    if len(head) < 8:
        raise CorruptCheckpointError(f"{remote} is not a safetensors file: it has {len(head)} bytes")
    (size,) = struct.unpack("<Q", head)
    if size > _MAX_HEADER:
        raise CorruptCheckpointError(f"{remote} is not a safetensors file: its header claims {size} bytes")
    try:
        header = loads_json(remote.read_bytes(8, 8 + size))
    except ValueError as exc:
        raise CorruptCheckpointError(f"{remote} is not a safetensors file: its header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{remote} is not a safetensors file: its header is not a JSON object")
    if not keep_metadata:
        header.pop("__metadata__", None)
    return 8 + size, header


@dataclass
class SafetensorsSource(Source):
    """A safetensors file or sharded directory; listing reads only the JSON headers."""

    _handles: dict[str, Any] = field(default_factory=dict, repr=False)
    # On object storage: key -> (first, end) byte of its data in its file.
    _ranges: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)
    # Local keys read with O_DIRECT (use_direct_reads): the same, and the resolved io mode.
    _direct: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)
    _io: str = field(default="buffered", repr=False)
    # Local keys a DCP conversion writes straight from the file, read ahead (stream_reads): key ->
    # (file, first byte of its data), and how those files are read.
    _spans: dict[str, tuple[str, int]] = field(default_factory=dict, repr=False)
    stream_io: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.kind = "safetensors"
        # (as transformers reads the folder: the file config.json names, model.safetensors before
        # an index beside it; an adapter_model.safetensors beside other weights is not the model:
        # formats/folder_choice.py)
        self.files, self.index, self.folder = chosen_files(self.location, INDEX_NAME, _SUFFIX, LONE_NAME, self.folder)
        if isinstance(self.location, Remote):
            self._list_remote(self.location)
        else:
            self._list_local()
        if self.index is not None:
            check_index(self.index, self.files, {k: entry.file for k, entry in self.entries.items()})

    def _list_local(self) -> None:
        stated: list[dict[str, str]] = []
        for file in self.files:
            try:
                with opened_for_library(file) as name:
                    handle = safe_open(name, framework="pt")
            except (FileNotFoundError, UnsafeCheckpointError):
                raise
            except Exception as exc:  # SafetensorError and friends: the header is not valid
                # the library's "file not fully covered" or "header too large", in our words
                said = _lfs_pointer(file) or _coverage(file)
                raise CorruptCheckpointError(said or f"{file} is not a readable safetensors file: {exc}") from exc
            with handle as f:
                stated.append(f.metadata() or {})
                # by offset, as load_file gives them (older libraries: by name)
                for key in getattr(f, "offset_keys", f.keys)():
                    piece = f.get_slice(key)
                    dtype = _DTYPES.get(piece.get_dtype())
                    if dtype is None:
                        raise CorruptCheckpointError(_dtype_problem(file, key, piece.get_dtype()))
                    if key in self.entries:
                        raise CorruptCheckpointError(f"{self.path}: tensor {key!r} is in two shards")
                    self.entries[key] = Entry(key, dtype, tuple(piece.get_shape()), file)
        self.header_metadata = header_metadata(stated)

    def _list_remote(self, location: Remote) -> None:
        stated: list[dict[str, str]] = []
        for file in self.files:
            remote = Remote(file, location.options)
            start, header = _remote_header(remote, keep_metadata=True)
            metadata = header.pop("__metadata__", None)
            # (not text to text: the library refuses such a file; nothing of it is carried here)
            ok = isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
            stated.append(metadata if ok else {})
            total = remote.size()
            for key, info in sorted(header.items(), key=_data_start):  # by offset, as load_file gives them
                try:
                    dtype = _DTYPES.get(info["dtype"])
                    shape = tuple(int(n) for n in info["shape"])
                    first, end = (int(n) for n in info["data_offsets"])
                except (KeyError, TypeError, ValueError) as exc:
                    raise CorruptCheckpointError(f"{file}: tensor {key!r} has a malformed header entry") from exc
                if dtype is None:
                    raise CorruptCheckpointError(_dtype_problem(file, key, str(info["dtype"])))
                if key in self.entries:
                    raise CorruptCheckpointError(f"{self.path}: tensor {key!r} is in two shards")
                if any(n < 0 for n in shape) or not 0 <= first <= end or start + end > total:
                    raise CorruptCheckpointError(
                        f"{file}: tensor {key!r} has an impossible shape or byte range ({shape}, {first}..{end})"
                    )
                self.entries[key] = Entry(key, dtype, shape, file)
                self._ranges[key] = (start + first, start + end)
                if end - first != self.entries[key].nbytes:
                    raise CorruptCheckpointError(
                        f"{file}: tensor {key!r} has {end - first} bytes for its shape and dtype"
                    )
        self.header_metadata = header_metadata(stated)

    def _read_range(self, key: str, first: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Bytes of ``key`` from ``first`` on (relative to its data) into a tensor of ``shape``."""
        entry = self.entries[key]
        out = torch.empty(shape, dtype=entry.dtype)
        if out.nbytes:
            buffer = memoryview(out.reshape(-1).view(torch.uint8).numpy().data).cast("B")
            Remote(entry.file, self.storage_options or {}).read_into(self._ranges[key][0] + first, buffer)
        return out

    def use_direct_reads(self, io: str) -> None:
        """Read local files of at least DIRECT_MIN_BYTES (any size with ``io="direct"``) with
        O_DIRECT into the tensors (storage.direct_read) instead of through their mmap: a cold
        source then streams at the device's speed and leaves no pages in the page cache. ``io``
        as resolved by storage.io_mode.resolve_io; "buffered" changes nothing."""
        if io == "buffered" or isinstance(self.location, Remote):
            return
        for file in self.files:
            if not uses_direct(io, os.path.getsize(file)):
                continue
            start, header = _local_header(file)
            for key, info in header.items():
                entry = self.entries.get(key)
                first, end = (int(n) for n in info["data_offsets"])
                if entry is None or entry.file != file or end - first != entry.nbytes:
                    raise CorruptCheckpointError(f"{file}: the header of {key!r} changed while opening")
                self._direct[key] = (start + first, start + end)
        self._io = io

    def stream_reads(self, io: str) -> None:
        """Let a conversion's workers write this source's tensors from their files' bytes, read
        ahead through a small ring (storage.read_ahead, jobs/streamed.py), never as tensors of their
        own; ``io``: how those files are read (read_choice's ``io``). Nothing on object storage."""
        if isinstance(self.location, Remote):
            return
        self._spans = {key: (found.file, found.offset) for key, found in self.raw_ranges().items()}
        self.stream_io = io

    def direct_files(self) -> set[str]:
        """The files read with O_DIRECT, past the page cache (``use_direct_reads``, ``stream_reads``)."""
        if self.stream_io is not None and self.stream_io != "buffered":
            return set(self.files)
        return {self.entries[key].file for key in self._direct}

    def span(self, key: str, chunk: Chunk | None = None) -> Span | None:
        """Where the bytes of ``key`` (or of its ``chunk``, when it is rows: one run of bytes) lie,
        for a source set to :meth:`stream_reads`; None when they are not one local run."""
        if self.stream_io is None or key not in self._spans:
            return None
        entry, (file, start) = self.entries[key], self._spans[key]
        if chunk is None:
            return Span(file, start, entry.nbytes)
        if chunk.dim != 0:
            return None
        nbytes = chunk.nbytes(entry.dtype.itemsize)
        return Span(file, start + chunk.start * (nbytes // max(1, chunk.stop - chunk.start)), nbytes)

    def raw_ranges(self) -> dict[str, RawRange]:
        """Every tensor of a local source: its data offsets from the header, checked against what
        listing found (a header changed since is refused); none on object storage."""
        if isinstance(self.location, Remote):
            return {}
        out: dict[str, RawRange] = {}
        for file in self.files:
            start, header = _local_header(file)
            for key, info in header.items():
                entry = self.entries.get(key)
                try:
                    first, end = (int(n) for n in info["data_offsets"])
                except (KeyError, TypeError, ValueError) as exc:
                    raise CorruptCheckpointError(f"{file}: tensor {key!r} has a malformed header entry") from exc
                if entry is None or entry.file != file or end - first != entry.nbytes or first < 0:
                    raise CorruptCheckpointError(f"{file}: the header of {key!r} changed while opening")
                out[key] = RawRange(file, start + first)
        return out

    def _read_direct(self, key: str, first: int, shape: tuple[int, ...]) -> torch.Tensor:
        entry = self.entries[key]
        out = torch.empty(shape, dtype=entry.dtype)
        if out.nbytes:
            buffer = memoryview(out.reshape(-1).view(torch.uint8).numpy().data).cast("B")
            shard = ShardFile(entry.file, io=self._io)
            try:
                shard.read(self._direct[key][0] + first, [buffer])
            finally:
                shard.close()
        return out

    def release(self) -> None:
        self._handles.clear()

    def _handle(self, key: str) -> Any:
        file = self.entries[key].file
        handle = self._handles.get(file)
        if handle is None:  # opened in the worker, on first use: an mmap is never shared
            try:
                with opened_for_library(file) as name:  # a shard swapped for a link since: refused
                    handle = self._handles[file] = safe_open(name, framework="pt")
            except (SafetensorError, OSError) as failure:  # its header was read when the job opened it
                raise CorruptCheckpointError(
                    f"{file} can no longer be read ({failure}): it changed or went away after the job opened it"
                ) from failure
        return handle

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        if self._direct:
            keys = list(keys)
            direct = {key: self._read_direct(key, 0, self.entries[key].shape) for key in keys if key in self._direct}
            return direct | {key: self._handle(key).get_tensor(key) for key in keys if key not in direct}
        if self._ranges:
            return {key: self._read_range(key, 0, self.entries[key].shape) for key in keys}
        return {key: self._handle(key).get_tensor(key) for key in keys}

    def read_chunk(self, chunk: Chunk) -> torch.Tensor:
        """Only the chunk's rows are read (``get_slice``, or one ranged read), into their own tensor."""
        if chunk.key in self._direct and chunk.dim == 0:
            row = chunk.nbytes(self.entries[chunk.key].dtype.itemsize) // max(1, chunk.stop - chunk.start)
            return self._read_direct(chunk.key, chunk.start * row, tuple(chunk.sizes))
        if self._ranges:
            if chunk.dim != 0:
                return chunk.of(self.read([chunk.key])[chunk.key]).contiguous()
            row = chunk.nbytes(self.entries[chunk.key].dtype.itemsize) // max(1, chunk.stop - chunk.start)
            return self._read_range(chunk.key, chunk.start * row, tuple(chunk.sizes))
        rows = slice(chunk.start, chunk.stop)
        index = tuple(rows if d == chunk.dim else slice(None) for d in range(len(chunk.shape)))
        tensor: torch.Tensor = self._handle(chunk.key).get_slice(chunk.key)[index]
        return tensor.contiguous()

    # A read maps the file's pages (which count while the handle is open); older safetensors
    # versions also copy them out, newer ones return the mapped pages themselves (probed once).
    # From object storage, bytes arrive in 8 MiB ranges straight into the tensor.
    def copied_bytes(self, key: str) -> int:
        nbytes = self.entries[key].nbytes
        if key in self._direct:  # the tensor, and the reading thread's aligned buffers
            return nbytes + direct_read_memory()
        if self._ranges:
            return nbytes + _in_flight(nbytes)
        return nbytes if _reads_are_mapped(self.entries[key].file) else 2 * nbytes

    def chunk_memory(self, chunk: Chunk) -> int:
        nbytes = chunk.nbytes(self.entries[chunk.key].dtype.itemsize)
        if chunk.key in self._direct and chunk.dim == 0:
            return nbytes + direct_read_memory()
        if not self._ranges:
            return 2 * nbytes
        if chunk.dim != 0:  # the whole tensor is read, then the chunk copied out
            return self.copied_bytes(chunk.key) + nbytes
        return nbytes + _in_flight(nbytes)


_MAPPED: dict[str, bool] = {}  # "probed": the answer, once found for this process


def _reads_are_mapped(file: str) -> bool:
    """Whether this safetensors library's ``get_tensor`` returns the file's mapped pages as the
    tensor (no copy): read the smallest tensor of ``file`` once and look where its bytes live.
    False (a copy: the conservative answer) when that cannot be told."""
    known = _MAPPED.get("probed")
    if known is not None:
        return known
    found = False
    try:
        with opened_for_library(file) as name, safe_open(name, framework="pt") as f:  # (by the one rule)
            keys = list(f.keys())
            if keys:
                key = min(keys, key=lambda k: math.prod(f.get_slice(k).get_shape()))
                tensor = f.get_tensor(key)  # kept while the maps are read: its mapping stays
                ptr = tensor.untyped_storage().data_ptr()
                real = os.path.realpath(file)
                with open("/proc/self/maps", encoding="utf-8") as maps:
                    for line in maps:
                        fields = line.split(maxsplit=5)
                        if len(fields) == 6 and fields[5].strip() == real:
                            start, end = (int(x, 16) for x in fields[0].split("-"))
                            found = found or start <= ptr < end
    except (OSError, ValueError):
        found = False
    _MAPPED["probed"] = found
    return found


def shard_names(count: int) -> list[str]:
    """Hugging Face shard names; a single shard is plain ``model.safetensors``."""
    if count == 1:
        return [LONE_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}{_SUFFIX}" for i in range(count)]


def _ours(metadata: dict[str, str] | None) -> dict[str, str]:
    """A header's ``__metadata__``: the source's (``metadata``), then ours over it."""
    return {**(metadata or {}), "format": "pt"}


def write_shard(tensors: dict[str, torch.Tensor], path: str, *, metadata: dict[str, str] | None = None) -> None:
    """Write one shard (``metadata``: the source's ``__metadata__``, carried on under ours).
    Tensors that share storage are copied apart (safetensors refuses sharing)."""
    seen: set[tuple[int, int]] = set()
    ready = {}
    for key, tensor in tensors.items():
        t = tensor.contiguous()
        ident = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if ident in seen or t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone()
        seen.add(ident)
        ready[key] = t
    save_file(ready, path, metadata=_ours(metadata))
    # The safetensors library creates its files 0600; an output gets the mode any new file gets.
    os.chmod(path, new_file_mode())


def _in_flight(nbytes: int) -> int:
    """Memory a ranged read holds beside its target: the response of one range (at most
    ``MIN_PART_BYTES``), and the HTTP client's buffers for it."""
    return 3 * min(nbytes, MIN_PART_BYTES)


def write_stream(
    tensors: dict[str, torch.Tensor],
    stream: Any,
    *,
    checksums: bool | None = None,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write one safetensors file to a write stream, a tensor at a time (object storage uploads).

    The layout is the format's own: an 8-byte little-endian header length, the JSON header
    (padded with spaces to 8 bytes), then every tensor's bytes back to back in header order.
    ``checksums`` (not None): the header's ``__metadata__`` also carries the file's own record
    (:func:`parallel_dcp.storage.manifest.embedded_record`; sizes only when False), so the file is
    verifiable alone; the data is hashed from memory before the header is written. ``metadata``:
    the source's ``__metadata__`` (:func:`header_metadata`), carried on; ours (``format``, the
    checksums) is written over it, never the other way round.
    """
    metadata = _ours(metadata)
    index: dict[str, Any] = {}
    ready = []
    offset = 0
    for key, tensor in tensors.items():
        t = tensor.detach().contiguous()
        index[key] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
        ready.append(t)
    if checksums is not None:
        data = Hasher(checksum=checksums)
        for t in ready:
            if t.nbytes:
                data.update(t.reshape(-1).view(torch.uint8).numpy().data)
        metadata[EMBEDDED_KEY] = embedded_record(_index_digest(index, checksums), data.result())
    header: dict[str, Any] = {"__metadata__": metadata} | index
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    stream.write(struct.pack("<Q", len(text)))
    stream.write(text)
    for t in ready:
        if t.nbytes:
            stream.write(t.reshape(-1).view(torch.uint8).numpy().data)


def _index_digest(index: dict[str, Any], checksum: bool = True) -> FileDigest:
    """The digest of a header's tensor index (``__metadata__`` left out), in a canonical spelling."""
    hasher = Hasher(checksum=checksum)
    hasher.update(json.dumps(index, sort_keys=True, separators=(",", ":")).encode())
    return hasher.result()


def embedded_checksums(path: Location) -> tuple[int, FileDigest, FileDigest, FileDigest] | None:
    """What a single safetensors file says about itself: where its data starts, the digests its
    header records (of the tensor index and of the data), and the digest of the index as it is now
    (None: the file carries no checksums).

    Raises:
        CorruptCheckpointError: the header, or the record in it, cannot be read.
    """
    reader: Any = path if isinstance(path, Remote) else _LocalBytes(str(path), open_source(str(path)))
    try:
        start, header = _remote_header(reader, keep_metadata=True)
    finally:
        if isinstance(reader, _LocalBytes):
            os.close(reader.fd)
    recorded = read_embedded(header.pop("__metadata__", None), path)
    if recorded is None:
        return None
    index, data = recorded
    return start, index, data, _index_digest(header, index.digest is not None)


def write_verifiable(
    tensors: dict[str, Any],
    where: Any,
    mapping: dict[str, tuple[Any, ...]] | None = None,
    *,
    checksums: bool = True,
    metadata: dict[str, str] | None = None,
) -> None:
    """As :func:`write`, to a stream, with the file's checksums in its header (a single-file output)."""
    write_stream(tensors, where, checksums=checksums, metadata=metadata)


def write(
    tensors: dict[str, Any],
    where: Any,
    mapping: dict[str, tuple[Any, ...]] | None = None,
    *,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write one safetensors file to a path (``save_file``) or a write stream; a flat format, so
    ``mapping`` (nesting) does not apply; ``metadata``: the source's ``__metadata__``, carried on."""
    if isinstance(where, str):
        write_shard(tensors, where, metadata=metadata)
    else:
        write_stream(tensors, where, metadata=metadata)


FORMAT = FileFormat(
    kind="safetensors",
    suffixes=(_SUFFIX,),
    index_name=INDEX_NAME,
    shard_names=shard_names,
    write=write,
    tensors_only=True,
    dtypes=frozenset(_NAMES),
    reserved_keys=frozenset({"__metadata__"}),
    write_verifiable=write_verifiable,
    carries_metadata=True,
)
