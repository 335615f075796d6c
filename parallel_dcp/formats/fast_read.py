"""The zero-copy read path: DCP read items straight from shard files into their target tensors.

    requests (ReadItem, its _StorageInfo, the stored chunk's shape, the target region)
      │ transformed (compressed) records and pickled values ─────────────────────┐
      ▼                                                                          │
    per file, records sorted by offset, cut into units ── threads (preadv releases the GIL)
      │ unit: one pread per batch of nearby record heads/tails (bounded buffer)   │
      │       parse_record + check against .metadata (dtype, shape, extent)       │
      │       small records: copied out of the batch buffer                       │
      │       large records: preadv straight into the target's memory, reads      │
      │       sorted by offset and coalesced (gaps land in a scratch buffer)      │
      │ a record that is not a plain row-major tensor ──────────────────────────▶│
      ▼                                                                          ▼
    done                                          DCP's FileSystemReader.read_data (counted)

Whole small records for whole dense CPU tensors (optimizer state: tens of thousands of them) come
planned as plain columns instead (``small``: no request per key) and are read by the same threads
as units of their own (formats/small_reads.py), checked in bulk against one parsed record of each
shape (formats/record_batch.py).

Pages of freshly allocated targets are faulted in by the reading threads, in parallel. Threads
keep the targets in private memory; each holds at most one batch buffer (``BATCH_BYTES``) and
one gap buffer.

Longer than 300 lines because the three kinds of unit (records, small records as columns,
compressed records) are cut and run by one read loop, with one fallback to DCP's reader.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import math
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.formats.compressed_read import RECORD_OVERHEAD, CompressedRecord, bounded_reader
from parallel_dcp.formats.read_units import (
    BATCH_BYTES,
    PIECE_BYTES,
    SMALL_RECORD,
    ReadStats,
    Record,
    Request,
    Unit,
    thread_memory,
)
from parallel_dcp.formats.record_batch import TemplateCache
from parallel_dcp.formats.small_reads import Entry, SmallUnit, small_units
from parallel_dcp.storage.compression import is_compressed
from parallel_dcp.storage.direct_read import vanished
from parallel_dcp.storage.location import Location
from parallel_dcp.storage.metadata import reading

__all__ = [
    "BATCH_BYTES",
    "Entry",
    "ReadStats",
    "Request",
    "read_requests",
    "thread_memory",
]

_TICK_S = 0.1


def _pieces(req: Request, threads: int) -> list[Request]:
    """A large region cut into row ranges (of its first dimension longer than 1, all dims before
    it being 1: each range stays one contiguous run), so that threads share one large record; a
    fresh target to be seated (formats/seated.py) stays whole: the direct reader keeps DEPTH reads
    of it in flight (storage/direct_read.py)."""
    target = req.target
    if target is None or req.room is not None or threads < 2 or target.nbytes <= 2 * PIECE_BYTES:
        return [req]
    lengths = list(req.item.lengths)
    dim = next((d for d, n in enumerate(lengths) if n > 1), None)
    if dim is None or any(n != 1 for n in lengths[:dim]):
        return [req]
    rows = lengths[dim]
    count = min(rows, -(-target.numel() * target.element_size() // PIECE_BYTES))
    step = -(-rows // count)
    out = []
    for number, start in enumerate(range(0, rows, step)):
        stop = min(rows, start + step)
        storage_offsets = list(req.item.storage_offsets)
        dest_offsets = list(req.item.dest_offsets)
        storage_offsets[dim] += start
        dest_offsets[dim] += start
        lengths[dim] = stop - start
        item = dataclasses.replace(
            req.item,
            storage_offsets=torch.Size(storage_offsets),
            dest_offsets=torch.Size(dest_offsets),
            lengths=torch.Size(lengths),
        )
        piece = dataclasses.replace(req, item=item, target=target.narrow(dim, start, stop - start), piece=number)
        out.append(piece)
    return out


def _units(requests: list[Request], threads: int, templates: TemplateCache) -> list[Unit]:
    """Records grouped by file in offset order, cut into about 4 units per thread; the pieces of
    a large region are records of their own; ``templates``: one per read (a record of each shape
    is parsed once, not per unit)."""
    files: dict[str, dict[tuple[int, int], Record]] = {}
    for whole in requests:
        for req in _pieces(whole, threads):
            records = files.setdefault(str(req.info.relative_path), {})
            key = (int(req.info.offset), req.piece)
            record = records.get(key)
            if record is None:
                record = records[key] = Record(int(req.info.offset), int(req.info.length), [])
            else:
                _check_shared(record.requests[0], req)
            record.requests.append(req)
    work = {id(r): _work(r) for records in files.values() for r in records.values()}
    share = max(sum(work.values()) // (4 * threads), SMALL_RECORD)
    units = []
    for name, records in files.items():
        current: list[Record] = []
        size = window = 0
        for record in sorted(records.values(), key=lambda r: r.offset):
            small = min(record.length, SMALL_RECORD + 1) if record.length <= SMALL_RECORD else 0
            if current and (size + work[id(record)] > share or window + small > BATCH_BYTES):
                units.append(Unit(name, current, templates))
                current, size, window = [], 0, 0
            current.append(record)
            size, window = size + work[id(record)], window + small
        if current:
            units.append(Unit(name, current, templates))
    return sorted(units, key=lambda u: -sum(work[id(r)] for r in u.records))


def _check_shared(first: Request, req: Request) -> None:
    """Two read items of one record must be regions of one stored chunk: the same key, chunk,
    dtype and record length (a crafted ``.metadata`` could point two keys at one record; the
    metadata check refuses that, and this holds whatever metadata the caller passed)."""
    a, b = first.item.storage_index, req.item.storage_index
    if (a.fqn, tuple(a.offset or ()), first.dtype, first.chunk, int(first.info.length)) != (
        b.fqn,
        tuple(b.offset or ()),
        req.dtype,
        req.chunk,
        int(req.info.length),
    ):
        raise CorruptCheckpointError(
            f"{req.info.relative_path}: .metadata points {a.fqn!r} and {b.fqn!r} at one record "
            f"(byte {req.info.offset}): one record holds one chunk"
        )


def _admit_compressed(requests: list[Request], budget: MemoryGovernor) -> None:
    """A compressed record decompressed anywhere but straight into one whole dense target (a
    region of it, a record that is not a plain tensor) holds its whole decompressed frame and a
    staging tensor: admitted under ``budget`` before any of it is read."""
    first = requests[0]
    assert first.dtype is not None and first.target is not None
    nbytes = math.prod(first.chunk) * first.dtype.itemsize
    target = first.target
    whole = tuple(first.item.lengths) == first.chunk and not any(first.item.storage_offsets)
    direct = len(requests) == 1 and whole and target.is_contiguous() and target.device.type == "cpu"
    if not direct:
        budget.check_item(first.item.storage_index.fqn, 2 * (nbytes + RECORD_OVERHEAD))


def _compressed_units(records: list[list[Request]], threads: int) -> list[CompressedRecord]:
    """Compressed records in file and offset order, cut into about 4 shares per thread."""
    if not records:
        return []
    records.sort(key=lambda reqs: (str(reqs[0].info.relative_path), int(reqs[0].info.offset)))
    work = [CompressedRecord([reqs]).work() for reqs in records]
    share = max(sum(work) // (4 * threads), 1)
    units: list[CompressedRecord] = []
    current: list[list[Request]] = []
    size = 0
    for reqs, cost in zip(records, work, strict=True):
        if current and size + cost > share:
            units.append(CompressedRecord(current))
            current, size = [], 0
        current.append(reqs)
        size += cost
    units.append(CompressedRecord(current))
    return sorted(units, key=lambda u: -u.work())


def _work(record: Record) -> int:
    """Bytes a record costs to read: all of a small one, the regions of a large one."""
    if record.length <= SMALL_RECORD:
        return record.length
    return sum(q.target.numel() * q.target.element_size() for q in record.requests if q.target is not None)


class _Sink:
    """The planner DCP's reader sees for the fallback: targets are already resolved."""

    def __init__(self, targets: dict[int, torch.Tensor], on_bytes: Callable[[ReadItem, bytes], None]) -> None:
        self.targets = targets
        self.on_bytes = on_bytes

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.targets[id(item)]

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        """The caller commits every item once all are read."""

    def load_bytes(self, item: ReadItem, stream: Any) -> None:
        self.on_bytes(item, stream.read())


def read_requests(
    where: Location,
    requests: Iterable[Request],
    threads: int,
    on_bytes: Callable[[ReadItem, bytes], None],
    budget: MemoryGovernor | None = None,
    on_tick: Callable[[], None] | None = None,
    io: str = "buffered",
    small: dict[str, list[Entry]] | None = None,
) -> ReadStats:
    """Read every request into its target; pickled values go to ``on_bytes(item, raw bytes)``;
    ``io``: how local shards are read (resolved: see storage.io_mode); ``small``: whole small
    records by file, read as columns (formats/small_reads.py).

    Raises:
        CorruptCheckpointError: a shard is missing bytes, or a record contradicts ``.metadata``.
        MemoryLimitExceeded: a record left to DCP's reader cannot fit under ``budget``.
    """
    fast: list[Request] = []
    slow: list[Request] = []
    seating = io != "buffered"  # buffered (or object storage): no target is seated, large ones are cut
    compressed: dict[tuple[str, int], list[Request]] = {}
    for req in requests:
        if is_compressed(req.info) and req.item.type != LoadItemType.BYTE_IO and req.target is not None:
            shared = compressed.setdefault((str(req.info.relative_path), int(req.info.offset)), [])
            if shared:
                _check_shared(shared[0], req)
            shared.append(req)
            continue
        if not seating:
            req.room = None
        (slow if req.item.type == LoadItemType.BYTE_IO or req.unfit else fast).append(req)
    if budget is not None:
        for reqs in compressed.values():
            _admit_compressed(reqs, budget)
    stats = ReadStats()
    # compressed records: decompressed on the same threads, in about 4 shares per thread, largest first
    units: list[Unit | SmallUnit | CompressedRecord] = [*_compressed_units(list(compressed.values()), threads)]
    templates = TemplateCache()  # one per read: a record of each shape is parsed once, not per unit
    units += _units(fast, threads, templates)
    units += small_units(small or {}, threads, templates)
    cancel = threading.Event()
    if units:
        with cf.ThreadPoolExecutor(
            max_workers=min(threads, len(units)), thread_name_prefix="parallel_dcp-read"
        ) as pool:
            pending = {
                pool.submit(unit.run, where, cancel, io)
                if isinstance(unit, (Unit, SmallUnit))
                else pool.submit(unit.run, where, cancel)
                for unit in units
            }
            try:
                while pending:
                    done, pending = cf.wait(pending, timeout=_TICK_S, return_when=cf.FIRST_EXCEPTION)
                    for future in done:
                        part, more = future.result()
                        stats.add(part)
                        slow.extend(more)
                    if on_tick is not None:
                        on_tick()
            except BaseException:
                cancel.set()
                for future in pending:
                    future.cancel()
                raise
    try:
        _fallback(where, slow, stats, on_bytes, budget)
    except FileNotFoundError as exc:  # DCP's reader opens shards by name: one vanished meanwhile
        raise vanished(exc.filename or where) from None
    return stats


def _fallback(
    where: Location,
    slow: list[Request],
    stats: ReadStats,
    on_bytes: Callable[[ReadItem, bytes], None],
    budget: MemoryGovernor | None,
) -> None:
    """DCP's own reader for what the fast path does not serve, one record at a time."""
    if not slow:
        return
    reader = bounded_reader(where)
    reader.storage_data = {req.item.storage_index: req.info for req in slow}
    targets = {id(req.item): req.target for req in slow if req.target is not None}
    sink = _Sink(targets, on_bytes)
    for req in slow:
        key = req.item.storage_index.fqn
        if req.target is not None and budget is not None:
            # DCP holds the whole stored chunk and its copy
            budget.check_item(key, 2 * int(req.info.length) + 2 * req.target.nbytes)
        elif budget is not None:
            # A value is read whole, then unpickled: admitted by its record's length before any
            # byte is read (a crafted length is refused here, not allocated), and kept after.
            budget.check_item(key, 2 * int(req.info.length))
            budget.reserve(int(req.info.length), f"the value of {key!r}")
        with reading(where, [key]):
            reader.read_data(LoadPlan([req.item]), sink).wait()  # type: ignore[arg-type]
        if req.target is None:
            stats.values += 1
    tensors = [req for req in slow if req.target is not None and req.piece == 0]
    stats.fallback += len(tensors)
    stats.fallback_keys |= {req.item.storage_index.fqn for req in tensors}
