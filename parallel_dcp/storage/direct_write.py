"""A new file written with O_DIRECT: bytes packed into page-aligned buffers, several writes in flight.

    write(bytes) ──copy──▶ buffer k (8 MiB, mmap: page-aligned) ── full ──▶ pwrite by an I/O thread
                           buffer k+1 fills meanwhile                       (up to DEPTH-1 in flight)
    close: the tail padded to a 4096 multiple, written, and the file truncated to its true size

The bytes are those a buffered write gives (records back to back, unchanged); only the way they
reach the device differs. Each byte is copied once, into the aligned buffer, where a buffered
``write`` copies it once into the page cache; the device then reads the buffer by DMA and no page
of the file stays in the cache. A failed write (ENOSPC, EIO, EFBIG) is raised by the next
``write``/``flush``/``close`` as the OSError the file system gave.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy

from parallel_dcp.storage.io_mode import ALIGN
from parallel_dcp.storage.safe_files import create_new, open_directory

__all__ = [
    "BUFFER_BYTES",
    "DEPTH",
    "FILL_PIECE_BYTES",
    "MEMMOVE_BYTES",
    "DirectFile",
    "address",
    "direct_write_memory",
    "keep_buffers",
    "kept_buffers",
    "kept_buffers_fit",
    "new_file",
]

# Large enough that the device sees big requests, small enough that DEPTH of them stay cheap.
BUFFER_BYTES = 8 << 20
# Buffers per file: one filling while DEPTH - 1 are being written.
DEPTH = 4


# Beside its buffers a direct file holds DEPTH - 1 I/O threads: up to 0.17 MiB measured.
_THREADS_BYTES = 1 << 20


def direct_write_memory(nbytes: int | None = None) -> int:
    """What a direct file holds: its I/O threads and the aligned buffers a file of ``nbytes`` fills (None: all)."""
    filled = DEPTH if nbytes is None else min(DEPTH, -(-(nbytes + ALIGN) // BUFFER_BYTES))
    return BUFFER_BYTES * filled + _THREADS_BYTES


# A fill copies and hashes this much at a time (cache-sized: hashed before it leaves the cache).
FILL_PIECE_BYTES = 1024 * 1024

# Copies at least this large go through memmove (no GIL); smaller ones through the buffer protocol.
MEMMOVE_BYTES = 256 << 10


def address(view: memoryview) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers too)."""
    return int(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data)


# Buffers of finished files this process keeps for its next file (see keep_buffers).
_spare: list[mmap.mmap] = []
_spare_lock = threading.Lock()
_keep = 0


def keep_buffers(count: int) -> None:
    """Keep up to ``count`` buffers of finished files for the next files this process writes
    (default 0: none). A worker that lives on between saves (a ``parallel_dcp.Saver``'s) sets it
    to :data:`DEPTH`: its files then fill pages already there, not fresh ones that fault in one
    at a time (8 MiB a buffer), at the price of holding them while idle. 0 unmaps the kept ones."""
    global _keep
    with _spare_lock:
        _keep = count
        while len(_spare) > count:
            _spare.pop().close()


def kept_buffers_fit(limit: int, workers: int) -> bool:
    """Whether ``workers`` may each keep DEPTH buffers between files under ``limit`` (all: 1/4 of it at most)."""
    return 4 * workers * DEPTH * BUFFER_BYTES <= limit


def kept_buffers() -> int:
    """How many buffers this process keeps now."""
    return len(_spare)


def _take(size: int) -> mmap.mmap:
    with _spare_lock:
        if size == BUFFER_BYTES and _spare:
            return _spare.pop()
    return mmap.mmap(-1, size)


def _give(buffer: mmap.mmap) -> bool:
    """Keep ``buffer`` for the next file; False when it is not kept (the caller unmaps it)."""
    with _spare_lock:
        if len(buffer) != BUFFER_BYTES or len(_spare) >= _keep:
            return False
        _spare.append(buffer)
        return True


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        if written <= 0:  # pragma: no cover - a file system that accepts nothing without an error
            raise OSError(28, os.strerror(28))
        offset += written
        view = view[written:]


class DirectFile:
    """A writable stream over ``fd`` (opened with O_DIRECT, at offset 0, by the caller, who keeps
    ownership of the descriptor).

    ``write`` copies into the current aligned buffer; a full buffer is handed to an I/O thread.
    ``flush`` writes everything so far, the tail padded and the file truncated back to its size
    (it may be called again after more writes: the partial buffer stays and is rewritten).
    """

    def __init__(self, fd: int, *, buffer_bytes: int | None = None, depth: int | None = None) -> None:
        buffer_bytes = BUFFER_BYTES if buffer_bytes is None else buffer_bytes
        depth = DEPTH if depth is None else depth
        if buffer_bytes % ALIGN or depth < 2:
            raise ValueError("buffer_bytes must be a multiple of 4096 and depth >= 2")
        self._fd = fd
        self._size = buffer_bytes
        self._buffers = [_take(buffer_bytes) for _ in range(depth)]
        self._views = [memoryview(b) for b in self._buffers]
        self._addresses = [address(v) for v in self._views]
        self._free: deque[int] = deque(range(1, depth))
        self._pending: deque[tuple[Future[None], int]] = deque()
        self._pool = ThreadPoolExecutor(depth - 1, thread_name_prefix="pdcp-direct")
        self._current = 0
        self._fill = 0
        self._start = 0  # file offset of the current buffer's first byte
        self._error: BaseException | None = None
        self._closed = False
        self._flushed = -1  # the size the file had at the last flush

    # -- the stream interface torch's zip writer and the shard writer use --

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = view.nbytes
        if self._error is not None:
            raise self._error
        # Large pieces are copied by memmove, which runs without the GIL: the writer threads of a
        # save (engine/threads.py) then copy in parallel.
        source = address(view) if total >= MEMMOVE_BYTES else None
        done = 0
        while done < total:
            n = min(self._size - self._fill, total - done)
            if source is not None:
                ctypes.memmove(self._addresses[self._current] + self._fill, source + done, n)
            else:
                self._views[self._current][self._fill : self._fill + n] = view[done : done + n]
            self._fill += n
            done += n
            if self._fill == self._size:
                self._submit()
        return total

    def write_filled(
        self, nbytes: int, fill: Callable[[int, int, int], None], done: Callable[[memoryview], None]
    ) -> None:
        """Write ``nbytes`` that ``fill(offset, n, address)`` copies straight into the aligned
        buffers (no copy of ours), :data:`FILL_PIECE_BYTES` at a time; ``done`` sees each piece
        where it landed, right after it is filled (the caller hashes it there)."""
        if self._error is not None:
            raise self._error
        offset = 0
        while offset < nbytes:
            n = min(self._size - self._fill, nbytes - offset, FILL_PIECE_BYTES)
            fill(offset, n, self._addresses[self._current] + self._fill)
            with self._views[self._current][self._fill : self._fill + n] as piece:
                done(piece)
            self._fill += n
            offset += n
            if self._fill == self._size:
                self._submit()

    def tell(self) -> int:
        return self._start + self._fill

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        """Everything written so far on the device, the file exactly :meth:`tell` bytes long."""
        if self._flushed == self.tell() and not self._pending:
            return
        self._drain()
        if self._fill:
            padded = -(-self._fill // ALIGN) * ALIGN
            buffer = self._views[self._current]
            buffer[self._fill : padded] = bytes(padded - self._fill)
            _pwrite_all(self._fd, buffer[:padded], self._start)
        os.ftruncate(self._fd, self.tell())
        self._flushed = self.tell()

    def fileno(self) -> int:
        self.flush()  # whoever asks for the descriptor (os.fsync) must find every byte written
        return self._fd

    def close(self) -> None:
        """Flush and release the buffers (not the descriptor)."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self.abort()

    def abort(self) -> None:
        """Stop without writing the rest (after a failure); waits for writes in flight."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._pending.clear()
        for view in self._views:
            view.release()
        for buffer in self._buffers:
            if self._error is None and _give(buffer):
                continue
            # A failed write's traceback may still hold a slice of its buffer: that buffer is
            # then unmapped when the traceback goes, not here.
            with contextlib.suppress(BufferError):
                buffer.close()

    # -- the queue --

    def _submit(self) -> None:
        index, start = self._current, self._start
        future = self._pool.submit(_pwrite_all, self._fd, self._views[index], start)
        self._pending.append((future, index))
        self._start += self._size
        self._fill = 0
        if not self._free:
            self._wait_oldest()
        self._current = self._free.popleft()

    def _wait_oldest(self) -> None:
        future, index = self._pending.popleft()
        try:
            future.result()
        except BaseException as exc:
            self._error = exc
            raise
        self._free.append(index)

    def _drain(self) -> None:
        while self._pending:
            self._wait_oldest()
        if self._error is not None:
            raise self._error


@contextmanager
def new_file(path: str | os.PathLike[str], *, direct: bool, buffering: int = -1) -> Iterator[Any]:
    """A stream writing the new file ``path`` (created with O_EXCL|O_NOFOLLOW relative to its
    directory: a name planted there, a symlink included, is FileExistsError, never written
    through): a :class:`DirectFile` when ``direct``, else a buffered binary file. Everything
    written is on the file system when the block ends without an exception."""
    directory = open_directory(os.path.dirname(os.path.abspath(path)))
    try:
        flags = os.O_WRONLY | (os.O_DIRECT if direct else 0)
        fd = create_new(directory, os.path.basename(path), flags=flags, mode=0o666)  # the umask applies
    finally:
        os.close(directory)
    if not direct:
        with open(fd, "wb", buffering=buffering) as stream:
            yield stream
        return
    direct_file = DirectFile(fd)
    try:
        yield direct_file
        direct_file.flush()
    finally:
        direct_file.abort()
        os.close(fd)
