"""Many small records read in bulk: checked against one parsed record, copied without parsing each.

A shard of optimizer state holds tens of thousands of records of a few shapes. Parsing each one
(its zip directory, its pickle: ~20 us of Python) costs more than reading it, so records of one
shape are checked against one record parsed in full instead:

    the records of a unit (whole, in its batch buffers), keyed by (length, dtype, chunk shape)
      │ the first record of each key: parse_record (the allow-list parser), checked against
      │ .metadata by the caller ──▶ its Template: the bytes every record of that key must hold
      │ outside its data and the spans that legitimately vary (CRC-32s, torch's serialization id)
      ▼
    check_batch: per batch buffer, the varying spans of every record zeroed in one scatter (numpy,
    no Python call per record; put back after), then each record two memcmps against its template
      │ equal: the record has the template's layout (parse_record reads nothing that may differ);
      │        its data is copied straight into its tensor, one memmove per record
      │ not equal: the caller parses it on its own (formats/read_units.py's per-record path)

Temporaries: at most :data:`CHECK_BYTES` per reading thread (the scatter's indices and bytes),
counted in ``read_units.thread_memory()``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy

from parallel_dcp.formats.dcp_records import RecordLayout, varying_spans

__all__ = ["CHECK_BYTES", "SpanTable", "Template", "TemplateCache", "check_batch", "make_template"]

T = TypeVar("T")

# The most varying bytes one template may have (torch's records: 7 CRC-32s in the directory, a
# few in descriptors and local headers, a 40-byte serialization id: about 100).
_MAX_SPAN_BYTES = 512
# Varying bytes zeroed per scatter; each holds a few int64 temporaries (its record's number, its
# place in the template, in the batch) and its saved byte.
_SPAN_STEP = 64 << 10
# The templates one read keeps, at most (about 2,000 of torch's small records); records of keys
# met once it is full are parsed one by one.
CACHE_BYTES = 4 << 20
# What a check holds at most: the scatter's temporaries, one record's head or tail copied out for
# its comparison (a small record: at most 1 MiB, formats/read_units.SMALL_RECORD), and the
# read's templates (shared by its threads; counted for each, which over-counts).
CHECK_BYTES = _SPAN_STEP * (4 * 8 + 1) + (1 << 20) + CACHE_BYTES


@dataclass(frozen=True, slots=True)
class Template:
    """What every record of one key must hold: ``head`` before its data and ``tail`` after it,
    once the bytes at ``spans`` (its varying spans, as offsets in the record, int64) are zeroed;
    its tensor's bytes are ``nbytes`` at ``data_start``."""

    layout: RecordLayout
    spans: numpy.ndarray[Any, numpy.dtype[numpy.int64]]
    head: bytes
    tail: bytes
    data_start: int
    nbytes: int
    tail_offset: int  # where ``tail`` starts in a record

    def cost(self) -> int:
        """The bytes it holds (roughly: its buffers and objects), with its frame for the scatter
        (formats/scatter_read.py: its head and tail as words and their mask)."""
        return 3 * (len(self.head) + len(self.tail)) + 8 * self.spans.size + 512 + 64


def make_template(record: memoryview, layout: RecordLayout, numel: int) -> Template | None:
    """The template of ``record`` (a whole record whose layout, checked by the caller against
    ``.metadata``, is ``layout``; its tensor has ``numel`` elements); None when its layout has
    no spans this module can vouch for."""
    spans = varying_spans(record, layout)
    if spans is None:
        return None
    positions = [p for start, stop in spans for p in range(start, stop)]
    if len(positions) > _MAX_SPAN_BYTES:
        return None
    zeroed = bytearray(record)
    for p in positions:
        zeroed[p] = 0
    itemsize = layout.dtype.itemsize
    return Template(
        layout,
        numpy.array(positions, dtype=numpy.int64),
        bytes(zeroed[: layout.data_offset]),
        bytes(zeroed[layout.data_offset + layout.data_bytes :]),
        layout.data_offset + layout.storage_offset * itemsize,
        numel * itemsize,
        layout.data_offset + layout.data_bytes,
    )


class TemplateCache:
    """Templates by key, shared by the reading threads of one read (a template parsed from any
    record serves every record of its key: each is compared byte for byte)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._found: dict[object, Template | None] = {}
        self._bytes = 0
        self.full = False  # no room for another template (CACHE_BYTES): new keys are parsed per record
        self._derived: dict[int, Any] = {}  # what a reader makes of a kept template, by its id

    def derived(self, template: Template, make: Callable[[Template], T]) -> T:
        """``make(template)`` for a template this cache keeps, made once per read (its bytes are
        counted in :meth:`Template.cost`)."""
        found = self._derived.get(id(template))
        if found is None:
            found = self._derived.setdefault(id(template), make(template))
        return found  # type: ignore[no-any-return]

    def get(self, key: object) -> tuple[bool, Template | None]:
        """(known, template): ``known`` False when no record of ``key`` was parsed yet."""
        with self._lock:
            if key in self._found:
                return True, self._found[key]
        return False, None

    def put(self, key: object, template: Template | None) -> Template | None:
        """Keep ``template`` for ``key`` if there is room; the template to use (None: no room)."""
        with self._lock:
            if key in self._found:
                return self._found[key]
            cost = template.cost() if template is not None else 512
            if self._bytes + cost > CACHE_BYTES:
                self.full = True
                return None
            self._found[key] = template
            self._bytes += cost
            return template


class SpanTable:
    """The varying spans of a few templates as one padded table (a row per template), so the spans
    of many records are zeroed by broadcasting alone: no Python call per record, and one scatter
    (nothing saved or put back: a caller that needs a record as it was read reads it again).

    A row shorter than the longest repeats its first span byte (zeroed twice).
    """

    def __init__(self, templates: list[Template]) -> None:
        self.templates = templates
        width = max((t.spans.size for t in templates), default=0)
        table = numpy.zeros((len(templates), width), dtype=numpy.int64)
        for row, template in enumerate(templates):
            table[row, : template.spans.size] = template.spans
            if template.spans.size:
                table[row, template.spans.size :] = template.spans[0]
        self.table = table
        # records per scatter: each varying byte holds a few int64 temporaries (CHECK_BYTES)
        self.step = max(1, _SPAN_STEP // max(width, 1))

    def zero(
        self, data: numpy.ndarray[Any, Any], starts: numpy.ndarray[Any, Any], rows: numpy.ndarray[Any, Any]
    ) -> None:
        """Zero the varying spans of the records at ``starts`` (offsets in ``data``) whose
        templates are ``rows`` (at most :attr:`step` records)."""
        if self.table.shape[1]:
            data[(starts[:, None] + self.table[rows]).ravel()] = 0


def check_batch(batch: bytearray, starts: list[int], templates: list[Template]) -> list[bool]:
    """Whether the record at each of ``starts`` (offsets in ``batch``) holds
    its template's bytes outside its data and varying spans. The varying spans of the records are
    zeroed in one scatter per step of at most :data:`_SPAN_STEP` bytes (numpy: one thread, no
    Python call per record; their bytes saved and put back after), then each record is two
    in-place comparisons (``bytearray.startswith``: a memcmp, no copy) against its template.
    """
    out: list[bool] = []
    most = max(t.spans.size for t in templates) if templates else 0
    step = max(1, _SPAN_STEP // max(most, 1))
    for first in range(0, len(starts), step):
        out += _check_step(batch, starts[first : first + step], templates[first : first + step])
    return out


def _check_step(batch: bytearray, starts: list[int], templates: list[Template]) -> list[bool]:
    data = numpy.frombuffer(batch, dtype=numpy.uint8)
    # the varying bytes' places, template by template: its records' starts plus its spans
    groups: dict[int, tuple[Template, list[int]]] = {}
    for at, template in zip(starts, templates, strict=True):
        group = groups.get(id(template))
        if group is None:
            groups[id(template)] = (template, [at])
        else:
            group[1].append(at)
    position = numpy.concatenate(
        [
            (numpy.array(ats, dtype=numpy.int64)[:, None] + template.spans[None, :]).ravel()
            for template, ats in groups.values()
        ]
    )
    saved = data[position]
    data[position] = 0
    out = [
        batch.startswith(template.head, at) and batch.startswith(template.tail, at + template.tail_offset)
        for at, template in zip(starts, templates, strict=True)
    ]
    data[position] = saved
    return out
