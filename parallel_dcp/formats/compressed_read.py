"""Compressed (zstd) DCP records, decompressed in bounded pieces straight into their targets.

    stored record (one zstd frame: transform_descriptors == ["stream.zstd/1"])
      │ BoundedDecompressor: stored bytes read 1 MiB at a time; never more out than .metadata allows
      ▼
    head (4 KiB): parse_head predicts dtype, shape, where the tensor's bytes start
      │ plain row-major tensor, one read item covering it, a dense CPU target of its dtype:
      │     decompressed straight into the target's memory
      │ otherwise: into a staging tensor of the stored chunk, then each region copied out
      │ not a plain tensor record: the whole record (bounded) through torch.load(weights_only)
      ▼
    the rest of the frame (at most RECORD_OVERHEAD): parse_record checks the whole record
    (central directory) against the prediction; the frame must end where .metadata says

A record holding more than ``.metadata`` says (a decompression bomb), a truncated one and a damaged
frame are each a :class:`CorruptCheckpointError` naming the key, raised before anything past the
bound is allocated. Pickled values have no size in ``.metadata``: they are bounded by
``ZSTD_VALUE_MAX_BYTES``.

:class:`BoundedReader` is DCP's ``FileSystemReader`` with these records served here (what
``partial_load`` uses: convert, verify, the process path of load); :mod:`parallel_dcp.fast_read`
runs :class:`CompressedRecord` on its reading threads.

Longer than 300 lines because both read paths (whole small records, streamed large ones), their
checks against ``.metadata`` and the two readers that drive them share one set of rules.
"""

from __future__ import annotations

import ctypes
import io
import math
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from parallel_dcp.engine import progress
from parallel_dcp.engine.memory import ZSTD_SMALL_RECORD_BYTES, ZSTD_VALUE_MAX_BYTES
from parallel_dcp.errors import CorruptCheckpointError, dtype_name
from parallel_dcp.formats.dcp_records import HEAD_BYTES, RecordLayout, is_row_major, parse_head, parse_record
from parallel_dcp.formats.read_units import ReadStats
from parallel_dcp.storage.compression import (
    BoundedDecompressor,
    check_descriptors,
    decompress_small,
    is_compressed,
    new_decompressor,
)
from parallel_dcp.storage.location import Location, Remote, RemoteFileSystem
from parallel_dcp.storage.safe_reader import SafeFileSystem

__all__ = ["RECORD_OVERHEAD", "BoundedReader", "CompressedRecord", "bounded_reader", "read_value"]

# What a tensor's torch.save record holds beside the tensor's bytes (zip headers, data.pkl,
# alignment padding, central directory: ~1 KiB); anything beyond this is a decompression bomb.
RECORD_OVERHEAD = 64 * 1024
# A record that decompresses to at most this is read whole and decompressed in one call (the
# per-record cost of a stream matters for small tensors); larger ones stream into their targets.
SMALL_DECOMPRESSED = ZSTD_SMALL_RECORD_BYTES


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The memory of a dense CPU tensor, writable, without a copy."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _region(stored: torch.Tensor, item: ReadItem) -> torch.Tensor:
    region = stored
    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        region = region.narrow(dim, int(start), int(length))
    return region


def _corrupt(shard: Location, key: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{shard}: the compressed record of {key!r} {what}")


def read_value(where: Location, info: Any, key: str) -> bytes:
    """A compressed pickled value's bytes (at most ``ZSTD_VALUE_MAX_BYTES``)."""
    check_descriptors(info, key)
    shard = where / str(info.relative_path)
    with BoundedDecompressor(shard, int(info.offset), int(info.length), key, ZSTD_VALUE_MAX_BYTES) as source:
        return source.finish(ZSTD_VALUE_MAX_BYTES)


def read_record(
    where: Location,
    info: Any,
    key: str,
    chunk: Sequence[int],
    dtype: torch.dtype,
    requests: Sequence[tuple[ReadItem, torch.Tensor]],
    decompressor: Any = None,
) -> None:
    """Decompress one stored tensor record (stored chunk ``chunk`` of ``dtype``) and fill each
    (read item, target) region of it.

    Raises:
        CorruptCheckpointError: a truncated record, a damaged frame, a bomb, or a record that
            contradicts ``.metadata``.
    """
    check_descriptors(info, key)
    shard = where / str(info.relative_path)
    chunk = tuple(int(n) for n in chunk)
    nbytes = math.prod(chunk) * dtype.itemsize
    bound = nbytes + RECORD_OVERHEAD
    if bound <= SMALL_DECOMPRESSED:
        record = decompress_small(shard, int(info.offset), int(info.length), key, bound, decompressor)
        _serve_small(shard, key, record, chunk, dtype, requests)
        return
    with BoundedDecompressor(shard, int(info.offset), int(info.length), key, bound) as source:
        head = source.read_up_to(HEAD_BYTES)
        try:
            layout = parse_head(memoryview(head))
        except ValueError as exc:
            if len(head) < HEAD_BYTES:  # the frame ended (or stopped decoding) early
                what = f"ends after {len(head)} decompressed bytes (truncated record or damaged frame)"
                raise _corrupt(shard, key, what) from exc
            raise _corrupt(shard, key, f"is not a tensor record: {exc}") from exc
        plain = (
            layout is not None
            and layout.storage_offset == 0
            and layout.data_bytes == nbytes
            and is_row_major(layout.size, layout.stride)
        )
        if layout is None or not plain:
            stored = _load_whole(shard, key, head + source.finish(bound - len(head)), chunk, dtype)
            for item, target in requests:
                target.copy_(_region(stored, item))
            return
        if layout.dtype != dtype or layout.size != chunk:
            raise _corrupt(
                shard,
                key,
                f"holds {dtype_name(layout.dtype)} {list(layout.size)} but .metadata says "
                f"{dtype_name(dtype)} {list(chunk)}",
            )
        item, target = requests[0]
        direct = (
            len(requests) == 1
            and tuple(item.lengths) == chunk
            and not any(item.storage_offsets)
            and target.device.type == "cpu"
            and target.dtype == dtype
            and target.is_contiguous()
        )
        into = target if direct else torch.empty(chunk, dtype=dtype)
        _fill(source, head, layout, _bytes_of(into), shard, key)
        if not direct:
            for item, target in requests:
                target.copy_(_region(into, item))
    progress.report(nbytes)


def _serve_small(
    shard: Location,
    key: str,
    record: bytes,
    chunk: tuple[int, ...],
    dtype: torch.dtype,
    requests: Sequence[tuple[ReadItem, torch.Tensor]],
) -> None:
    """A record decompressed whole (small): checked by :func:`parse_record`, then copied out."""
    view = memoryview(record)
    try:
        layout = parse_record(view, view, len(record))
    except ValueError as exc:
        raise _corrupt(shard, key, f"is damaged: {exc}") from exc
    nbytes = math.prod(chunk) * dtype.itemsize
    if layout is None or layout.storage_offset != 0 or not is_row_major(layout.size, layout.stride):
        stored = _load_whole(shard, key, record, chunk, dtype)
    else:
        if layout.dtype != dtype or layout.size != chunk or layout.data_bytes != nbytes:
            raise _corrupt(
                shard,
                key,
                f"holds {dtype_name(layout.dtype)} {list(layout.size)} but .metadata says "
                f"{dtype_name(dtype)} {list(chunk)}",
            )
        stored = torch.empty(chunk, dtype=dtype)
        _bytes_of(stored)[:] = view[layout.data_offset : layout.data_offset + nbytes]
    for item, target in requests:
        target.copy_(_region(stored, item))
    progress.report(nbytes)


def _fill(
    source: BoundedDecompressor, head: bytes, layout: RecordLayout, dest: memoryview, shard: Location, key: str
) -> None:
    """Decompress the tensor's bytes into ``dest``, then check the whole record against ``layout``."""
    start, nbytes = layout.data_offset, layout.data_bytes
    if len(head) < start:  # the storage's header ran past the first read
        head += source.read_up_to(start - len(head))
        if len(head) < start:
            raise _corrupt(shard, key, "ends before its tensor's bytes (truncated record)")
    in_head = head[start : start + nbytes]
    dest[: len(in_head)] = in_head
    if len(in_head) < nbytes:
        source.readinto(dest[len(in_head) :])
    rest = head[start + nbytes :] + source.finish(RECORD_OVERHEAD)
    total = start + nbytes + len(rest)
    try:
        whole = parse_record(memoryview(head[:start]), memoryview(rest), total)
    except ValueError as exc:
        raise _corrupt(shard, key, f"is damaged: {exc}") from exc
    if whole != layout:
        raise _corrupt(shard, key, "does not match what its head announced (damaged record)")


def _load_whole(shard: Location, key: str, record: bytes, chunk: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A record that is not a plain tensor: torch.load with ``weights_only``, checked."""
    try:
        loaded = torch.load(io.BytesIO(record), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise _corrupt(shard, key, f"cannot be loaded: {type(exc).__name__}: {exc}") from exc
    if not isinstance(loaded, torch.Tensor) or loaded.dtype != dtype or tuple(loaded.shape) != chunk:
        what = (
            f"{dtype_name(loaded.dtype)} {list(loaded.shape)}"
            if isinstance(loaded, torch.Tensor)
            else type(loaded).__name__
        )
        raise _corrupt(shard, key, f"holds {what} but .metadata says {dtype_name(dtype)} {list(chunk)}")
    return loaded


class CompressedRecord:
    """Compressed records (each a list of the requests it serves), run one after the other on a
    reading thread of :func:`parallel_dcp.fast_read.read_requests` (same interface as its units)."""

    def __init__(self, records: list[list[Any]]) -> None:
        self.records = records  # per stored record: its fast_read.Requests

    def work(self) -> int:
        return sum(int(r.target.numel() * r.target.element_size()) for reqs in self.records for r in reqs)

    def run(self, where: Location, cancel: threading.Event) -> tuple[ReadStats, list[Any]]:
        stats = ReadStats()
        decompressor = new_decompressor()  # one context for the unit: a small record costs less
        for requests in self.records:
            if cancel.is_set():
                return stats, []
            first = requests[0]
            assert first.dtype is not None
            read_record(
                where,
                first.info,
                first.item.storage_index.fqn,
                first.chunk,
                first.dtype,
                [(r.item, r.target) for r in requests],
                decompressor,
            )
            stats.compressed += sum(r.piece == 0 for r in requests)
        stats.bytes += self.work()
        return stats, []


class BoundedReader(FileSystemReader):
    """DCP's ``FileSystemReader``; compressed records are decompressed here, bounded, instead of
    whole into a ``BytesIO`` (stock), one record at a time."""

    def __init__(self, location: Location) -> None:
        super().__init__(location.url if isinstance(location, Remote) else location)
        self.where = location
        self._metadata: Metadata | None = None
        if isinstance(location, Remote):
            self.fs = RemoteFileSystem(location.options)  # type: ignore[assignment]
            self.path = location.url
        else:  # shards opened by the one rule (stock: Path.open, through any planted symlink)
            self.fs = SafeFileSystem()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        compressed = [i for i in plan.items if is_compressed(self.storage_data.get(i.storage_index))]
        others = [i for i in plan.items if not is_compressed(self.storage_data.get(i.storage_index))]
        if others:
            super().read_data(LoadPlan(others), planner).wait()
        records: dict[tuple[str, int], list[ReadItem]] = {}
        for item in compressed:
            info = self.storage_data[item.storage_index]
            if item.type == LoadItemType.BYTE_IO:
                data = read_value(self.where, info, item.storage_index.fqn)
                planner.load_bytes(item, io.BytesIO(data))
            else:
                records.setdefault((str(info.relative_path), int(info.offset)), []).append(item)
        for items in records.values():
            first = items[0]
            if any(item.storage_index != first.storage_index for item in items):  # one record, one chunk
                raise CorruptCheckpointError(
                    f"{self.where}: .metadata points {first.storage_index.fqn!r} and another key at one record"
                )
            chunk, dtype = self._chunk(first)
            targets = [(item, planner.resolve_tensor(item).detach()) for item in items]
            read_record(
                self.where, self.storage_data[first.storage_index], first.storage_index.fqn, chunk, dtype, targets
            )
            for item, target in targets:
                planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _chunk(self, item: ReadItem) -> tuple[tuple[int, ...], torch.dtype]:
        assert self._metadata is not None
        index = item.storage_index
        meta = self._metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(meta, TensorStorageMetadata):
            raise CorruptCheckpointError(f"{self.where}: .metadata holds no tensor {index.fqn!r}")
        for stored in meta.chunks:
            if tuple(stored.offsets) == tuple(index.offset or ()):
                return tuple(stored.sizes), meta.properties.dtype
        raise CorruptCheckpointError(f"{self.where}: .metadata has no chunk of {index.fqn!r} at {index.offset}")


def bounded_reader(location: Location) -> BoundedReader:
    """The reader every ``partial_load`` of a DCP checkpoint uses (local or object storage)."""
    return BoundedReader(location)
