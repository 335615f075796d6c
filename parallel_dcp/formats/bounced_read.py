"""Whole stored tensors read into fresh memory through the direct reader's huge-page bounce
buffers (storage/direct_read.py), where the kernel gives huge pages; formats/span_read.py reads
them straight into place everywhere else.

    whole tensors (key, file, offset, stored dtype, shape), as formats/span_read plans them
      │ one fresh tensor each (``torch.empty``: its pages faulted in by the copy below)
      ▼
    chunks: each file's bytes from its first tensor on, CHUNK_BYTES at a time (a chunk holds
      the runs of tensors that lie one after the other in it; a key left out ends a run)
      ▼
    threads: each takes the next chunk (neighbours read at once) and reads it with
      ShardFile.read_spans(in_place=False) through the thread's one ShardFile (the one open
      rule; the previous file's closed first, so a thread holds one ring of bounce buffers):
      aligned 1 MiB reads in file order into the ring's huge pages, FLIGHT in flight across
      the threads, each copied out into its tensors (``ctypes.memmove``, without the GIL)

Why a bounce and a copy beat reading in place: this disk (virtio) takes at most 254 segments a
request, so a 1 MiB read into 4 KiB pages reaches it as two requests, and into a 2 MiB page as
one; the copy then faults the fresh pages in from user space, on both cores. The same trade made
a fresh 2 GiB DCP load 1.322 -> 1.019 s (formats/seated.py).

Memory: the tensors' own bytes, and one ring (:func:`~parallel_dcp.storage.direct_read.
direct_read_memory`) per reading thread, both admitted by the caller before any read. Every tensor
is its own allocation (a small tensor holds only its own bytes, as ``load_file`` gives). The
reads are aligned and reach past a tensor's bytes only to the end of its page: never past the
end of the file (a read there comes back short), and a file shorter than its tensors need is an
error before any read.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from parallel_dcp.engine import progress
from parallel_dcp.formats.range_read import check_file_ends, wait_for_readers
from parallel_dcp.storage.direct_read import REQUEST_BYTES, ShardFile, direct_read_memory, huge_pages
from parallel_dcp.storage.io_mode import ALIGN

__all__ = ["CHUNK_BYTES", "bounce_memory", "bounced", "read_bounced"]

# What a reading thread takes at a time: large enough that the drain at a chunk's end (its last
# reads in flight finish before the next chunk's start) is rare, small enough that the threads
# share a file and end together. A multiple of REQUEST_BYTES: each chunk's reads are 1 MiB.
CHUNK_BYTES = 32 * REQUEST_BYTES

Tensor5 = tuple[str, str, int, torch.dtype, tuple[int, ...]]


def bounced(io: str) -> bool:
    """Whether whole tensors read with ``io`` (as asked, or as resolved) go through the bounce
    buffers: where they are in huge pages and the reads may be direct."""
    return io != "buffered" and huge_pages()


def bounce_memory() -> int:
    """The buffers one reading thread holds (its ring)."""
    return direct_read_memory()


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for dim in shape:
        n *= dim
    return n


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


_Chunk = tuple[str, list[tuple[int, list[memoryview]]], int]


def _chunks(tensors: list[Tensor5], out: dict[str, torch.Tensor]) -> list[_Chunk]:
    """Each file's tensors in offset order, cut at CHUNK_BYTES from the file's first tensor (its
    page): (file, runs of (file offset, views), bytes) each, in file order."""
    by_file: dict[str, list[Tensor5]] = {}
    for t in tensors:
        by_file.setdefault(t[1], []).append(t)
    chunks: list[_Chunk] = []
    for file, mine in by_file.items():
        mine.sort(key=lambda t: t[2])
        base = mine[0][2] - mine[0][2] % ALIGN
        windows: dict[int, list[tuple[int, list[memoryview]]]] = {}
        end = -1
        for key, _, offset, _, _ in mine:
            view, at = _bytes_of(out[key]), offset
            while view.nbytes:
                window = (at - base) // CHUNK_BYTES
                n = min(view.nbytes, base + (window + 1) * CHUNK_BYTES - at)
                runs = windows.setdefault(window, [])
                if runs and at == end:  # continues the run before it
                    runs[-1][1].append(view[:n])
                else:
                    runs.append((at, [view[:n]]))
                view, at = view[n:], at + n
                end = at
        for window in sorted(windows):
            runs = windows[window]
            chunks.append((file, runs, sum(v.nbytes for _, views in runs for v in views)))
    return chunks


class _Reader:
    """The chunks, taken in order by every thread from one queue; a thread keeps one ShardFile
    open at a time (the files come in order: it never returns to one it closed)."""

    def __init__(self, chunks: list[_Chunk], io: str) -> None:
        self._next = iter(chunks)
        self._lock = threading.Lock()
        self.io = io
        self.cancel = threading.Event()

    def run(self) -> None:
        shard: ShardFile | None = None
        try:
            while not self.cancel.is_set():
                with self._lock:
                    chunk = next(self._next, None)
                if chunk is None:
                    break
                file, runs, nbytes = chunk
                if shard is None or shard.path != Path(file):
                    if shard is not None:
                        shard.close()  # its ring becomes this thread's spare: the next file takes it
                    shard = None
                    shard = ShardFile(file, io=self.io)
                shard.read_spans(runs, in_place=False)
                progress.report(nbytes)
            progress.flush()
        finally:
            if shard is not None:
                shard.close()


def read_bounced(
    tensors: list[Tensor5], threads: int, io: str, on_tick: Callable[[], None] | None = None
) -> dict[str, torch.Tensor]:
    """A fresh tensor for each of ``tensors`` (key, file, offset, stored dtype, shape; none empty),
    filled from its file by ``threads`` threads through the bounce buffers (``io`` as resolved by
    storage.read_choice; a file read buffered is read by ``preadv`` straight into the tensors).

    Raises:
        CorruptCheckpointError: a file is shorter than its tensors need (before any read), or
            shrank while read.
        UnsafeCheckpointError: a file is a symlink or not a regular file.
    """
    if not tensors:
        return {}
    ends: dict[str, tuple[int, str]] = {}
    for key, file, offset, dtype, shape in tensors:
        end = offset + _nbytes(dtype, shape)
        if end > ends.get(file, (0, ""))[0]:
            ends[file] = (end, key)
    check_file_ends(ends)
    out = {key: torch.empty(shape, dtype=dtype) for key, _, _, dtype, shape in tensors}
    chunks = _chunks(tensors, out)
    reader = _Reader(chunks, io)
    workers = max(1, min(threads, len(chunks)))
    with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="parallel_dcp-read") as pool:
        wait_for_readers({pool.submit(reader.run) for _ in range(workers)}, reader.cancel, on_tick)
    return out
