"""Reading stored tensors into fresh memory laid out as in the file: each read lands where the
tensor lives, with O_DIRECT when the read choice says direct (no bounce buffer, no copy). Where the
direct reader's bounce buffers are in huge pages and the reads are direct, ``load`` reads whole
tensors through them instead (formats/bounced_read.py: one device request per 1 MiB read).

    whole tensors of a file (their stored dtype; no caller's memory to fill)
      │ plan_spans: a tensor of at least OWN_BYTES gets its own span, smaller neighbours share
      │   one (up to SHARED_BYTES); a span covers its tensors' bytes, widened to ALIGN
      ▼
    one allocation per span (plus ALIGN, to start it on a page); the tensors are views of it
      │ requests: each file read as it lies, REQUEST_BYTES of it at a time, across span
      │   boundaries (one preadv, an iovec per span); a page two spans share is read once,
      │   into the first, and copied into the second; a gap (a key left out) starts a new one
      ▼
    threads: each takes the next request (neighbours read at once), one preadv per request
      through the thread's ShardFile of that file (the one open rule) straight into the spans
      (aligned: O_DIRECT takes it as it is); the destination's pages are faulted in by the
      kernel inside that read, on the reading thread

Before requests ran across spans, each span was read on its own: a folder of a 2 GiB model took
488 reads, 195 of them under 1 MiB (one per norm vector, each a device round trip), and every
shared page was read twice. Measured and left out (hfread2 notes): pages faulted in ahead of the
reads by another thread (MADV_POPULATE_WRITE: no gain in fresh processes), and huge pages for the
spans (MADV_HUGEPAGE: 2-3x the CPU and slower in fresh processes, where the kernel must find and
zero each 2 MiB page inside the read).

A span reads at most 2 * ALIGN bytes beyond its tensors (the pages its first and last tensor
share with their neighbours), and holds them: :func:`span_bytes` is what the spans allocate.
Everything else is the destinations' own memory: a reading thread holds no buffer.

The small tensors of a shared span are handed out as copies of their own, one span at a time
(the span is freed once its tensors are copied): a tensor the caller keeps, frees or
passes alone to ``torch.save`` then holds its own bytes, not a 4 MiB block of its neighbours' (what
``load_file`` gives too). :func:`span_bytes` counts that copy's room (one span's bytes).
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from parallel_dcp.engine import progress
from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.formats.range_read import check_file_ends, wait_for_readers
from parallel_dcp.storage.direct_read import ShardFile
from parallel_dcp.storage.io_mode import ALIGN

__all__ = ["OWN_BYTES", "REQUEST_BYTES", "SHARED_BYTES", "Span", "plan_spans", "read_spans", "span_bytes"]

# A tensor this large owns its span (freed with it); smaller ones share a span of neighbours.
OWN_BYTES = 1 << 20
SHARED_BYTES = 4 << 20
# One read. Measured cold on this project's VM disk (virtio, 254 segments a request: a read into
# 4 KiB pages reaches the device as requests of about 1 MiB whatever its size), reads into reused
# buffers: 8 threads x 1 MiB 122% of 2 x 8 MiB, 16 x 1 MiB 114%, 4 x 8 MiB 89% (many large reads
# at once queue dozens of pieces that the device serves out of order); a load with defaults,
# one per fresh process: 8 x 1 MiB 101% of a plain 2 x 8 MiB read, 4 x 8 MiB 93%.
REQUEST_BYTES = 1 << 20
# The most spans one request reads into (one iovec each; IOV_MAX is 1024 on Linux).
_MAX_PARTS = 512


@dataclass(slots=True)
class Span:
    """Bytes ``start``..``start + nbytes`` of ``file`` (both multiples of ALIGN) and the tensors
    whose bytes lie in it: (key, offset in the file, dtype, shape)."""

    file: str
    start: int
    nbytes: int
    tensors: list[tuple[str, int, torch.dtype, tuple[int, ...]]] = field(default_factory=list)
    memory: torch.Tensor | None = None

    @property
    def needed(self) -> int:
        """The file's bytes the span's tensors need end here (the span may reach past the file's
        end: an aligned read there comes back short)."""
        return max(o + _nbytes(d, s) for _, o, d, s in self.tensors)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for dim in shape:
        n *= dim
    return n


def _down(n: int) -> int:
    return n - n % ALIGN


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_spans(tensors: list[tuple[str, str, int, torch.dtype, tuple[int, ...]]]) -> list[Span]:
    """The spans of ``tensors`` (key, file, offset, stored dtype, shape; none empty, each offset a
    multiple of its dtype's size): see the module docstring."""
    by_file: dict[str, list[tuple[str, str, int, torch.dtype, tuple[int, ...]]]] = {}
    for t in tensors:
        by_file.setdefault(t[1], []).append(t)
    spans: list[Span] = []
    for file, mine in by_file.items():
        mine.sort(key=lambda t: t[2])
        shared: Span | None = None
        for key, _, offset, dtype, shape in mine:
            end = offset + _nbytes(dtype, shape)
            if end - offset >= OWN_BYTES:
                spans.append(Span(file, _down(offset), _up(end) - _down(offset), [(key, offset, dtype, shape)]))
                shared = None
                continue
            if shared is None or _up(end) - shared.start > SHARED_BYTES:
                shared = Span(file, _down(offset), 0)
                spans.append(shared)
            shared.tensors.append((key, offset, dtype, shape))
            shared.nbytes = max(shared.nbytes, _up(end) - shared.start)
    return spans


def span_bytes(spans: list[Span]) -> int:
    """What the spans allocate (each ALIGN more than it reads, to start on a page), and the room
    to copy one shared span's tensors out of it (module docstring)."""
    copies = max((s.nbytes for s in spans if _shared(s)), default=0)
    return sum(s.nbytes + ALIGN for s in spans) + copies


def _shared(span: Span) -> bool:
    """A span of small tensors (its tensors are copied out of it: module docstring)."""
    return len(span.tensors) > 1 or _nbytes(*span.tensors[0][2:]) < OWN_BYTES


def _allocate(span: Span) -> torch.Tensor:
    """The span's memory, page-aligned (its pages are first touched by the read that fills them)."""
    raw = torch.empty(span.nbytes + ALIGN, dtype=torch.uint8)
    pad = -raw.data_ptr() % ALIGN
    span.memory = raw[pad : pad + span.nbytes]
    return span.memory


def _views(span: Span) -> dict[str, torch.Tensor]:
    """The span's tensors: views of its memory when it is one large tensor's own, else copies."""
    assert span.memory is not None
    out = {}
    copy = _shared(span)
    for key, offset, dtype, shape in span.tensors:
        at = offset - span.start
        view = span.memory[at : at + _nbytes(dtype, shape)].view(dtype).view(shape)
        out[key] = view.clone() if copy else view
    return out


@dataclass(slots=True)
class _Request:
    """Bytes ``offset``..``offset + nbytes`` of ``file`` (aligned), read by one ``preadv`` into the
    parts' memory, one after the other (span, offset in it, bytes); then ``copies``: a page two
    neighbouring spans both hold, read into the first, copied into the second (source span, offset
    in it, destination span, offset in it, bytes). ``needed``: the bytes up to here are tensor bytes
    (an aligned read may end past the end of the file only beyond them)."""

    file: str
    offset: int
    nbytes: int = 0
    needed: int = 0
    parts: list[tuple[Span, int, int]] = field(default_factory=list)
    copies: list[tuple[Span, int, Span, int, int]] = field(default_factory=list)


def _shared_page(request: _Request | None, span: Span) -> int:
    """How many bytes at the start of ``span`` the end of ``request`` reads already, into the span
    of its last part (0 when none, or when the span does not continue the request)."""
    if request is None or request.file != span.file:
        return 0
    last, at, _ = request.parts[-1]
    overlap = request.offset + request.nbytes - span.start
    return min(overlap, span.nbytes) if overlap > 0 and span.start >= last.start + at else 0


def _requests(spans: list[Span]) -> list[_Request]:
    """The spans of each file, in offset order, read as the file lies: requests of REQUEST_BYTES
    of the file (at most _MAX_PARTS spans each) that run on across span boundaries, so that many
    small spans cost one device request, not one each. A page two spans share is read once and
    copied; a gap between spans (a key left out) starts a new request."""
    out: list[_Request] = []
    request: _Request | None = None
    for span in sorted(spans, key=lambda s: (s.file, s.start)):
        at = _shared_page(request, span)
        if at and request is not None:
            last = request.parts[-1][0]
            request.copies.append((last, span.start - last.start, span, 0, at))
            request.needed = max(request.needed, min(span.start + at, span.needed))
        elif request is None or request.file != span.file or request.offset + request.nbytes != span.start:
            request = None
        while at < span.nbytes:
            if request is None or request.nbytes >= REQUEST_BYTES or len(request.parts) >= _MAX_PARTS:
                request = _Request(span.file, span.start + at)
                out.append(request)
            n = min(span.nbytes - at, REQUEST_BYTES - request.nbytes)
            request.parts.append((span, at, n))
            request.nbytes += n
            request.needed = max(request.needed, min(span.start + at + n, span.needed))
            at += n
    return out


def _address(span: Span, at: int) -> int:
    assert span.memory is not None
    return span.memory.data_ptr() + at


def _read_one(shard: ShardFile, request: _Request) -> None:
    """The request's bytes straight into its spans' memory, then its shared pages copied."""
    views = [
        memoryview((ctypes.c_char * n).from_address(_address(span, at))).cast("B") for span, at, n in request.parts
    ]
    got = shard.read_into(views, request.offset)
    if request.offset + got < request.needed:
        raise CorruptCheckpointError(
            f"{shard.path} ends at byte {request.offset + got}, but its tensors need bytes up to "
            f"{request.needed} (truncated file)"
        )
    for source, source_at, target, target_at, n in request.copies:
        ctypes.memmove(_address(target, target_at), _address(source, source_at), n)
    progress.report(request.nbytes)


class _Reader:
    """The requests, taken in order by every thread from one queue: the threads read neighbouring
    requests of one file at once (measured on a 2-core VM: 6-7% faster cold than a contiguous
    share per thread with direct reads, half the CPU with buffered ones). Each thread keeps one
    ShardFile per file it reads (the one open rule, once)."""

    def __init__(self, requests: list[_Request], io: str) -> None:
        self._next = iter(requests)
        self._lock = threading.Lock()
        self.io = io
        self.cancel = threading.Event()

    def run(self) -> None:
        files: dict[str, ShardFile] = {}
        try:
            while not self.cancel.is_set():
                with self._lock:
                    request = next(self._next, None)
                if request is None:
                    break
                shard = files.get(request.file)
                if shard is None:
                    shard = files[request.file] = ShardFile(request.file, io=self.io)
                _read_one(shard, request)
            progress.flush()
        finally:
            for shard in files.values():
                shard.close()


def _check_sizes(spans: list[Span]) -> None:
    """Every file holds the bytes its tensors need (looked at by the one open rule)."""
    ends: dict[str, tuple[int, str]] = {}
    for span in spans:
        for key, offset, dtype, shape in span.tensors:
            end = offset + _nbytes(dtype, shape)
            if end > ends.get(span.file, (0, ""))[0]:
                ends[span.file] = (end, key)
    check_file_ends(ends)


def read_spans(
    spans: list[Span], threads: int, io: str = "buffered", on_tick: Callable[[], None] | None = None
) -> dict[str, torch.Tensor]:
    """Allocate every span, read it with ``threads`` threads (``io`` as resolved by
    storage.read_choice), and return its tensors (views of the span's memory).

    Raises:
        CorruptCheckpointError: a file is shorter than its tensors need (before any of its
            bytes are read), or shrank while read.
        UnsafeCheckpointError: a file is a symlink or not a regular file.
    """
    if not spans:
        return {}
    _check_sizes(spans)
    for span in spans:
        _allocate(span)
    requests = _requests(spans)
    reader = _Reader(requests, io)
    workers = max(1, min(threads, len(requests)))
    with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="parallel_dcp-read") as pool:
        wait_for_readers({pool.submit(reader.run) for _ in range(workers)}, reader.cancel, on_tick)
    out: dict[str, torch.Tensor] = {}
    for span in spans:
        out |= _views(span)
        span.memory = None
    return out
