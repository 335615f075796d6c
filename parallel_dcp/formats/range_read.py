"""Reading tensors that lie in files as plain row-major bytes (safetensors, torch.save records)
straight into their destination tensors, with a pool of threads.

    pieces: (file, byte offset, rows of a destination region), each at most PIECE_BYTES
      │ grouped by file, in offset order, cut into about 4 shares per thread (largest first)
      ▼
    threads: one ShardFile per share (the one open rule; O_DIRECT through aligned buffers or
      preadv, as io says), neighbouring pieces in one read
      │ a dense destination of the stored dtype: its own memory is the read buffer (no copy)
      │ any other (another dtype, strided): read into the thread's staging buffer, then copied
      ▼
    done; a file shorter than its tensors need is refused before any of its bytes are read

Each thread holds at most one staging buffer of :func:`staging_bytes` (only when some destination
needs one); everything else is the destinations' own memory.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from parallel_dcp.engine import progress
from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.storage.direct_read import ShardFile
from parallel_dcp.storage.safe_files import regular_size

__all__ = [
    "PIECE_BYTES",
    "Piece",
    "RawRange",
    "check_file_ends",
    "pieces_of",
    "read_pieces",
    "region_pieces",
    "staging_bytes",
    "wait_for_readers",
]

PIECE_BYTES = 32 << 20
# preadv takes at most IOV_MAX (1024) buffers per call.
_MAX_VIEWS = 512
_TICK_S = 0.1


@dataclass(frozen=True, slots=True)
class RawRange:
    """Where a tensor's row-major bytes lie (a source's ``raw_ranges()``): its ``nbytes`` from
    ``offset`` of the local ``file``."""

    file: str
    offset: int


@dataclass(slots=True)
class Piece:
    """``nbytes`` bytes of ``file`` from ``offset``: the stored ``dtype`` elements of ``region``
    (a view of the destination, in row-major order)."""

    key: str
    file: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    region: torch.Tensor
    # Whole stored rows of which ``region`` takes a part (a region that is not whole rows): their
    # shape, and the (offset, length) taken along each later dimension.
    rows: tuple[int, ...] | None = None
    columns: tuple[tuple[int, int], ...] = ()

    @property
    def in_place(self) -> bool:
        """The region's memory can take the file's bytes as they are."""
        r = self.region
        return self.rows is None and r.dtype == self.dtype and r.device.type == "cpu" and r.is_contiguous()

    def fill(self, raw: torch.Tensor) -> None:
        """Copy (and cast) the piece's bytes, read into ``raw``, into its region."""
        data = raw.view(self.dtype)
        if self.rows is None:
            self.region.copy_(data.view(self.region.shape))
            return
        data = data.view(self.rows)
        for dim, (offset, length) in enumerate(self.columns, start=1):
            data = data.narrow(dim, offset, length)
        self.region.copy_(data)


def pieces_of(key: str, file: str, offset: int, dtype: torch.dtype, target: torch.Tensor) -> list[Piece]:
    """The pieces of a whole stored tensor (``target``'s shape) at ``offset`` of ``file``: row
    ranges along the first dimension of at most PIECE_BYTES (a single row may be larger)."""
    nbytes = target.numel() * dtype.itemsize
    if target.dim() == 0 or nbytes <= PIECE_BYTES:
        return [Piece(key, file, offset, nbytes, dtype, target)]
    rows = target.shape[0]
    row = nbytes // rows
    step = max(1, PIECE_BYTES // max(row, 1))
    return [
        Piece(key, file, offset + start * row, (stop - start) * row, dtype, target.narrow(0, start, stop - start))
        for start in range(0, rows, step)
        for stop in [min(rows, start + step)]
    ]


def region_pieces(
    key: str,
    file: str,
    offset: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    start: tuple[int, ...],
    target: torch.Tensor,
) -> list[Piece]:
    """The pieces of the region of a stored tensor (``shape``, at ``offset`` of ``file``) that
    starts at ``start`` and has ``target``'s shape, when it is not whole rows: the stored rows it
    spans, at most PIECE_BYTES of them a piece (a single row may be larger), each read into a
    staging buffer and the region's part copied out. No piece reads beyond the region's rows."""
    row = dtype.itemsize
    for dim in shape[1:]:
        row *= dim
    rows = target.shape[0]
    step = max(1, PIECE_BYTES // max(row, 1))
    columns = tuple(zip(start[1:], target.shape[1:], strict=True))
    first = offset + start[0] * row
    return [
        Piece(
            key,
            file,
            first + at * row,
            (stop - at) * row,
            dtype,
            target.narrow(0, at, stop - at),
            rows=(stop - at, *shape[1:]),
            columns=columns,
        )
        for at in range(0, rows, step)
        for stop in [min(rows, at + step)]
    ]


def staging_bytes(pieces: Iterable[Piece]) -> int:
    """The staging buffer one thread needs: the largest piece not read in place (0: none)."""
    return max((p.nbytes for p in pieces if not p.in_place), default=0)


def _view(region: torch.Tensor) -> memoryview:
    nbytes = region.numel() * region.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(region.data_ptr())).cast("B")


class _Share:
    """Pieces of one file, in offset order, read by one thread."""

    def __init__(self, file: str, pieces: list[Piece]) -> None:
        self.file = file
        self.pieces = pieces

    def work(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def run(self, io: str, stage_bytes: int, cancel: threading.Event) -> None:
        shard = ShardFile(self.file, io=io)
        stage: torch.Tensor | None = None
        try:
            end = max(p.offset + p.nbytes for p in self.pieces)
            if end > shard.size:
                keys = sorted({p.key for p in self.pieces if p.offset + p.nbytes > shard.size})
                raise CorruptCheckpointError(
                    f"{self.file} has {shard.size} bytes but its tensors {keys[:4]} need bytes up to {end} "
                    "(truncated file)"
                )
            i = 0
            while i < len(self.pieces):
                if cancel.is_set():
                    return
                piece = self.pieces[i]
                if not piece.in_place:
                    if stage is None:
                        stage = torch.empty(stage_bytes, dtype=torch.uint8)
                    raw = stage[: piece.nbytes]
                    if piece.nbytes:
                        shard.read(piece.offset, [_view(raw)])
                    piece.fill(raw)
                    progress.report(piece.nbytes)
                    i += 1
                    continue
                # neighbours in the file, each read in place: one read with several buffers
                views, at, j = [_view(piece.region)], piece.offset + piece.nbytes, i + 1
                while j < len(self.pieces) and len(views) < _MAX_VIEWS:
                    following = self.pieces[j]
                    if following.offset != at or not following.in_place:
                        break
                    views.append(_view(following.region))
                    at, j = at + following.nbytes, j + 1
                views = [v for v in views if v.nbytes]
                if views:
                    shard.read(piece.offset, views)
                progress.report(at - piece.offset)
                i = j
            progress.flush()
        finally:
            shard.close()


def _shares(pieces: list[Piece], threads: int) -> list[_Share]:
    by_file: dict[str, list[Piece]] = {}
    for piece in pieces:
        by_file.setdefault(piece.file, []).append(piece)
    share = max(sum(p.nbytes for p in pieces) // (4 * threads), PIECE_BYTES)
    out: list[_Share] = []
    for file, mine in by_file.items():
        mine.sort(key=lambda p: p.offset)
        current: list[Piece] = []
        size = 0
        for piece in mine:
            if current and size + piece.nbytes > share:
                out.append(_Share(file, current))
                current, size = [], 0
            current.append(piece)
            size += piece.nbytes
        if current:
            out.append(_Share(file, current))
    return sorted(out, key=lambda s: -s.work())


def _check_sizes(pieces: list[Piece]) -> None:
    """Every file holds the bytes its tensors need (looked at by the one open rule)."""
    ends: dict[str, tuple[int, str]] = {}
    for p in pieces:
        if p.offset + p.nbytes > ends.get(p.file, (0, ""))[0]:
            ends[p.file] = (p.offset + p.nbytes, p.key)
    check_file_ends(ends)


def check_file_ends(ends: dict[str, tuple[int, str]]) -> None:
    """Each file (by the one open rule) holds at least ``end`` bytes: file -> (end, the key whose
    bytes end there).

    Raises:
        CorruptCheckpointError: a file shorter than that (truncated), naming the key.
    """
    for file, (end, key) in ends.items():
        size = regular_size(file)
        if end > size:
            raise CorruptCheckpointError(
                f"{file} has {size} bytes but tensor {key!r} needs bytes up to {end} (truncated file)"
            )


def wait_for_readers(
    pending: set[cf.Future[None]], cancel: threading.Event, on_tick: Callable[[], None] | None
) -> None:
    """Wait for every reading thread, calling ``on_tick`` every _TICK_S; on the first error (or a
    Ctrl-C) set ``cancel``, drop what has not started, and raise it."""
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


def read_pieces(
    pieces: list[Piece], threads: int, io: str = "buffered", on_tick: Callable[[], None] | None = None
) -> None:
    """Read every piece into its region with ``threads`` threads (each holding at most one
    staging buffer of :func:`staging_bytes`); ``io`` as resolved by storage.io_mode.

    Raises:
        CorruptCheckpointError: a file is shorter than its tensors need (before any of its
            bytes are read), or shrank while read.
        UnsafeCheckpointError: a file is a symlink or not a regular file.
    """
    shares = _shares(pieces, threads)
    if not shares:
        return
    _check_sizes(pieces)
    stage = staging_bytes(pieces)
    cancel = threading.Event()
    with cf.ThreadPoolExecutor(max_workers=min(threads, len(shares)), thread_name_prefix="parallel_dcp-read") as pool:
        wait_for_readers({pool.submit(share.run, io, stage, cancel) for share in shares}, cancel, on_tick)
