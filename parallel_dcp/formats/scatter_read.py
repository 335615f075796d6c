"""Whole small records read straight into their tensors: one vectored read per run of records.

The records of a shard lie end to end. Each is a head (zip headers, the pickle), the tensor's
bytes, and a tail (the zip directory). Every record of one (length, dtype, shape) holds the
same head and tail but for a few varying spans (formats/record_batch.py), so only those frames
need checking. The tensor's bytes can go straight to the tensor:

    a unit's entries (one shard, sorted by offset), in chunks of <= CHUNK_RECORDS records and
    <= FRAME_BYTES of frames
      │ each record's template (record_batch.TemplateCache; the first record of a new
      │ (length, dtype, shape) read and parsed by the caller) ─▶ its frame: the template's bytes
      │ outside the tensor's data, as 64-bit words, and a mask (0 at varying spans, padding)
      │ iovecs built from columns (numpy; no Python call per record), in file order:
      │   [gap before it ─▶ a junk buffer] [head ─▶ its frame row] [data ─▶ its tensor]
      │   [tail ─▶ its frame row, after the head]
      │ frame rows grouped by template: each template's frames are one 2-D block of the scratch
      │ preadv (libc through ctypes: the GIL is released), <= IOV_MAX iovecs a call; neighbours
      │ more than GAP_BYTES apart start a new call
      │ each block masked and compared with its frame: a word unlike it ─▶ unlike its template
      ▼
    records equal to their template: done, their bytes in their tensors (one copy, by the kernel);
    the rest (no template, unlike it, overlapping) go back to the caller, which reads each record
    again and parses it from its own bytes (formats/small_reads.py): its tensor may hold this
    read's bytes meanwhile; the parse overwrites them with the record's data or the load fails.

Only local files, read buffered (the kernel's read-ahead doubled): O_DIRECT cannot read into
unaligned tensor memory, and object storage has no preadv (the caller reads those in windows). A thread holds at most
:data:`SCATTER_MEMORY` (counted inside ``read_units.thread_memory()``).

Longer than 300 lines because a chunk's columns feed three steps in turn (the rows, the iovecs
with their reads, the bulk check), each vectorized, and splitting them would pass a dozen arrays.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import numpy

from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.formats.read_units import GAP_BYTES, SMALL_RECORD, ReadStats
from parallel_dcp.formats.record_batch import Template, TemplateCache

if TYPE_CHECKING:
    import torch

    from parallel_dcp.formats.read_units import _File

__all__ = ["CHUNK_RECORDS", "FRAME_BYTES", "SCATTER_MEMORY", "Entry", "preadv_function", "read_scattered"]

# (offset, length, key, target, storage info, dtype, shape, the target's data address): one record,
# as .metadata says (the address taken by the planner, which touched the tensor anyway)
Entry = tuple[int, int, str, "torch.Tensor", Any, "torch.dtype", tuple[int, ...], int]

# preadv takes at most IOV_MAX (1024 on Linux) buffers a call.
IOV_MAX = 1024
# The most frame bytes (record heads and tails) one chunk reads into the scratch buffer.
FRAME_BYTES = 4 << 20
# The most records one chunk holds: bounds its columns and iovecs (a few hundred bytes a record).
CHUNK_RECORDS = 4096
# What one thread holds: the scratch, the junk buffer for gaps, one record read to learn its
# template, the chunk's columns and iovecs (about 60 int64 a record, with numpy's temporaries).
SCATTER_MEMORY = FRAME_BYTES + GAP_BYTES + SMALL_RECORD + CHUNK_RECORDS * 512

_ALL_ONES = numpy.uint8(0xFF)
_OFFSET, _LENGTH, _DTYPE, _SHAPE, _ADDRESS = (itemgetter(i) for i in (0, 1, 5, 6, 7))


@functools.cache
def preadv_function() -> Callable[[int, int, int, int], int] | None:
    """libc's ``preadv(fd, iov, iovcnt, offset)`` (ctypes releases the GIL during the call), or None
    where there is none this module can call (then records are read in windows)."""
    if ctypes.sizeof(ctypes.c_void_p) != 8 or ctypes.sizeof(ctypes.c_size_t) != 8:
        return None  # the iovecs are built as pairs of 64-bit words
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        function = libc.preadv
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong]
    function.restype = ctypes.c_ssize_t
    return function  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class _Frame:
    """A template's bytes outside its tensor's data, as a record's frame row holds them: ``head``
    bytes before the data, ``tail`` after it; ``words`` what the row must hold wherever ``mask``
    is set (the varying spans, the storage bytes outside the tensor and the padding are not)."""

    head: int
    nbytes: int
    tail: int
    words: numpy.ndarray[Any, numpy.dtype[numpy.uint64]]
    mask: numpy.ndarray[Any, numpy.dtype[numpy.uint64]]

    @property
    def width(self) -> int:
        """Its row's length in 64-bit words."""
        return int(self.words.size)


def _frame(template: Template) -> _Frame:
    """The frame of ``template``'s records."""
    head, nbytes = template.data_start, template.nbytes
    tail = template.tail_offset + len(template.tail) - head - nbytes
    width = -(-(head + tail) // 8) * 8
    expect = numpy.zeros(width, dtype=numpy.uint8)
    checked = numpy.zeros(width, dtype=numpy.uint8)
    expect[: len(template.head)] = numpy.frombuffer(template.head, dtype=numpy.uint8)
    checked[: len(template.head)] = _ALL_ONES
    at = template.tail_offset - nbytes  # where the template's tail starts in the row
    expect[at : at + len(template.tail)] = numpy.frombuffer(template.tail, dtype=numpy.uint8)
    checked[at : at + len(template.tail)] = _ALL_ONES
    spans = template.spans
    checked[numpy.where(spans < head, spans, spans - nbytes)] = 0
    assert not (expect & ~checked).any()  # a template's varying bytes are zero: rows are compared masked
    return _Frame(head, nbytes, tail, expect.view(numpy.uint64), checked.view(numpy.uint64))


class _Frames:
    """The frames of one unit's templates, by (length, dtype, shape), as columns by row number."""

    def __init__(self, learn: Callable[[Entry], Template | None], templates: TemplateCache) -> None:
        self.learn = learn
        self.templates = templates
        self.stale = False  # frames added since the columns were built
        self.rows: dict[tuple[Any, ...], int] = {}  # -1: no template (parsed one by one)
        self.frames: list[_Frame] = []
        self.head = self.nbytes = self.tail = self.width = numpy.zeros(0, dtype=numpy.int64)

    def ids(self, chunk: Sequence[Entry], length: numpy.ndarray[Any, Any]) -> numpy.ndarray[Any, Any]:
        """The frame row of each entry of ``chunk`` (-1: none; ``length``: their lengths).

        Entries are told apart by their length and the identity of their dtype and shape objects
        (the metadata check shares one tuple per shape; equal shapes held apart only cost another
        lookup): no object is made per record, as a key tuple each would be, and with it the
        garbage collector's passes over the whole heap (0.3 us a record with 50,000 keys loaded).
        Each kind met is then looked up by value, and learned from its first entry."""
        count = len(chunk)
        kinds = numpy.empty((count, 3), dtype=numpy.uint64)
        kinds[:, 0] = length
        kinds[:, 1] = numpy.fromiter(map(id, map(_DTYPE, chunk)), dtype=numpy.uint64, count=count)
        kinds[:, 2] = numpy.fromiter(map(id, map(_SHAPE, chunk)), dtype=numpy.uint64, count=count)
        # one number per kind (wrapping): sorted in 1-D, ten times faster than rows; a collision
        # (two kinds alike) is found below and the rows sorted instead
        mixed = kinds[:, 0] * numpy.uint64(0x9E3779B97F4A7C15) + kinds[:, 1] * numpy.uint64(0xC2B2AE3D27D4EB4F)
        _, first, inverse = numpy.unique(mixed ^ kinds[:, 2], return_index=True, return_inverse=True)
        if not (kinds[first][inverse] == kinds).all():
            _, first, inverse = numpy.unique(kinds, axis=0, return_index=True, return_inverse=True)
        rows = numpy.empty(first.size, dtype=numpy.intp)
        for kind, at in enumerate(first.tolist()):
            entry = chunk[at]
            key = (entry[1], entry[5], entry[6])
            row = self.rows.get(key)
            if row is None:
                template = self.learn(entry)
                row = self.rows[key] = -1 if template is None else self._add(self.templates.derived(template, _frame))
            rows[kind] = row
        if self.stale:
            self.head, self.nbytes, self.tail, self.width = (
                numpy.array([getattr(f, field) for f in self.frames], dtype=numpy.int64)
                for field in ("head", "nbytes", "tail", "width")
            )
            self.stale = False
        out: numpy.ndarray[Any, Any] = rows[inverse.reshape(-1)]
        return out

    def _add(self, frame: _Frame) -> int:
        self.frames.append(frame)
        self.stale = True
        return len(self.frames) - 1


class _ShortFile(Exception):
    """The file ended at ``offset`` before a read was done (it shrank after it was checked)."""

    def __init__(self, offset: int) -> None:
        super().__init__(offset)
        self.offset = offset


def read_scattered(
    file: _File,
    entries: list[Entry],
    learn: Callable[[Entry], Template | None],
    templates: TemplateCache,
    stats: ReadStats,
    cancelled: Callable[[], bool],
) -> list[Entry]:
    """Read ``entries`` (formats/small_reads.Entry, sorted by offset, each inside ``file``: the
    caller checked its size) straight into their tensors; the entries left for the caller to read
    and parse one by one (no template, unlike their template, overlapping another). ``learn``
    gives an entry's template (None: none), reading and parsing that record; ``templates``: the
    read's, which keeps each template's frame.

    Raises:
        CorruptCheckpointError: the file ends early (shrank after its size was checked), naming
            the key and the file.
        OSError: the read failed, naming the file.
    """
    assert file.local is not None and not file.local.direct
    frames = _Frames(learn, templates)
    left: list[Entry] = []
    scratch = numpy.empty(FRAME_BYTES // 8, dtype=numpy.uint64)
    junk = numpy.empty(GAP_BYTES, dtype=numpy.uint8)
    if hasattr(os, "posix_fadvise"):
        # the kernel's read-ahead doubled for this descriptor: cold, the records came 1.2-1.4x
        # sooner and with less CPU (bench: 50,000 small records, same run)
        os.posix_fadvise(file.local.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    first, end = 0, -1  # end: where the previous chunk's records end (an overlap goes to the caller)
    while first < len(entries):
        if cancelled():
            return []
        chunk = entries[first : first + CHUNK_RECORDS]
        length = numpy.fromiter(map(_LENGTH, chunk), dtype=numpy.int64, count=len(chunk))
        ids = frames.ids(chunk, length)
        width = numpy.where(ids >= 0, frames.width[ids] * 8, 0) if frames.frames else numpy.zeros(len(ids))
        fits = int(numpy.searchsorted(numpy.cumsum(width), FRAME_BYTES, side="right"))
        if not fits:  # a frame larger than the scratch (not with these sizes): the caller's windows
            left.append(chunk[0])
            first += 1
            continue
        if fits < len(chunk):
            chunk, ids, length = chunk[:fits], ids[:fits], length[:fits]
        first += len(chunk)
        end = _chunk(file, chunk, ids, length, frames, scratch, junk, end, stats, left)
    return left


def _chunk(
    file: _File,
    chunk: list[Entry],
    ids: numpy.ndarray[Any, Any],
    length: numpy.ndarray[Any, Any],
    frames: _Frames,
    scratch: numpy.ndarray[Any, Any],
    junk: numpy.ndarray[Any, Any],
    end: int,
    stats: ReadStats,
    left: list[Entry],
) -> int:
    """Read one chunk's records with templates (``ids`` >= 0) straight into their tensors, check
    their frames; the rest, and those unlike their template, appended to ``left`` (``length``:
    the records' lengths). Where the chunk's records end."""
    count = len(chunk)
    offset = numpy.fromiter(map(_OFFSET, chunk), dtype=numpy.int64, count=count)
    stop = offset + length
    overlaps = offset[0] < end or bool((offset[1:] < stop[:-1]).any())
    chunk_end = max(end, int(stop.max()))
    if overlaps:  # two records sharing bytes: the caller's windows read them as they are
        left.extend(chunk)
        return chunk_end
    scattered = ids >= 0
    if not scattered.all():
        left.extend(chunk[int(i)] for i in numpy.flatnonzero(~scattered))
    picked = numpy.flatnonzero(scattered)
    if not picked.size:
        return chunk_end
    tid = ids[picked]
    offset, length = offset[picked], length[picked]
    target = numpy.fromiter(map(_ADDRESS, chunk), dtype=numpy.int64, count=count)[picked]
    head, nbytes, tail = frames.head[tid], frames.nbytes[tid], frames.tail[tid]
    # frame rows grouped by template: template t's rows are one block, in file order
    order = numpy.argsort(tid, kind="stable")
    counts = numpy.bincount(tid, minlength=len(frames.frames))
    block = numpy.cumsum(counts * frames.width) - counts * frames.width  # in words
    group = numpy.cumsum(counts) - counts
    sorted_tid = tid[order]
    row = numpy.empty_like(offset)
    row[order] = block[sorted_tid] + (numpy.arange(picked.size) - group[sorted_tid]) * frames.width[sorted_tid]
    row_address = int(scratch.ctypes.data) + row * 8
    # iovecs in file order: gap, head, data, tail of each record (empty ones dropped)
    gap = numpy.zeros_like(offset)
    gap[1:] = offset[1:] - (offset[:-1] + length[:-1])
    gap[gap > GAP_BYTES] = 0  # farther apart: the next record starts a new read
    iov = numpy.empty((picked.size, 4, 2), dtype=numpy.int64)
    iov[:, 0, 0] = int(junk.ctypes.data)
    iov[:, 0, 1] = gap
    iov[:, 1, 0] = row_address
    iov[:, 1, 1] = head
    iov[:, 2, 0] = target
    iov[:, 2, 1] = nbytes
    iov[:, 3, 0] = row_address + head
    iov[:, 3, 1] = tail
    at = numpy.empty((picked.size, 4), dtype=numpy.int64)
    at[:, 0] = offset - gap
    at[:, 1] = offset
    at[:, 2] = offset + head
    at[:, 3] = offset + head + nbytes
    kept = iov[:, :, 1].ravel() > 0
    flat = numpy.ascontiguousarray(iov.reshape(-1, 2)[kept])
    at = at.ravel()[kept]
    sizes = flat[:, 1]
    starts = [0, *(numpy.flatnonzero(at[1:] != at[:-1] + sizes[:-1]) + 1).tolist(), len(flat)]
    try:
        for a, b in itertools.pairwise(starts):
            for c in range(a, b, IOV_MAX):
                _preadv(file, flat[c : min(c + IOV_MAX, b)], int(at[c]))
    except _ShortFile as exc:
        key = chunk[int(picked[max(int(numpy.searchsorted(offset, exc.offset, side="right")) - 1, 0)])][2]
        raise CorruptCheckpointError(
            f"{file.where} ends at byte {exc.offset}, inside the record of {key!r}: the shard is truncated"
        ) from None
    # each template's block, masked, against its frame: a word unlike it, a record unlike its template
    unlike = []
    for t in numpy.flatnonzero(counts).tolist():
        frame = frames.frames[t]
        n, w = int(counts[t]), frame.words.size
        rows = scratch[int(block[t]) : int(block[t]) + n * w].reshape(n, w)
        numpy.bitwise_and(rows, frame.mask, out=rows)  # its words are zero wherever its mask is
        bad = (rows != frame.words).any(axis=1)
        if bad.any():
            unlike.append(order[int(group[t]) + numpy.flatnonzero(bad)])
    good = picked.size
    copied = int(nbytes.sum())
    if unlike:
        which = numpy.sort(numpy.concatenate(unlike))
        left.extend(chunk[int(i)] for i in picked[which])
        good -= which.size
        copied -= int(nbytes[which].sum())
    stats.fast += good
    stats.bytes += copied
    return chunk_end


def _preadv(file: _File, iov: numpy.ndarray[Any, Any], offset: int) -> None:
    """Fill every buffer of ``iov`` (rows of (address, length)) from ``file`` at ``offset``, one
    after the other; a short read goes on where it stopped."""
    assert file.local is not None
    function = preadv_function()
    assert function is not None
    fd = file.local.fd
    while True:
        file.reads += 1
        got = function(fd, iov.ctypes.data, len(iov), offset)
        if got < 0:
            code = ctypes.get_errno()
            if code == errno.EINTR:
                continue
            raise OSError(code, os.strerror(code), str(file.where))
        ends = numpy.cumsum(iov[:, 1])
        if got >= int(ends[-1]):
            return
        if got == 0:
            raise _ShortFile(offset)
        done = int(numpy.searchsorted(ends, got, side="right"))  # buffers read whole
        iov = iov[done:].copy()
        part = got - (int(ends[done - 1]) if done else 0)
        iov[0, 0] += part
        iov[0, 1] -= part
        offset += got
