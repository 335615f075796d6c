"""Whole small records into whole dense tensors, planned and read as plain columns.

A checkpoint of optimizer state holds tens of thousands of records of a few KiB, each one whole
tensor. Built the general way (formats/fast_read.py), every record costs a read item, a request
and a record object before a byte is read, and as much again to check and copy it: more than the
read itself. Here a record is one tuple (:data:`Entry`), planned by the caller from ``.metadata``:

    entries of one shard, sorted by offset, cut into about 4 units per thread
      │ unit (one thread): one read per window of adjacent records (<= BATCH_BYTES, gaps
      │ <= GAP_BYTES between them)
      │   the first record of each (length, dtype, shape): parsed by the allow-list parser and
      │   checked against .metadata (read_units.checked_layout) ─▶ its template (record_batch)
      │   every record: its varying spans zeroed in bulk (record_batch.SpanTable), then in one
      │   pass checked byte for byte against its template and its data copied into its tensor
      │   (two memcmps, one memmove)
      │   a record unlike its template, or of a key without one: parsed and checked on its own
      │   (a damaged one is refused, naming its key)
      │ a record that is not a plain row-major tensor ──▶ a Request for DCP's reader
      ▼
    the tensors, filled

Every entry is a whole stored chunk (offsets 0, sizes the tensor's) of at most SMALL_RECORD bytes,
uncompressed, for a whole CPU tensor that is contiguous (the caller checks all of that). Each
thread holds one window buffer and the check's temporaries: read_units.thread_memory() counts them.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from operator import itemgetter
from typing import Any

import numpy
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from parallel_dcp import _compat
from parallel_dcp.engine import progress
from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.formats.dcp_records import is_row_major
from parallel_dcp.formats.read_units import (
    BATCH_BYTES,
    GAP_BYTES,
    SMALL_RECORD,
    ReadStats,
    Request,
    _File,
    checked_layout,
)
from parallel_dcp.formats.record_batch import SpanTable, Template, TemplateCache, make_template
from parallel_dcp.formats.scatter_read import Entry, preadv_function, read_scattered
from parallel_dcp.storage.direct_write import address
from parallel_dcp.storage.location import Location, Remote

__all__ = ["Entry", "SmallUnit", "small_units"]

_UNKNOWN = object()
_OFFSET, _LENGTH = itemgetter(0), itemgetter(1)
# Whether local records are read straight into their tensors (formats/scatter_read.py); False:
# every record through the windows (the path object storage takes).
SCATTER = True


def scatters(where: Location) -> bool:
    """Whether small records under ``where`` are read straight into their tensors (buffered, one
    ``preadv`` per run of records) rather than in windows of the job's ``io``."""
    return SCATTER and not isinstance(where, Remote) and preadv_function() is not None


def small_units(files: dict[str, list[Entry]], threads: int, templates: TemplateCache) -> list[SmallUnit]:
    """The entries of each file, sorted by offset, cut into about 4 units per thread (by bytes)."""
    ends: dict[str, numpy.ndarray[Any, Any]] = {}  # each file's running sum of its records' lengths
    for name, entries in files.items():
        entries.sort(key=_OFFSET)
        ends[name] = numpy.cumsum(numpy.fromiter(map(_LENGTH, entries), numpy.int64, len(entries)))
    total = sum(int(column[-1]) for column in ends.values() if column.size)
    share = max(total // (4 * max(threads, 1)), SMALL_RECORD)
    units: list[SmallUnit] = []
    for name, entries in files.items():
        # a unit takes entries while they add up to at most ``share`` bytes (its first one
        # whatever its size): cut where the running sum passes ``share`` past the unit's start
        column, first = ends[name], 0
        while first < len(entries):
            start = int(column[first - 1]) if first else 0
            stop = max(first + 1, int(numpy.searchsorted(column, start + share, side="right")))
            units.append(SmallUnit(name, entries[first:stop], templates))
            first = stop
    return units


class SmallUnit:
    """Entries of one file (sorted by offset), read by one thread."""

    def __init__(self, name: str, entries: list[Entry], templates: TemplateCache) -> None:
        self.name = name
        self.entries = entries
        self.templates = templates

    def run(self, where: Location, cancel: threading.Event, io: str = "buffered") -> tuple[ReadStats, list[Request]]:
        stats, fallback = ReadStats(), list[Request]()
        # a local file: its records straight into their tensors (scatter_read), read buffered
        # (O_DIRECT cannot read into unaligned memory); else, and for what that leaves, windows
        scatter = scatters(where)
        file = _File(where, self.name, "buffered" if scatter else io)
        try:
            last = self.entries[-1]
            if last[0] + last[1] > file.size:
                keys = sorted({entry[2] for entry in self.entries if entry[0] + entry[1] > file.size})
                raise CorruptCheckpointError(
                    f"{file.where} has {file.size} bytes but .metadata records {keys[:4]} up to byte "
                    f"{last[0] + last[1]} (truncated file)"
                )
            entries = self.entries
            if scatter:
                entries = read_scattered(
                    file, entries, functools.partial(self._learn, file), self.templates, stats, cancel.is_set
                )
            if cancel.is_set():
                return stats, []
            seen: dict[tuple[Any, ...], Template | None] = {}  # this unit's templates, looked up without the lock
            windows = self._windows(entries) if entries else []
            # one buffer for every window: its pages are faulted in once, not once per window
            buffer = bytearray(max((end - entries[first][0] for first, _, end in windows), default=0))
            for first, stop, end in windows:
                if cancel.is_set():
                    return stats, []
                self._window(file, buffer, entries[first:stop], end, seen, stats, fallback)
            progress.report(stats.bytes)
            progress.flush()
        finally:
            stats.reads = file.reads
            file.close()
        return stats, fallback

    def _learn(self, file: _File, entry: Entry) -> Template | None:
        """The template of ``entry``'s (length, dtype, shape) for scatter_read: known to the read,
        or made from this record (read whole and parsed); None: none."""
        tkey = (entry[1], entry[5], entry[6])
        known, template = self.templates.get(tkey)
        if known or self.templates.full:
            return template
        record = bytearray(entry[1])
        file.read(entry[0], [memoryview(record)])
        return self._template(file, memoryview(record), entry[0], entry, tkey, self.templates)

    @staticmethod
    def _windows(entries: list[Entry]) -> list[tuple[int, int, int]]:
        """(first, stop, end) entries read by one read each, up to byte ``end``: adjacent records,
        at most BATCH_BYTES."""
        out = []
        first = 0
        start, end = entries[0][0], entries[0][0] + entries[0][1]
        for i in range(1, len(entries)):
            offset, length = entries[i][0], entries[i][1]
            if offset - end > GAP_BYTES or offset + length - start > BATCH_BYTES:
                out.append((first, i, end))
                first, start, end = i, offset, offset + length
            end = max(end, offset + length)
        out.append((first, len(entries), end))
        return out

    def _window(
        self,
        file: _File,
        raw: bytearray,
        entries: list[Entry],
        end: int,
        seen: dict[tuple[Any, ...], Template | None],
        stats: ReadStats,
        fallback: list[Request],
    ) -> None:
        start = entries[0][0]
        view = memoryview(raw)
        file.read(start, [view[: end - start]])
        checked: list[Entry] = []
        starts: list[int] = []
        rows: list[int] = []  # each checked record's template, as its row in ``chosen``
        used: dict[int, int] = {}  # id(template) -> its row
        chosen: list[Template] = []
        rest: list[Entry] = []
        templates = self.templates
        for entry in entries:
            tkey = (entry[1], entry[5], entry[6])  # (length, dtype, shape)
            template = seen.get(tkey, _UNKNOWN)
            if template is _UNKNOWN:
                template = seen[tkey] = self._template(file, view, start, entry, tkey, templates)
            if template is None:
                rest.append(entry)
                continue
            row = used.get(id(template))
            if row is None:
                row = used[id(template)] = len(chosen)
                chosen.append(template)  # type: ignore[arg-type]  # a Template: None and unknown are gone
            checked.append(entry)
            starts.append(entry[0] - start)
            rows.append(row)
        unlike: list[Entry] = []
        copied, nbytes = _check_and_copy(raw, checked, starts, rows, chosen, unlike)
        for entry in unlike:  # its varying spans were zeroed: its bytes as they are in the file
            file.read(entry[0], [view[entry[0] - start : entry[0] - start + entry[1]]])
        for entry in rest + unlike:  # each parsed and checked on its own
            offset, length, key, target, _, dtype, shape, _ = entry
            record = view[offset - start : offset - start + length]
            layout = checked_layout(file.where, key, offset, record, record, length, dtype, shape)
            if layout is None or not is_row_major(layout.size, layout.stride):
                fallback.append(_request(entry, self.name))
                continue
            size = target.numel() * dtype.itemsize
            if size:
                ctypes.memmove(
                    target.data_ptr(),
                    address(view) + offset - start + layout.data_offset + layout.storage_offset * dtype.itemsize,
                    size,
                )
            copied += 1
            nbytes += size
        stats.fast += copied
        stats.bytes += nbytes

    @staticmethod
    def _template(
        file: _File, view: memoryview, start: int, entry: Entry, tkey: tuple[Any, ...], templates: TemplateCache
    ) -> Template | None:
        """The template of ``entry``'s (length, dtype, shape): the read's, or made from this record
        (parsed and checked against .metadata); None: its records are parsed one by one."""
        known, template = templates.get(tkey)
        if known:
            return template
        if templates.full:  # no room for its template: parsed on its own
            return None
        offset, length, key, target, _, dtype, shape, _ = entry
        record = view[offset - start : offset - start + length]
        layout = checked_layout(file.where, key, offset, record, record, length, dtype, shape)
        if layout is not None and is_row_major(layout.size, layout.stride):
            template = make_template(record, layout, target.numel())
        return templates.put(tkey, template)


def _check_and_copy(
    raw: bytearray,
    checked: list[Entry],
    starts: list[int],
    rows: list[int],
    chosen: list[Template],
    unlike: list[Entry],
) -> tuple[int, int]:
    """Each checked record (at ``starts`` in ``raw``) compared with its template (``chosen[row]``),
    and when equal, its data copied into its tensor in the same pass; a record unlike its template
    goes to ``unlike``. Its varying spans are zeroed in bulk first and left zeroed in ``raw`` (a
    record in ``unlike`` must be read again); they lie outside every record's data
    (dcp_records.varying_spans), so the data is copied as it was read. The count and bytes copied.
    """
    if not checked:
        return 0, 0
    table = SpanTable(chosen)
    parts = [(t.head, t.tail, t.tail_offset, t.data_start, t.nbytes) for t in chosen]
    data = numpy.frombuffer(raw, dtype=numpy.uint8)
    at_all = numpy.array(starts, dtype=numpy.int64)
    row_all = numpy.array(rows, dtype=numpy.intp)
    base = address(memoryview(raw))
    memmove = ctypes.memmove
    same = raw.startswith
    copied = nbytes = 0
    for first in range(0, len(checked), table.step):
        stop = first + table.step
        table.zero(data, at_all[first:stop], row_all[first:stop])
        for entry, at, row in zip(checked[first:stop], starts[first:stop], rows[first:stop], strict=True):
            head, tail, tail_offset, data_start, size = parts[row]
            if same(head, at) and same(tail, at + tail_offset):
                if size:
                    memmove(entry[7], base + at + data_start, size)
                copied += 1
                nbytes += size
            else:
                unlike.append(entry)
    return copied, nbytes


def _request(entry: Entry, name: str) -> Request:
    """The general request for an entry (of the file ``name``) that DCP's reader serves."""
    offset, length, key, target, info, dtype, shape, _ = entry
    if info is None:  # planned from the side index (storage/side_index_read.py): no object per record
        info = _compat.storage_info(name, offset, length)
    origin = torch.Size([0] * len(shape))
    index = MetadataIndex(key, origin)
    item = ReadItem(LoadItemType.TENSOR, index, origin, index, origin, torch.Size(shape))
    return Request(item, info, shape, dtype, target.detach())
