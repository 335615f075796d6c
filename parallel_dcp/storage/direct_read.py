"""A shard opened for reading: never through a symlink, regular files only, O_DIRECT when asked.

Buffered: ``preadv`` straight into the destination buffers. Direct (:meth:`ShardFile.read`): the
span is read in aligned requests of :data:`REQUEST_BYTES` (1 MiB) by helper threads, :data:`FLIGHT`
in flight per process, shared by the reading threads reading at the moment (the readers of
:mod:`parallel_dcp.formats.fast_read` run several such threads; one left alone keeps them all).
The whole pages of a destination whose memory is aligned as the file (address and file offset
equal modulo ALIGN: a fresh load target is placed so, formats/seated.py) are read straight into
it; its partial first and last pages, and destinations aligned otherwise (the caller's tensors),
go through a ring of DEPTH bounce buffers in huge pages (one device request per read) and are
copied out. :meth:`ShardFile.read_spans` reads separate spans (a unit's record heads and tails)
with their reads in flight together. No page of the shard enters the page cache.

Before, every byte went through 4 MiB bounce buffers: a cold 2 GiB DCP load spent about 0.3 s of
CPU on the copies and on faulting in the fresh destinations from user space, and reached 69% of a
plain direct read of its shards where the file reader (formats/span_read.py), reading 1 MiB
straight into place, reached 95%.

A file that vanished (the checkpoint was replaced or removed while it was read) and a file shorter
than ``.metadata`` says are :class:`~parallel_dcp.errors.CorruptCheckpointError`, never a raw OSError.

Longer than 300 lines because the direct pipeline (the bounce ring and its slots, the reads in
flight shared across reading threads, the whole-file stream) is one piece of state per open shard.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import ctypes
import errno
import fcntl
import functools
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.storage.direct_jobs import Job, plan_direct
from parallel_dcp.storage.direct_write import MEMMOVE_BYTES, address
from parallel_dcp.storage.io_mode import ALIGN, uses_direct
from parallel_dcp.storage.pinned_paths import open_source
from parallel_dcp.storage.safe_files import vanished

__all__ = ["DEPTH", "PIECE_BYTES", "REQUEST_BYTES", "ShardFile", "direct_read_memory", "huge_pages", "vanished"]

PIECE_BYTES = 4 << 20
# One direct read of :meth:`ShardFile.read` (at most PIECE_BYTES, its buffers' size): this disk
# splits every read into ~1 MiB requests anyway, and serves 8 reads x 1 MiB in flight better than
# 2 x 8 MiB (formats/span_read.py; dcpread3 notes: a DCP load 1.52 s at 4 MiB, ...).
REQUEST_BYTES = 1 << 20
# Bounce buffers per reading thread (PIECE_BYTES each: :meth:`ShardFile.stream` reads whole
# pieces; a direct read cuts them into slots of REQUEST_BYTES).
DEPTH = 4
# Direct reads this process keeps in flight (in place or into a slot), shared by the reading
# threads that are reading at the moment: each keeps its share (FLIGHT // readers), and one left
# alone (the others between units, reading record heads, or done) keeps all of them, up to its
# DEPTH * PIECE_BYTES // REQUEST_BYTES slots for bounced reads. Before, each kept 4 whatever the
# others did: the last unit of a load ran with half the reads in flight. 8 x 1 MiB is what this
# disk serves best (16 took 6-7% longer in 6 of 7 interleaved rounds, both writers' checkpoints).
FLIGHT = 8
_readers = [0]
_readers_lock = threading.Lock()


def _forked() -> None:
    global _readers_lock
    _readers[0] = 0  # the parent's reading threads do not exist in a forked child
    _readers_lock = threading.Lock()


os.register_at_fork(after_in_child=_forked)
_pools: dict[int, cf.ThreadPoolExecutor] = {}


def _prefetcher() -> cf.ThreadPoolExecutor:
    """This process's read-ahead threads (a forked worker gets its own: the parent's threads do
    not exist in it, and an executor inherited through fork would wait on them forever)."""
    pid = os.getpid()
    if pid not in _pools:
        _pools.clear()
        _pools[pid] = cf.ThreadPoolExecutor(max_workers=2 * FLIGHT, thread_name_prefix="pdcp-direct-read")
    return _pools[pid]


_spare = threading.local()


def _take_buffers() -> list[mmap.mmap]:
    """:data:`DEPTH` aligned bounce buffers: this thread's spare ring when it has one (a reading
    thread reads unit after unit, and fresh buffers cost thousands of page faults each time,
    several ms on a VM), else new ones, populated in one call."""
    pair: list[mmap.mmap] | None = getattr(_spare, "pair", None)
    if pair is not None:
        _spare.pair = None
        return pair
    return [_huge_buffer(PIECE_BYTES) for _ in range(DEPTH)]


@functools.cache
def huge_pages() -> bool:
    """Whether this kernel gives transparent huge pages to a buffer that asks (``MADV_HUGEPAGE``)."""
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in setting


def _huge_buffer(nbytes: int) -> mmap.mmap:
    """An aligned buffer in huge pages where the kernel gives them (``MADV_HUGEPAGE``), populated.

    A direct read is one device request only as far as its memory is physically contiguous: this
    disk (virtio) takes at most 254 segments a request, so a 1 MiB read into 4 KiB pages went out
    as two requests (1016 KiB and 8 KiB), and a plain 8 MiB read that happened to land in
    contiguous pages went out in 4 MiB requests and ran up to 1.6x faster. In 2 MiB pages each
    read is one request: a cold 2 GiB ``load(into=)`` took 0.91 s against 1.16 s (medians of 5,
    interleaved; the plain direct read of the same shards 1.24 s in that run)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(-1, nbytes, flags=flags)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # no transparent huge pages here: 4 KiB pages, as before
        buffer.madvise(advice)
    # Faulted in now (in huge pages where given), not by the first read: one byte written a page,
    # so no temporary of the buffer's size exists (admission counts the buffers alone).
    buffer[:: mmap.PAGESIZE] = bytes(len(range(0, nbytes, mmap.PAGESIZE)))
    return buffer


def _give_back(pair: list[mmap.mmap]) -> None:
    """Keep ``pair`` as this thread's spare: only on a helper thread (the reading threads, which end
    with their job, so nothing outlives it) that holds none; else free it."""
    if threading.current_thread() is not threading.main_thread() and getattr(_spare, "pair", None) is None:
        _spare.pair = pair
        return
    for buffer in pair:
        buffer.close()


def _slot_bytes() -> int:
    """One direct read's most bytes: a slot of the bounce buffers."""
    return min(REQUEST_BYTES, PIECE_BYTES)


def direct_read_memory() -> int:
    """The aligned buffers one reading thread holds for direct reads."""
    return DEPTH * PIECE_BYTES


class ShardFile:
    """One shard file open for reading (local files only)."""

    def __init__(self, path: str | os.PathLike[str], *, io: str = "buffered") -> None:
        """``io`` as resolved by :func:`~parallel_dcp.storage.io_mode.resolve_io` for the source:
        ``"auto"`` reads files of at least ``DIRECT_MIN_BYTES`` with O_DIRECT."""
        self.path = Path(path)
        self._buffers: list[mmap.mmap] = []
        self._pending: cf.Future[int] | None = None
        self.fd = -1
        try:
            self.fd = open_source(self.path)
        except FileNotFoundError:
            raise vanished(self.path) from None
        self.size = os.fstat(self.fd).st_size
        self.direct = uses_direct(io, self.size)
        if self.direct:
            try:
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    os.close(self.fd)
                    raise
                self.direct = False  # this file system refuses O_DIRECT after all: read it buffered

    def close(self) -> None:
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self._pending.result()
            self._pending = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._buffers:
            _give_back(self._buffers)
        self._buffers = []

    def prepare(self) -> None:
        """Set up what a direct read needs (the bounce buffers, the read-ahead thread) now rather
        than on the first read; nothing for a buffered one."""
        if self.direct and not self._buffers:
            self._buffers = _take_buffers()
            _prefetcher().submit(int).result()

    def _truncated(self, offset: int) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.path} ends at byte {offset}: the shard is truncated")

    def read(self, offset: int, views: list[memoryview]) -> None:
        """Fill ``views``, one after the other, from the file's bytes at ``offset``."""
        if self.direct:
            self._read_direct(offset, views)
            return
        while views:
            got = os.preadv(self.fd, views, offset)
            if got <= 0:
                raise self._truncated(offset)
            offset += got
            while views and got >= views[0].nbytes:
                got -= views[0].nbytes
                views = views[1:]
            if views and got:
                views = [views[0][got:], *views[1:]]

    def read_into(self, views: list[memoryview], offset: int) -> int:
        """The file's bytes from ``offset`` straight into ``views``, one after the other (no bounce
        buffer: with O_DIRECT the caller aligns ``offset`` and every view's address and length to
        ALIGN), until they are full or the file ends; the bytes read (fewer only at the end of the
        file)."""
        got = 0
        while views:
            n = os.preadv(self.fd, views, offset + got)
            if n <= 0:
                break
            got += n
            while views and n >= views[0].nbytes:
                n -= views[0].nbytes
                views = views[1:]
            if views and n:
                if n % ALIGN:  # an unaligned count ends a direct read: the end of the file
                    break
                views = [views[0][n:], *views[1:]]
        return got

    def stream(self) -> Iterator[memoryview]:
        """The whole file, in order, in pieces of up to :data:`PIECE_BYTES` (direct: straight from
        the aligned buffers, the next piece read meanwhile). Each view is valid until the next.

        Raises:
            CorruptCheckpointError: the file ends before the size it had when it was opened.
        """
        if not self.direct:
            buffer = memoryview(bytearray(min(PIECE_BYTES, max(self.size, 1))))
            at = 0
            while at < self.size:
                got = os.preadv(self.fd, [buffer[: min(buffer.nbytes, self.size - at)]], at)
                if got <= 0:
                    raise self._truncated(at)
                yield buffer[:got]
                at += got
            return
        if not self._buffers:
            self._buffers = _take_buffers()
        at, index = 0, 0
        pending = _prefetcher().submit(self._pread_piece, 0, 0, PIECE_BYTES) if self.size else None
        while pending is not None:
            got = pending.result()
            if got <= 0 or (got < PIECE_BYTES and at + got < self.size):
                raise self._truncated(at + max(got, 0))
            following = at + got < self.size
            pending = _prefetcher().submit(self._pread_piece, 1 - index, at + got, PIECE_BYTES) if following else None
            self._pending = pending  # close() waits for it: its buffer cannot go while it is read into
            view = memoryview(self._buffers[index])[: min(got, self.size - at)]
            try:
                yield view
            finally:
                view.release()
            at, index = at + got, 1 - index

    def read_spans(self, spans: list[tuple[int, list[memoryview]]], *, in_place: bool = True) -> None:
        """Fill several separate spans ((file offset, views) each, as :meth:`read`), their reads in
        flight together (DEPTH at a time) rather than one after the other: a unit's record heads
        and tails lie one per record across the file, and read one at a time a reading thread had a
        single read in flight for each (formats/read_units.py). ``in_place=False`` (direct): every
        byte through the bounce buffers, none straight into a view (storage/direct_jobs.py)."""
        if self.direct:
            most = _slot_bytes()
            jobs = [
                job for at, views in spans for job in plan_direct(at, [v for v in views if v], most, in_place=in_place)
            ]
            self._run_jobs(jobs)
            return
        if len(spans) < 2:
            for at, views in spans:
                self.read(at, views)
            return
        flight: collections.deque[cf.Future[None]] = collections.deque()
        try:
            for at, views in spans:
                if len(flight) == DEPTH:
                    flight.popleft().result()
                flight.append(_prefetcher().submit(self.read, at, views))
            while flight:
                flight.popleft().result()
        finally:
            for read in flight:  # nothing is read into the views once this returns
                with contextlib.suppress(Exception):
                    read.result()

    def _read_direct(self, offset: int, views: list[memoryview]) -> None:
        self._run_jobs(plan_direct(offset, [v for v in views if v.nbytes], _slot_bytes()))

    def _run_jobs(self, jobs: list[Job]) -> None:
        """Run ``jobs`` (aligned reads, storage/direct_jobs.py), DEPTH in flight."""
        if not jobs:
            return
        if not self._buffers:
            self._buffers = _take_buffers()
        free = list(range(len(self._buffers) * (PIECE_BYTES // _slot_bytes())))
        flight: collections.deque[tuple[Job, int, cf.Future[int]]] = collections.deque()
        with _readers_lock:
            _readers[0] += 1
        try:
            for job in jobs:
                while len(flight) >= max(1, FLIGHT // _readers[0]) or (job.into is None and not free):
                    self._finish(*flight.popleft(), free)
                index = free.pop() if job.into is None else -1
                if job.into is None:
                    read = _prefetcher().submit(self._pread, index, job.at, job.length)
                else:
                    read = _prefetcher().submit(self._pread_to, job.into, job.at, job.length)
                flight.append((job, index, read))
            while flight:
                self._finish(*flight.popleft(), free)
        finally:
            with _readers_lock:
                _readers[0] -= 1
            for _, _, read in flight:  # the reads ahead finish before their buffers can be released
                with contextlib.suppress(Exception):
                    read.result()

    def _finish(self, job: Job, index: int, read: cf.Future[int], free: list[int]) -> None:
        """Wait for ``job``'s read; copy a bounced one out of slot ``index``, then free it."""
        got = read.result()
        if job.at + got < job.needed:
            raise self._truncated(job.at + got)
        if job.into is not None:
            return
        buffer = self._slot(index)
        base = address(buffer)
        try:
            for position, view in job.parts:
                n, at = view.nbytes, position - job.at
                if n >= MEMMOVE_BYTES:  # without the GIL: the reading threads copy in parallel
                    ctypes.memmove(address(view), base + at, n)
                else:
                    view[:] = buffer[at : at + n]
        finally:
            buffer.release()
        free.append(index)

    def _pread_to(self, into: memoryview, at: int, length: int) -> int:
        """The file's bytes at ``at`` straight into ``into`` (aligned, as O_DIRECT needs)."""
        got = 0
        while got < length:
            n = os.preadv(self.fd, [into[got:length]], at + got)
            got += max(n, 0)
            if n <= 0 or n % ALIGN:  # the end of the file
                break
        return got

    def _slot(self, index: int) -> memoryview:
        """Slot ``index`` of the bounce buffers: REQUEST_BYTES of one of them."""
        size = _slot_bytes()
        per = PIECE_BYTES // size
        start = index % per * size
        return memoryview(self._buffers[index // per])[start : start + size]

    def _pread(self, index: int, at: int, length: int) -> int:
        view = self._slot(index)
        try:
            return self._pread_to(view, at, length)
        finally:
            view.release()

    def _pread_piece(self, index: int, at: int, length: int) -> int:
        view = memoryview(self._buffers[index])
        try:
            return self._pread_to(view, at, length)
        finally:
            view.release()
