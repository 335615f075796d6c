"""zstd records as stock DCP's ``ZStandard`` extension writes them, written and read in bounded pieces.

A compressed DCP record is the ``torch.save`` record (or the pickled value) written through one
zstd frame (``zstandard``'s ``stream_writer``), recorded in ``.metadata`` with
``_StorageInfo.transform_descriptors == ["stream.zstd/1"]``; offset and length are those of the
compressed bytes. Stock ``FileSystemReader`` decodes such records whenever ``zstandard`` (or
``pyzstd``) is importable.

Writing: :class:`RecordCompressor` feeds a record to one zstd context in pieces of at most
:data:`PIECE_BYTES`; the compressed output reaches the shard's stream (which checksums it: the
manifest checks the stored bytes) a block at a time, never the whole record.

Reading: :class:`BoundedDecompressor` reads one stored record (local file or object storage) a
piece at a time and decompresses it into buffers the caller gives (a target tensor's memory);
it never yields more than the caller's bound (what ``.metadata`` says the record holds), so a
decompression bomb, a truncated record and a damaged frame are each a
:class:`CorruptCheckpointError` naming the key, before any memory beyond the bound is touched.

``zstandard`` was picked over ``pyzstd`` (docs/compression.md): it is the package stock DCP
tries first, and its ``stream_reader.readinto`` decompresses straight into the caller's buffer.

Longer than 300 lines because the spec parser, the frame writer and the bounded reader are one
format, kept together so that writing and reading cannot drift apart.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from parallel_dcp.engine.memory import ZSTD_MAX_WINDOW_BYTES, zstd_compress_bytes
from parallel_dcp.errors import CompressionUnavailableError, CorruptCheckpointError
from parallel_dcp.storage.direct_read import vanished
from parallel_dcp.storage.pinned_paths import open_source

__all__ = [
    "DESCRIPTOR",
    "PIECE_BYTES",
    "BoundedDecompressor",
    "Compression",
    "CompressionUnavailableError",
    "RecordCompressor",
    "decompress_small",
    "is_compressed",
    "new_decompressor",
    "parse_compress",
]

DESCRIPTOR = "stream.zstd/1"
DEFAULT_LEVEL = 3  # zstd's own default, and what stock's ZStandard() uses
# A record goes to the compressor, and comes out of the decompressor, this much at a time.
PIECE_BYTES = 1 << 20
# What a stored record is read in (local pread or ranged GET).
_READ_BYTES = 1 << 20


def _zstandard() -> Any:
    try:
        import zstandard
    except ImportError as exc:
        raise CompressionUnavailableError(
            "zstd compression needs the 'zstandard' package: pip install '.[zstd]' in a checkout "
            "(or pip install zstandard)"
        ) from exc
    return zstandard


@dataclass(frozen=True, slots=True)
class Compression:
    """A codec and level: ``zstd`` at ``level`` (1..22)."""

    level: int = DEFAULT_LEVEL
    codec: str = "zstd"

    def __str__(self) -> str:
        return f"{self.codec}:{self.level}"

    def memory(self) -> int:
        """What one compressing record writer holds (zstd context, its output block, one piece)."""
        return zstd_compress_bytes(self.level)


def parse_compress(value: object) -> Compression | None:
    """``None`` / ``"zstd"`` / ``"zstd:LEVEL"`` to a :class:`Compression` (None: uncompressed).

    Raises:
        ValueError: anything else, or a level outside 1..22.
        CompressionUnavailableError: compression asked for but ``zstandard`` is not installed.
    """
    if value is None or value is False:
        return None
    if isinstance(value, Compression):
        _zstandard()
        return value
    if not isinstance(value, str):
        raise ValueError(f"compress must be None, 'zstd' or 'zstd:LEVEL', got {value!r}")
    codec, _, level_text = value.strip().lower().partition(":")
    if codec != "zstd":
        raise ValueError(f"unknown compression {value!r}: use 'zstd' or 'zstd:LEVEL' (LEVEL 1..22)")
    level = DEFAULT_LEVEL
    if level_text:
        if not level_text.isdigit() or not 1 <= int(level_text) <= 22:
            raise ValueError(f"compress level must be an integer 1..22, got {value!r}")
        level = int(level_text)
    _zstandard()
    return Compression(level=level)


def is_compressed(info: Any) -> bool:
    """True when a ``_StorageInfo`` describes a record stored through a transform (compressed)."""
    return bool(getattr(info, "transform_descriptors", None))


def check_descriptors(info: Any, key: str) -> None:
    """Only zstd, as stock writes it, is read here.

    Raises:
        CorruptCheckpointError: another or an unknown transform.
    """
    descriptors = list(getattr(info, "transform_descriptors", None) or ())
    if any(not isinstance(d, str) for d in descriptors) or [d.partition("/")[0] for d in descriptors] != [
        "stream.zstd"
    ]:
        raise CorruptCheckpointError(f"{key!r}: record transform {descriptors!r} is not one this version reads")
    if descriptors[0].partition("/")[2].partition(".")[0] != "1":
        raise CorruptCheckpointError(f"{key!r}: unknown zstd stream version {descriptors[0]!r}")


class _NoClose:
    """What the zstd stream writer writes to: closing the frame must not close the shard."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, data: Any) -> int:
        self._stream.write(data)
        return memoryview(data).nbytes

    def flush(self) -> None:
        """The shard's stream flushes when the shard is done."""

    def close(self) -> None:
        """The shard stays open."""

    @property
    def closed(self) -> bool:
        return False


class RecordCompressor:
    """Writes records to ``stream``, each as one zstd frame (stock's ``ZStandard().transform_to``).

    Use :meth:`record` once per record::

        with compressor.record() as out:
            out.write(piece); ...
    """

    def __init__(self, stream: Any, compression: Compression) -> None:
        self._zstd = _zstandard()
        self._stream = stream
        self._compressor = self._zstd.ZstdCompressor(level=compression.level)

    def record(self, size: int | None = None) -> _Record:
        """One frame; ``size``, when known, is the exact number of bytes the record will hold: zstd
        then sizes its tables to the record (a small record costs a fraction of a full reset) and
        writes the size into the frame header (a valid frame stock reads as any other)."""
        writer = self._compressor.stream_writer(
            _NoClose(self._stream), size=-1 if size is None else size, closefd=False, write_return_read=True
        )
        return _Record(writer)


class _Record:
    """One frame: input written in pieces of at most :data:`PIECE_BYTES`; the frame ends on exit."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, PIECE_BYTES):
            self._writer.write(view[start : start + PIECE_BYTES])
        return view.nbytes

    def flush(self) -> None:
        """Blocks reach the shard as the compressor fills them; the frame ends on exit."""

    def __enter__(self) -> _Record:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self._writer.close()  # writes the end of the frame


class _StoredRecord:
    """The stored (compressed) bytes of one record, read a bounded piece at a time."""

    def __init__(self, where: Any, offset: int, length: int, key: str) -> None:
        self._where = where
        self._offset = offset
        self._left = length
        self._key = key
        self._fd = -1
        self.consumed = 0
        if not _is_remote(where):
            try:  # never through a symlink; a shard gone meanwhile is a checkpoint that changed
                self._fd = open_source(os.fspath(where))
            except FileNotFoundError:
                raise vanished(where) from None

    def read(self, size: int = -1) -> bytes:
        size = self._left if size is None or size < 0 else min(size, self._left, _READ_BYTES)
        if size <= 0:
            return b""
        at = self._offset + self.consumed
        if self._fd >= 0:
            data = os.pread(self._fd, size, at)
        else:
            buffer = bytearray(size)
            try:
                self._where.read_into(at, memoryview(buffer))
            except EOFError:
                data = b""
            else:
                data = bytes(buffer)
        if len(data) < size:
            raise CorruptCheckpointError(
                f"{self._where}: the compressed record of {self._key!r} is truncated (the file ends at byte "
                f"{at + len(data)}, .metadata records it up to byte {self._offset + self.consumed + self._left})"
            )
        self.consumed += len(data)
        self._left -= len(data)
        return data

    @property
    def left(self) -> int:
        return self._left

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def new_decompressor() -> Any:
    """A zstd decompression context (reusable, one thread at a time) for :func:`decompress_small`."""
    return _zstandard().ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW_BYTES)


def decompress_small(where: Any, offset: int, length: int, key: str, bound: int, decompressor: Any = None) -> bytes:
    """A small stored record decompressed in one call: read whole (``length`` bytes), never more
    than ``bound`` bytes out (a frame declaring more is refused before anything is allocated).

    Raises:
        CorruptCheckpointError: truncated, damaged, or more than ``bound`` (a bomb).
    """
    zstd = _zstandard()
    source = _StoredRecord(where, offset, length, key)
    try:
        raw = bytearray()
        while source.left:
            raw += source.read(source.left)
    finally:
        source.close()
    what = f"{where}: the compressed record of {key!r}"
    try:
        declared = zstd.frame_content_size(bytes(raw[:18]))
    except zstd.ZstdError as exc:
        raise CorruptCheckpointError(f"{what} is damaged: zstd says {exc}") from exc
    if declared > bound:
        raise CorruptCheckpointError(
            f"{what} declares {declared} bytes, more than the {bound} .metadata allows (decompression bomb)"
        )
    if decompressor is None:
        decompressor = new_decompressor()
    try:
        return bytes(decompressor.decompress(bytes(raw), max_output_size=bound))
    except zstd.ZstdError as exc:
        raise CorruptCheckpointError(
            f"{what} is truncated, damaged or holds more than the {bound} bytes .metadata allows: zstd says {exc}"
        ) from exc


def _is_remote(where: Any) -> bool:
    return hasattr(where, "read_into") and hasattr(where, "options")


class BoundedDecompressor:
    """Decompresses one stored record into caller buffers, never past ``bound`` bytes.

    Args:
        where: the shard (a local path or a :class:`~parallel_dcp.storage.location.Remote`).
        offset, length: the stored record, as ``.metadata`` records it.
        key: named in every error.
        bound: the most decompressed bytes the record may hold (from ``.metadata``).

    Use as a context manager; :meth:`readinto` fills a buffer completely or raises; :meth:`finish`
    reads what is left (at most ``limit`` bytes, returned) and checks that the frame ends there and
    uses every stored byte.
    """

    def __init__(self, where: Any, offset: int, length: int, key: str, bound: int) -> None:
        zstd = _zstandard()
        self._error = zstd.ZstdError
        self.key = key
        self.where = where
        self.bound = bound
        self.produced = 0
        self._source = _StoredRecord(where, offset, length, key)
        decompressor = zstd.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW_BYTES)
        self._reader = decompressor.stream_reader(self._source, read_size=_READ_BYTES, closefd=False)

    def __enter__(self) -> BoundedDecompressor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._reader.close()
        self._source.close()

    def _corrupt(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: the compressed record of {self.key!r} {what}")

    def _readinto(self, view: memoryview) -> int:
        try:
            got = int(self._reader.readinto(view))
        except self._error as exc:
            raise self._corrupt(f"is damaged: zstd says {exc}") from exc
        self.produced += got
        return got

    def readinto(self, buffer: Any) -> None:
        """Fill ``buffer`` (a writable buffer) with the next decompressed bytes."""
        view = memoryview(buffer).cast("B")
        if self.produced + view.nbytes > self.bound:
            raise self._corrupt(f"would hold more than the {self.bound} bytes .metadata allows (decompression bomb)")
        done = 0
        while done < view.nbytes:
            got = self._readinto(view[done : done + PIECE_BYTES])
            if got == 0:
                raise self._corrupt(
                    f"ends after {self.produced} decompressed bytes, before the {self.produced - done + view.nbytes} "
                    "its layout needs (truncated record or damaged frame)"
                )
            done += got

    def read_up_to(self, size: int) -> bytes:
        """Up to ``size`` next bytes (fewer only at the end of the frame)."""
        buffer = bytearray(min(size, max(0, self.bound - self.produced) + 1))
        view = memoryview(buffer)
        done = 0
        while done < len(buffer):
            got = self._readinto(view[done:])
            if got == 0:
                break
            done += got
        if self.produced > self.bound:
            raise self._corrupt(f"holds more than the {self.bound} bytes .metadata allows (decompression bomb)")
        return bytes(buffer[:done])

    def finish(self, limit: int) -> bytes:
        """The rest of the record (at most ``limit`` bytes, within ``bound``); checks the frame ends
        and every stored byte was used."""
        rest = self.read_up_to(limit + 1)
        if len(rest) > limit:
            raise self._corrupt(
                f"holds more decompressed bytes than its layout ({self.produced}+ bytes; decompression bomb)"
            )
        if self._source.left:
            raise self._corrupt(f"has {self._source.left} stored bytes after the end of its zstd frame")
        return rest
