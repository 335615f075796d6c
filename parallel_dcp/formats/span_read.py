"""Reading stored tensors into fresh memory laid out as in the file: each read lands where the
tensor lives, with O_DIRECT when the read choice says direct (no bounce buffer, no copy).

    whole tensors of a file (their stored dtype; no caller's memory to fill)
      │ plan_spans: a tensor of at least OWN_BYTES gets its own span, smaller neighbours share
      │   one (up to SHARED_BYTES); a span covers its tensors' bytes, widened to ALIGN
      ▼
    one allocation per span (plus ALIGN, to start it on a page); the tensors are views of it
      │ cut into requests of REQUEST_BYTES, grouped into runs of neighbouring requests of
      │ one file (about 4 a thread, largest first: buffered read-ahead stays sequential)
      ▼
    threads: each run through one ShardFile (the one open rule), one preadv per request
      straight into the span (aligned: O_DIRECT takes it as it is); the pages of the
      destination are faulted in by the kernel inside that read, on the reading thread

A span reads at most 2 * ALIGN bytes beyond its tensors (the pages its first and last tensor
share with their neighbours), and holds them: :func:`span_bytes` is what the spans allocate.
Everything else is the destinations' own memory: a reading thread holds no buffer.
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
from parallel_dcp.storage.direct_read import ShardFile
from parallel_dcp.storage.io_mode import ALIGN
from parallel_dcp.storage.safe_files import regular_size

__all__ = ["OWN_BYTES", "REQUEST_BYTES", "SHARED_BYTES", "Span", "plan_spans", "read_spans", "span_bytes"]

# A tensor this large owns its span (freed with it); smaller ones share a span of neighbours.
OWN_BYTES = 1 << 20
SHARED_BYTES = 4 << 20
# One read: large enough for the device's full rate, small enough that the threads share a file.
REQUEST_BYTES = 8 << 20
_TICK_S = 0.1


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
    """What the spans allocate (each ALIGN more than it reads, to start on a page)."""
    return sum(s.nbytes + ALIGN for s in spans)


def _allocate(span: Span) -> torch.Tensor:
    """The span's memory, page-aligned (its pages are first touched by the read that fills them)."""
    raw = torch.empty(span.nbytes + ALIGN, dtype=torch.uint8)
    pad = -raw.data_ptr() % ALIGN
    span.memory = raw[pad : pad + span.nbytes]
    return span.memory


def _views(span: Span) -> dict[str, torch.Tensor]:
    assert span.memory is not None
    out = {}
    for key, offset, dtype, shape in span.tensors:
        at = offset - span.start
        out[key] = span.memory[at : at + _nbytes(dtype, shape)].view(dtype).view(shape)
    return out


@dataclass(slots=True)
class _Run:
    """Neighbouring requests of one file, read in order by one thread: (span, offset in it, bytes)."""

    file: str
    requests: list[tuple[Span, int, int]]

    def work(self) -> int:
        return sum(n for *_, n in self.requests)

    def run(self, io: str, cancel: threading.Event) -> None:
        shard = ShardFile(self.file, io=io)
        try:
            for span, at, length in self.requests:
                if cancel.is_set():
                    return
                assert span.memory is not None
                address = span.memory.data_ptr() + at
                view = memoryview((ctypes.c_char * length).from_address(address)).cast("B")
                got, position = 0, span.start + at
                while got < length:
                    n = shard.read_into(view[got:], position + got)
                    got += max(n, 0)
                    if n <= 0 or n % ALIGN:  # the end of the file (an aligned read past it comes back short)
                        break
                if position + got < min(span.needed, position + length):
                    raise CorruptCheckpointError(
                        f"{self.file} ends at byte {position + got}, but its tensors need bytes up to "
                        f"{span.needed} (truncated file)"
                    )
                progress.report(length)
            progress.flush()
        finally:
            shard.close()


def _runs(spans: list[Span], threads: int) -> list[_Run]:
    requests: dict[str, list[tuple[Span, int, int]]] = {}
    for span in sorted(spans, key=lambda s: s.start):
        mine = requests.setdefault(span.file, [])
        mine += [(span, at, min(REQUEST_BYTES, span.nbytes - at)) for at in range(0, span.nbytes, REQUEST_BYTES)]
    share = max(sum(s.nbytes for s in spans) // (4 * threads), REQUEST_BYTES)
    runs: list[_Run] = []
    for file, mine in requests.items():
        current: list[tuple[Span, int, int]] = []
        size = 0
        for request in mine:
            if current and size + request[2] > share:
                runs.append(_Run(file, current))
                current, size = [], 0
            current.append(request)
            size += request[2]
        if current:
            runs.append(_Run(file, current))
    return sorted(runs, key=lambda r: -r.work())


def _check_sizes(spans: list[Span]) -> None:
    """Every file holds the bytes its tensors need (looked at by the one open rule)."""
    ends: dict[str, int] = {}
    for span in spans:
        ends[span.file] = max(ends.get(span.file, 0), span.needed)
    for file, end in ends.items():
        size = regular_size(file)
        if end > size:
            raise CorruptCheckpointError(
                f"{file} has {size} bytes but its tensors need bytes up to {end} (truncated file)"
            )


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
    runs = _runs(spans, threads)
    cancel = threading.Event()
    with cf.ThreadPoolExecutor(max_workers=min(threads, len(runs)), thread_name_prefix="parallel_dcp-read") as pool:
        pending = {pool.submit(run.run, io, cancel) for run in runs}
        try:
            while pending:
                done, pending = cf.wait(pending, timeout=_TICK_S, return_when=cf.FIRST_EXCEPTION)
                for future in done:
                    future.result()
                if on_tick is not None:
                    on_tick()
        except BaseException:
            cancel.set()
            for future in pending:
                future.cancel()
            raise
    out: dict[str, torch.Tensor] = {}
    for span in spans:
        out |= _views(span)
        span.memory = None
    return out
