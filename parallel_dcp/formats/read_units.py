"""How one thread reads a run of records of one shard (see :mod:`parallel_dcp.fast_read`).

records (sorted by offset) ── one pread per batch of nearby heads/tails (≤ BATCH_BYTES)
  │ parse_record, checked against .metadata (dtype, shape, extent in the record)
  │ each request: the contiguous runs of its region (a whole chunk: one run)
  │   small record: runs copied out of the batch buffer
  │   large record: (file offset, target memory) segments
  ▼
segments sorted by offset; neighbours within GAP_BYTES merged into one preadv, the gap
landing in a scratch buffer; a target that is not dense along the runs (or not on the CPU)
is read into a staging tensor and copied

Longer than 300 lines because the per-thread read machinery (batched small reads, merged preadv
runs, checks against the record layout) is one hot loop.
"""

from __future__ import annotations

import ctypes
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.planner import ReadItem

from parallel_dcp.engine import progress
from parallel_dcp.engine.memory import ZSTD_DECOMPRESS_BYTES
from parallel_dcp.errors import CorruptCheckpointError, dtype_name
from parallel_dcp.formats.dcp_records import HEAD_BYTES, TAIL_BYTES, RecordLayout, is_row_major, parse_record
from parallel_dcp.formats.record_batch import CHECK_BYTES, TemplateCache, check_batch, make_template
from parallel_dcp.formats.seated import seat, shift
from parallel_dcp.storage.direct_read import ShardFile
from parallel_dcp.storage.direct_write import address
from parallel_dcp.storage.location import Location, Remote
from parallel_dcp.storage.prefetch import PrefetchPlan
from parallel_dcp.storage.read_choice import ReadChoice
from parallel_dcp.storage.side_index_use import IndexUse

__all__ = [
    "BATCH_BYTES",
    "GAP_BYTES",
    "PIECE_BYTES",
    "SMALL_RECORD",
    "ReadStats",
    "Record",
    "Request",
    "Unit",
    "checked_layout",
    "record_layout",
    "thread_memory",
]

SMALL_RECORD = 1 << 20
# The most one batch read holds; also how far apart two reads may be and still be merged.
BATCH_BYTES = 8 << 20
GAP_BYTES = 64 << 10
# A region larger than twice this is read as pieces of about this size, by several threads.
PIECE_BYTES = 32 << 20
_IOV_MAX = 1024
# A region whose contiguous runs are this short, and many, is left to DCP's reader.
_TINY_RUN = 64
_TICK_S = 0.1


def thread_memory() -> int:
    """What one reading thread holds at most beside the targets: a unit's buffers, or a
    decompressor (a compressed record; formats/compressed_read.py), one at a time."""
    return max(BATCH_BYTES + GAP_BYTES + HEAD_BYTES + TAIL_BYTES + CHECK_BYTES, ZSTD_DECOMPRESS_BYTES)


@dataclass(slots=True)
class Request:
    """One read item: the region ``item.storage_offsets``/``lengths`` of a stored chunk of shape
    ``chunk`` into ``target`` (shape ``lengths``; None for a pickled value); ``unfit`` sends it
    to DCP's reader whatever its record holds."""

    item: ReadItem
    info: Any  # torch's _StorageInfo: relative_path, offset, length, transform_descriptors
    chunk: tuple[int, ...]
    dtype: torch.dtype | None
    target: torch.Tensor | None
    unfit: bool = False
    piece: int = 0  # a large region is cut into pieces 0, 1, ...; only piece 0 is counted
    room: torch.Tensor | None = None  # a fresh whole target's room (formats/seated.py)


@dataclass
class ReadStats:
    """Which path served a read: ``fast`` and ``fallback`` count read items (a tensor or a part of
    one); ``fallback_keys`` names the keys DCP's own reader served; ``values`` counts pickled
    (non-tensor) values; ``reads`` the system calls (or ranged GETs) of the fast path;
    ``compressed`` the read items decompressed (bounded, on the reading threads);
    ``read_choice`` how local shards were read under ``io`` and why: for ``io="auto"`` the cold
    direct and buffered rates measured on this file system (storage.read_choice.ReadChoice);
    ``prefetch`` what a load's shard prefetch decided (storage.prefetch.PrefetchPlan: the files
    asked for before ``.metadata`` was parsed and their bytes, or none and why); ``index`` what a
    DCP load read its plan from (storage.side_index_use.IndexUse: the side index and its size, or
    ``.metadata`` and why not the index; None for other sources and ``FastReader``)."""

    fast: int = 0
    fallback: int = 0
    fallback_keys: set[str] = field(default_factory=set)
    values: int = 0
    reads: int = 0
    bytes: int = 0
    compressed: int = 0
    read_choice: ReadChoice | None = None
    prefetch: PrefetchPlan | None = None
    index: IndexUse | None = None

    def add(self, other: ReadStats) -> None:
        self.fast += other.fast
        self.fallback += other.fallback
        self.fallback_keys |= other.fallback_keys
        self.values += other.values
        self.reads += other.reads
        self.bytes += other.bytes
        self.compressed += other.compressed
        if other.read_choice is not None:
            self.read_choice = other.read_choice
        if other.prefetch is not None:
            self.prefetch = other.prefetch
        if other.index is not None:
            self.index = other.index


class _File:
    """One shard, read by offset into lists of buffers (local: preadv, or O_DIRECT reads through
    aligned buffers, see storage.direct_read; remote: ranged GETs)."""

    def __init__(self, where: Location, name: str, io: str = "buffered") -> None:
        self.where = where / name
        self.local: ShardFile | None = None
        if isinstance(self.where, Remote):
            self.size = self.where.size()
        else:
            self.local = ShardFile(self.where, io=io)
            self.size = self.local.size
        self.reads = 0

    def close(self) -> None:
        if self.local is not None:
            self.local.close()

    def read(self, offset: int, views: list[memoryview]) -> None:
        self.reads += 1
        if self.local is not None:
            self.local.read(offset, views)
            return
        assert isinstance(self.where, Remote)
        for view in views:
            self.where.read_into(offset, view)
            offset += view.nbytes

    def read_spans(self, spans: list[tuple[int, list[memoryview]]]) -> None:
        """Several separate spans, their reads in flight together where the file is local."""
        if self.local is None:
            for offset, views in spans:
                self.read(offset, views)
            return
        self.reads += len(spans)
        self.local.read_spans(spans)


def _memory(tensor: torch.Tensor, element: int, nbytes: int) -> memoryview:
    address = tensor.data_ptr() + element * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


@dataclass(slots=True)
class Record:
    offset: int
    length: int
    requests: list[Request]
    head: memoryview | None = None
    tail: memoryview | None = None
    batch: bytearray | None = None  # a small record: the batch buffer holding it whole, from ``at``
    at: int = 0


def _runs(req: Request, target: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """(element in the stored chunk, element in ``target``, elements) of each contiguous run of the
    region, or None when the target is not dense along them (then it is staged)."""
    size, offsets, lengths = req.chunk, tuple(req.item.storage_offsets), tuple(req.item.lengths)
    ndim = len(size)
    partial = [j for j in range(ndim) if offsets[j] != 0 or lengths[j] != size[j]]
    d = partial[-1] if partial else 0
    if not is_row_major(lengths[d:], tuple(target.stride())[d:]) or ndim == 0:
        return None if ndim else [(0, 0, 1)]
    step = [math.prod(size[j + 1 :]) for j in range(ndim)]
    tstride = target.stride()
    run = lengths[d] * step[d]
    runs = [(offsets[d] * step[d], 0, run)]
    for j in range(d - 1, -1, -1):
        runs = [(s + (offsets[j] + i) * step[j], t + i * tstride[j], n) for i in range(lengths[j]) for s, t, n in runs]
    return runs


class Unit:
    """Records of one file, read by one thread."""

    def __init__(self, name: str, records: list[Record], templates: TemplateCache | None = None) -> None:
        self.name = name
        self.records = records
        self.templates = templates  # small records checked in bulk against these (record_batch)

    def run(self, where: Location, cancel: threading.Event, io: str = "buffered") -> tuple[ReadStats, list[Request]]:
        stats, fallback = ReadStats(), []
        file = _File(where, self.name, io)
        try:
            end = max(r.offset + r.length for r in self.records)
            if end > file.size:
                keys = sorted({q.item.storage_index.fqn for r in self.records for q in r.requests})
                raise CorruptCheckpointError(
                    f"{file.where} has {file.size} bytes but .metadata records {keys[:4]} up to byte {end} "
                    "(truncated file)"
                )
            self._read_windows(file)
            segments: list[tuple[int, memoryview]] = []
            staged: list[tuple[torch.Tensor, torch.Tensor]] = []
            shifted: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # seated targets (formats/seated.py)
            for record in self._bulk(file, stats) if self.templates is not None else self.records:
                if cancel.is_set():
                    return stats, []
                layout = self._layout(file, record)
                for req in record.requests:
                    if layout is None or not self._plan(req, record, layout, segments, staged, shifted):
                        fallback.append(req)
                    else:
                        stats.fast += req.piece == 0
                        assert req.target is not None
                        stats.bytes += req.target.numel() * req.target.element_size()
            for record in self.records:
                record.head = record.tail = record.batch = None  # the batch buffers are no longer needed
            _read_segments(file, segments)
            for stage, target in staged:
                target.copy_(stage)
            for target, room, landing in shifted:
                shift(target, room, landing)
            progress.report(stats.bytes)
            progress.flush()
        finally:
            stats.reads = file.reads
            file.close()
        return stats, fallback

    def _read_windows(self, file: _File) -> None:
        """Read each record's head and tail (small records whole), nearby ones in one read."""
        windows: list[tuple[int, int, Record, str]] = []
        for r in self.records:
            if r.length <= SMALL_RECORD:
                windows.append((r.offset, r.offset + r.length, r, "whole"))
            else:
                windows.append((r.offset, r.offset + HEAD_BYTES, r, "head"))
                windows.append((r.offset + r.length - TAIL_BYTES, r.offset + r.length, r, "tail"))
        windows.sort(key=lambda w: w[0])
        spans: list[tuple[int, list[memoryview]]] = []
        i = 0
        while i < len(windows):
            start, stop, j = windows[i][0], windows[i][1], i + 1
            while j < len(windows) and windows[j][0] - stop <= GAP_BYTES and windows[j][1] - start <= BATCH_BYTES:
                stop, j = max(stop, windows[j][1]), j + 1
            raw = bytearray(stop - start)
            buffer = memoryview(raw)
            spans.append((start, [buffer]))
            for w_start, w_stop, record, kind in windows[i:j]:
                view = buffer[w_start - start : w_stop - start]
                if kind in ("whole", "head"):
                    record.head = view
                if kind in ("whole", "tail"):
                    record.tail = view
                if kind == "whole":
                    record.batch, record.at = raw, w_start - start
            i = j
        file.read_spans(spans)  # in flight together: one window per record, across the file

    def _bulk(self, file: _File, stats: ReadStats) -> list[Record]:
        """Copy the small records that hold a whole plain tensor for one whole dense target, each
        checked in bulk against the template of its (length, dtype, shape) (formats/record_batch);
        the records left (other layouts, regions, records unlike their template) are returned."""
        assert self.templates is not None
        rest: list[Record] = []
        batches: dict[int, tuple[bytearray, list[Record], list[int], list[Any]]] = {}
        seen: dict[tuple[Any, ...], Any] = {}  # this unit's templates, looked up without the lock
        for record in self.records:
            req = record.requests[0]
            target = req.target
            if (
                record.batch is None
                or len(record.requests) != 1
                or target is None
                or not target.is_cpu
                or not target.is_contiguous()
                or any(req.item.storage_offsets)
                or req.item.lengths != req.chunk
            ):
                rest.append(record)
                continue
            key = (record.length, req.dtype, req.chunk)
            known, template = (True, seen[key]) if key in seen else self.templates.get(key)
            if not known and self.templates.full:
                rest.append(record)  # no room for its template: parsed on its own
                continue
            if not known:
                layout = self._layout(file, record)  # checked against .metadata; raises on a damaged record
                assert record.head is not None
                template = None if layout is None else make_template(record.head, layout, target.numel())
                template = self.templates.put(key, template)  # None: no room left for it
            seen[key] = template
            if template is None:
                rest.append(record)
                continue
            batch = batches.setdefault(id(record.batch), (record.batch, [], [], []))
            batch[1].append(record)
            batch[2].append(record.at)
            batch[3].append(template)
        copied = nbytes = 0
        memmove = ctypes.memmove
        for buffer, records, starts, templates in batches.values():
            base = address(memoryview(buffer))
            for record, template, same in zip(records, templates, check_batch(buffer, starts, templates), strict=True):
                if not same:
                    rest.append(record)  # parsed on its own
                    continue
                target = record.requests[0].target
                assert target is not None
                memmove(target.data_ptr(), base + record.at + template.data_start, template.nbytes)
                copied += 1
                nbytes += template.nbytes
        stats.fast += copied
        stats.bytes += nbytes
        return rest

    def _layout(self, file: _File, record: Record) -> RecordLayout | None:
        return record_layout(file.where, record)

    def _plan(
        self,
        req: Request,
        record: Record,
        layout: RecordLayout,
        segments: list[tuple[int, memoryview]],
        staged: list[tuple[torch.Tensor, torch.Tensor]],
        shifted: list[tuple[torch.Tensor, torch.Tensor, int]],
    ) -> bool:
        """Add the reads of one request; False when it is left to DCP's reader."""
        target = req.target
        assert target is not None and req.dtype is not None
        if target.numel() == 0:
            return True
        into = target
        runs = _runs(req, target) if target.device.type == "cpu" else None
        if runs is None:
            into = torch.empty(tuple(req.item.lengths), dtype=req.dtype)
            runs = _runs(req, into)
            assert runs is not None
        itemsize = req.dtype.itemsize
        if len(runs) > 16 and runs[0][2] * itemsize < _TINY_RUN:
            return False
        base = layout.data_offset + layout.storage_offset * itemsize
        whole = record.length <= SMALL_RECORD
        if req.room is not None and not whole and into is target:  # a fresh whole target (formats/seated.py)
            room, req.room = req.room, None
            landing = seat(target, room, record.offset + base)
            segments.append((record.offset + base, _memory(room, landing, target.nbytes)))
            shifted.append((target, room, landing))  # moved down in place once read, where it must be
            return True
        for stored, element, count in runs:
            dest = _memory(into, element, count * itemsize)
            if whole:
                assert record.head is not None
                dest[:] = record.head[base + stored * itemsize : base + (stored + count) * itemsize]
            else:
                segments.append((record.offset + base + stored * itemsize, dest))
        if into is not target:
            staged.append((into, target))
        return True


def record_layout(where: object, record: Record) -> RecordLayout | None:
    """The layout of ``record`` (its head and tail read), checked against what each of its
    requests says (.metadata): None when it is not a plain row-major tensor (DCP's reader serves it).

    Raises:
        CorruptCheckpointError: the record is damaged or contradicts .metadata, naming its key.
    """
    assert record.head is not None and record.tail is not None
    first = record.requests[0]
    layout = checked_layout(
        where, first.item.storage_index.fqn, record.offset, record.head, record.tail, record.length, None, ()
    )
    if layout is None:
        return None
    # Every request is checked, not only the first: each names its own key, dtype and chunk
    # (the metadata check refuses two keys on one record; this holds even without it).
    for req in record.requests:
        checked_layout(
            where, req.item.storage_index.fqn, record.offset, None, None, record.length, req.dtype, req.chunk, layout
        )
    return layout if is_row_major(layout.size, layout.stride) else None


def checked_layout(
    where: object,
    key: str,
    offset: int,
    head: memoryview | None,
    tail: memoryview | None,
    length: int,
    dtype: torch.dtype | None,
    chunk: tuple[int, ...],
    layout: RecordLayout | None = None,
) -> RecordLayout | None:
    """The layout of the record of ``key`` at byte ``offset`` (parsed from ``head`` and ``tail``
    unless ``layout`` is given); when ``dtype`` is given, checked to hold that dtype and ``chunk``
    (what .metadata says) with every element's bytes. None: not a tensor record of one storage.

    Raises:
        CorruptCheckpointError: the record is damaged or contradicts .metadata, naming ``key``.
    """
    if layout is None:
        assert head is not None and tail is not None
        try:
            layout = parse_record(head, tail, length)
        except ValueError as exc:
            raise CorruptCheckpointError(f"{where}: the record of {key!r} at byte {offset} is damaged: {exc}") from exc
        if layout is None:
            return None
    if dtype is None:
        return layout
    if layout.dtype != dtype or layout.size != chunk:
        raise CorruptCheckpointError(
            f"{where}: the record of {key!r} at byte {offset} holds {dtype_name(layout.dtype)} "
            f"{list(layout.size)} but .metadata says {dtype_name(dtype)} {list(chunk)}"
        )
    if (layout.storage_offset + math.prod(chunk)) * layout.dtype.itemsize > layout.data_bytes:
        raise CorruptCheckpointError(
            f"{where}: the record of {key!r} at byte {offset} has {layout.data_bytes} data bytes, fewer than "
            f"its {list(chunk)} {dtype_name(layout.dtype)} elements need"
        )
    return layout


def _read_segments(file: _File, segments: list[tuple[int, memoryview]]) -> None:
    """Read every (offset, buffer), sorted; nearby ones in one preadv, gaps into a scratch buffer."""
    segments.sort(key=lambda s: s[0])
    scratch = memoryview(bytearray(GAP_BYTES)) if len(segments) > 1 else memoryview(b"")
    i = 0
    while i < len(segments):
        start, first = segments[i]
        views, end, j = [first], start + first.nbytes, i + 1
        while j < len(segments) and len(views) + 2 <= _IOV_MAX:
            offset, view = segments[j]
            gap = offset - end
            if gap < 0 or gap > GAP_BYTES:
                break
            if gap:
                views.append(scratch[:gap])
            views.append(view)
            end, j = offset + view.nbytes, j + 1
        file.read(start, views)
        i = j
