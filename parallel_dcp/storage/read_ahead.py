"""Byte spans of local files read in order through a small ring, ahead of whoever writes them.

    spans (file, offset, bytes), in the order the writer needs them
      │ cut into pieces (direct: aligned to ALIGN, the span's bytes a window of each piece)
      ▼
    ring of ``depth`` page-aligned buffers ── piece k read into buffer k % depth by a reading thread
      │ read_span(i, sink): sink(view) for each piece of span i, in order; once a piece is
      │ handed on, its buffer takes piece k + depth, which may belong to span i + 1, i + 2 ...
      ▼
    the consumer (a shard writer: the view is copied into its direct-write buffers)

So while a conversion writes one unit, the next ``depth - 1`` pieces are being read, the next
unit's first pieces among them: reading and writing overlap in each worker, and no unit is ever
a tensor of its own (no fresh memory to fault in, no page-cache copy with direct reads). The
ring is all the read side holds: ``depth`` pieces and reading threads, whatever the units' sizes
(:class:`Ring`; :func:`ring_for` fits it into a room). A ring of depth 1 reads a piece, waits
for it to be written, then reads the next: no read-ahead, for a room too small for two pieces.

Files are opened by :class:`~parallel_dcp.storage.direct_read.ShardFile` (regular files only,
never through a symlink; O_DIRECT where ``io`` and the file system say so). A file shorter than
a span needs is :class:`~parallel_dcp.errors.CorruptCheckpointError`.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.storage.direct_read import ShardFile
from parallel_dcp.storage.io_mode import ALIGN
from parallel_dcp.storage.records import Template

__all__ = [
    "DEPTH",
    "MIN_PIECE_BYTES",
    "PIECE_BYTES",
    "THREAD_BYTES",
    "ReadAhead",
    "Ring",
    "Span",
    "StreamedTensor",
    "ring_for",
]

# As the direct reader's ring (storage.direct_read): a piece large enough that the device sees
# big requests, four so that three are in flight while one is copied out.
PIECE_BYTES = 4 << 20
DEPTH = 4
# Below this, two pieces in flight are not worth their system calls: one piece, no read-ahead.
MIN_PIECE_BYTES = 256 << 10
# What one reading thread holds beside the buffers (its stack's touched pages, its thread state): the
# direct writer's three I/O threads measured up to 0.17 MiB (tests/test_memory_io_transients.py).
THREAD_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class Span:
    """The bytes ``offset .. offset + nbytes`` of the local file ``file``."""

    file: str
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Ring:
    """``depth`` buffers of ``piece`` bytes (a multiple of ALIGN)."""

    depth: int
    piece: int

    @property
    def nbytes(self) -> int:
        return self.depth * self.piece

    @property
    def memory(self) -> int:
        """What the ring holds: its buffers and its reading threads."""
        return self.depth * (self.piece + THREAD_BYTES)

    @property
    def reads_ahead(self) -> bool:
        return self.depth > 1


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def ring_for(room: int, largest: int) -> Ring | None:
    """The ring for spans of at most ``largest`` bytes whose :attr:`Ring.memory` fits in ``room``
    bytes: up to :data:`DEPTH` pieces of :data:`PIECE_BYTES` (smaller where the spans are), else
    two smaller pieces of at least :data:`MIN_PIECE_BYTES`, else one piece (no read-ahead); None
    when not even one ALIGN piece fits."""
    needed = _up(largest) + 2 * ALIGN  # a span not aligned in its file straddles one more page each side

    def fit(depth: int) -> int:
        return (room // depth - THREAD_BYTES) // ALIGN * ALIGN

    piece = min(PIECE_BYTES, needed)
    depth = DEPTH
    while depth >= 2 and fit(depth) < piece:
        depth -= 1
    if depth >= 2:
        return Ring(depth, piece)
    two = min(fit(2), needed)
    if two >= min(MIN_PIECE_BYTES, needed):
        return Ring(2, two)
    one = min(fit(1), needed)
    return Ring(1, one) if one >= ALIGN else None


@dataclass(frozen=True, slots=True)
class _Piece:
    span: int
    file: int  # index into the open files
    at: int  # where the read starts in the file
    length: int  # bytes asked for
    lo: int  # the span's bytes in the buffer: lo .. hi
    hi: int


class ReadAhead:
    """Reads ``spans`` in order through ``ring`` (see the module doc); a context manager that waits
    for the reads in flight and frees the ring on exit. ``io`` as resolved for the source
    (:func:`~parallel_dcp.storage.read_choice.read_choice`: ``"direct"``, ``"auto"``, ``"buffered"``)."""

    def __init__(self, spans: Sequence[Span], ring: Ring, io: str) -> None:
        self.spans = list(spans)
        self.ring = ring
        self._files: list[ShardFile] = []
        self._buffers: list[mmap.mmap] = []
        self._reads: dict[int, cf.Future[int]] = {}
        self._pool: cf.ThreadPoolExecutor | None = None
        self._next = 0  # the span read_span takes next
        self._piece = 0  # the piece it takes next
        try:
            names: dict[str, int] = {}
            for span in self.spans:
                if span.file not in names:
                    names[span.file] = len(self._files)
                    self._files.append(ShardFile(span.file, io=io))
            self._pieces = self._cut([names[s.file] for s in self.spans])
        except BaseException:
            self.close()
            raise

    def _cut(self, files: list[int]) -> list[_Piece]:
        pieces = []
        for index, (span, file) in enumerate(zip(self.spans, files, strict=True)):
            direct = self._files[file].direct
            end = span.offset + span.nbytes
            at = span.offset - span.offset % ALIGN if direct else span.offset
            while at < end:
                length = min(self.ring.piece, _up(end - at) if direct else end - at)
                lo = max(span.offset, at) - at
                pieces.append(_Piece(index, file, at, length, lo, min(end, at + length) - at))
                at += length
        return pieces

    def __enter__(self) -> ReadAhead:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        try:
            self._buffers = [mmap.mmap(-1, self.ring.piece, flags=flags) for _ in range(self.ring.depth)]
            self._pool = cf.ThreadPoolExecutor(self.ring.depth, thread_name_prefix="pdcp-read-ahead")
            for k in range(min(self.ring.depth, len(self._pieces))):
                self._submit(k)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _submit(self, k: int) -> None:
        assert self._pool is not None
        self._reads[k] = self._pool.submit(self._read_piece, k)

    def _read_piece(self, k: int) -> int:
        """Read piece ``k`` into its buffer (in a reading thread); the bytes read."""
        piece = self._pieces[k]
        view = memoryview(self._buffers[k % self.ring.depth])
        try:
            shard = self._files[piece.file]
            got = 0
            while got < piece.length:
                n = shard.read_into(view[got : piece.length], piece.at + got)
                if n <= 0:
                    break
                got += n
                if n % ALIGN:  # the end of the file
                    break
            return got
        finally:
            view.release()

    def read_span(self, index: int, sink: Callable[[memoryview], Any]) -> None:
        """Hand span ``index``'s bytes to ``sink``, in order, a piece at a time (each view is valid
        only during its call). Spans are taken in order, each once.

        Raises:
            CorruptCheckpointError: the file ends before the span does.
        """
        if index != self._next or self._pool is None:
            raise RuntimeError(f"span {index} asked for, span {self._next} is next (or the reader is closed)")
        self._next += 1
        while self._piece < len(self._pieces) and self._pieces[self._piece].span == index:
            k = self._piece
            piece = self._pieces[k]
            got = self._reads.pop(k).result()
            if got < piece.hi:
                span = self.spans[index]
                raise CorruptCheckpointError(
                    f"{span.file} ends at byte {piece.at + got}, before the {span.nbytes} bytes at {span.offset} "
                    "its header gives (truncated file)"
                )
            view = memoryview(self._buffers[k % self.ring.depth])
            try:
                sink(view[piece.lo : piece.hi])
            finally:
                view.release()
            self._piece += 1
            if k + self.ring.depth < len(self._pieces):
                self._submit(k + self.ring.depth)

    def close(self) -> None:
        for read in self._reads.values():  # a buffer cannot go while a read lands in it
            read.cancel()
        for read in self._reads.values():
            with contextlib.suppress(Exception):
                read.result()
        self._reads.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for buffer in self._buffers:
            with contextlib.suppress(BufferError):
                buffer.close()
        self._buffers = []
        for file in self._files:
            file.close()
        self._files = []


@dataclass(frozen=True, slots=True)
class StreamedTensor:
    """A tensor to write whose bytes are span ``index`` of ``reader``: the shard writer writes its
    record as ``template`` says, with the span's bytes in the middle, straight from the ring. It
    answers what the writer asks of a tensor's properties (dtype, shape, ...), never its data."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    template: Template
    index: int
    reader: ReadAhead
    requires_grad: bool = False

    def is_pinned(self) -> bool:
        return False

    def write_record(self, stream: Any) -> None:
        stream.write(self.template.prefix)
        self.reader.read_span(self.index, stream.write)
        stream.write(self.template.suffix)
