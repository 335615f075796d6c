"""``verify`` of a DCP checkpoint in one pass: every shard read once, hashed and its records checked.

    shard ── read in order, 4 MiB pieces (O_DIRECT where io says: no page cache) ──┬─ xxh3 of the file
                                                                                   └─ each record's first
                                                                                      and last 4 KiB kept
    after the file: size and checksum against the manifest; each tensor record parsed and checked
    against .metadata (dtype, shape, data inside the record), as a load checks it

The bytes between a record's head and tail are only hashed: the checksum is what proves them, as
the read-back of a load would only copy them. Used for uncompressed DCP checkpoints with a
manifest and without ``against`` (a comparison needs the values, a compressed record its frames).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from parallel_dcp.engine.partition import Task
from parallel_dcp.errors import CorruptCheckpointError, UnsafeCheckpointError, dtype_name
from parallel_dcp.formats.dcp_records import HEAD_BYTES, TAIL_BYTES, parse_record
from parallel_dcp.storage.direct_read import ShardFile
from parallel_dcp.storage.manifest import FileDigest, Hasher
from parallel_dcp.storage.pinned_paths import open_source

__all__ = ["StoredRecord", "one_pass_handler", "record_problems", "records_by_file", "size_change"]


@dataclass(slots=True)
class StoredRecord:
    """A tensor chunk's record in a shard, what ``.metadata`` says it holds, and (while its file
    is read) its first and last bytes."""

    key: str
    offset: int
    length: int
    dtype: Any
    size: tuple[int, ...]
    head: bytearray | None = None
    tail: bytearray | None = None


def records_by_file(metadata: Metadata) -> dict[str, list[StoredRecord]] | None:
    """Every tensor record by shard name, sorted by offset; None when a record is compressed (its
    frames must be decompressed to be checked: verify then reads keys back the usual way)."""
    found: dict[str, list[StoredRecord]] = {}
    for index, info in (metadata.storage_data or {}).items():
        if getattr(info, "transform_descriptors", None):
            return None
        meta = metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(meta, TensorStorageMetadata):
            continue  # a pickled value: loaded and checked by verify itself
        sizes = next((tuple(c.sizes) for c in meta.chunks if tuple(c.offsets) == tuple(index.offset or ())), None)
        if sizes is None:
            raise CorruptCheckpointError(f".metadata has no chunk of {index.fqn!r} at {index.offset}")
        record = StoredRecord(index.fqn, int(info.offset), int(info.length), meta.properties.dtype, sizes)
        found.setdefault(str(info.relative_path), []).append(record)
    for records in found.values():
        records.sort(key=lambda r: r.offset)
    return found


def _windows(records: list[StoredRecord]) -> list[tuple[int, int, bytearray]]:
    """(start, stop, buffer) of every record's head and tail, sorted by start."""
    windows = []
    for r in records:
        r.head = bytearray(min(r.length, HEAD_BYTES))
        r.tail = bytearray(min(r.length, TAIL_BYTES))
        windows.append((r.offset, r.offset + len(r.head), r.head))
        windows.append((r.offset + r.length - len(r.tail), r.offset + r.length, r.tail))
    windows.sort(key=lambda w: w[0])
    return windows


def _record_problem(name: str, r: StoredRecord) -> str | None:
    """What is wrong with record ``r`` of ``name`` (its head and tail read), or None."""
    assert r.head is not None and r.tail is not None
    try:
        layout = parse_record(memoryview(r.head), memoryview(r.tail), r.length)
    except ValueError as exc:
        return f"the record at byte {r.offset} of {name} is damaged: {exc}"
    if layout is None:
        return None  # valid, but not a plain tensor record: its checksum vouches for it
    if layout.dtype != r.dtype or layout.size != r.size:
        return (
            f"the record at byte {r.offset} of {name} holds {dtype_name(layout.dtype)} {list(layout.size)} but "
            f".metadata says {dtype_name(r.dtype)} {list(r.size)}"
        )
    if (layout.storage_offset + math.prod(r.size)) * layout.dtype.itemsize > layout.data_bytes:
        return f"the record at byte {r.offset} of {name} has fewer data bytes than its elements need"
    return None


def record_problems(directory: str, name: str, records: list[StoredRecord]) -> list[tuple[str, str]]:
    """(key, problem) for each of ``records`` of file ``name`` whose head and tail, read alone,
    disagree with ``.metadata`` (a checkpoint without checksums: stock's reader, which verify
    reads it back through, casts a record of another dtype into the one ``.metadata`` says)."""
    fd = open_source(os.path.join(directory, name))
    try:
        for start, stop, buffer in _windows(records):
            data = os.pread(fd, stop - start, start)
            buffer[: len(data)] = data
    finally:
        os.close(fd)
    found = [(r.key, problem) for r in records if (problem := _record_problem(name, r)) is not None]
    for r in records:
        r.head = r.tail = None
    return found


def size_change(found: int, recorded: int) -> str:
    """What a file's size against its recorded one suggests."""
    return "truncated?" if found < recorded else "bytes appended?"


def check_file(
    path: str, want: FileDigest, records: list[StoredRecord], io: str
) -> tuple[list[str], list[tuple[str, str]]]:
    """Read ``path`` once: (file problems, (key, problem) pairs)."""
    name = os.path.basename(path)
    try:
        shard = ShardFile(path, io=io)
    except UnsafeCheckpointError as exc:  # a symlink or a FIFO in its place: named, never read through
        return [f"file {name}: {exc}"], [(r.key, f"cannot be read: {name} is not a regular file") for r in records]
    except CorruptCheckpointError:
        return [f"file {name}: missing"], [(r.key, f"cannot be read: {name} is missing") for r in records]
    hasher = Hasher(checksum=want.digest is not None)
    windows = _windows(records)
    first = 0  # the first window not yet filled
    at = 0
    try:
        for piece in shard.stream():
            hasher.update(piece)
            stop = at + piece.nbytes
            while first < len(windows) and windows[first][1] <= at:
                first += 1
            for start, end, buffer in windows[first:]:
                if start >= stop:
                    break
                lo, hi = max(start, at), min(end, stop)
                if lo < hi:
                    buffer[lo - start : hi - start] = piece[lo - at : hi - at]
            at = stop
    except CorruptCheckpointError as exc:
        return [f"file {name}: {exc}"], []
    finally:
        shard.close()
    files: list[str] = []
    found = hasher.result()
    if found.size != want.size:
        files.append(
            f"file {name}: {found.size} bytes, the manifest records {want.size} ({size_change(found.size, want.size)})"
        )
    elif want.digest is not None and found.digest != want.digest:
        files.append(f"file {name}: checksum {found.digest} != {want.digest} recorded (corrupted)")
    keys = []
    for r in records:
        if r.offset + r.length > found.size:
            keys.append((r.key, f"cannot be read: {name} ends at byte {found.size} (truncated)"))
        elif (problem := _record_problem(name, r)) is not None:
            keys.append((r.key, problem))
        r.head = r.tail = None
    return files, keys


def one_pass_handler(
    directory: str | os.PathLike[str],
    recorded: dict[str, FileDigest],
    records: dict[str, list[StoredRecord]],
    io: str,
) -> Any:
    """The pool handler: a task's keys are file names; returns (file problems, key problems)."""

    def run(task: Task) -> tuple[list[str], list[tuple[str, str]]]:
        files: list[str] = []
        keys: list[tuple[str, str]] = []
        for name in task.keys:
            f, k = check_file(os.path.join(directory, name), recorded[name], records.get(name, []), io)
            files += f
            keys += k
        return files, keys

    return run
