"""The ``FileSystemWriter`` a save's workers use: one per task, writing the task's shard.

It writes stock DCP files (plain or compressed records); it differs from ``FileSystemWriter`` only in
what it reports.

Longer than 300 lines because the recording stream (hashing what is written, gathering small
writes, filling a pending tensor in place from the caller's memory) and the record writer that
feeds it share the shard's one stream and its state; split, each half would reach into the other.
"""

from __future__ import annotations

import io
import os
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystem,
    FileSystemWriter,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from parallel_dcp import _compat
from parallel_dcp.engine import progress
from parallel_dcp.storage import records
from parallel_dcp.storage.compression import DESCRIPTOR, Compression, RecordCompressor
from parallel_dcp.storage.direct_write import new_file
from parallel_dcp.storage.location import Remote, RemoteFileSystem
from parallel_dcp.storage.manifest import FileDigest, Hasher
from parallel_dcp.storage.pending import SCRATCH_BYTES, PendingTensor, scratch
from parallel_dcp.storage.read_ahead import StreamedTensor

__all__ = ["ShardWriter"]


# torch's zip writer makes ~40 small writes per record (headers, pickle, padding): they are
# gathered here and checksummed, written and counted together, which halves the per-record cost
# of a save of many small tensors.
_GATHER_BYTES = 64 * 1024
# Pieces of a large write: small enough to stay in a core's cache between the write and the hash.
_PIECE_BYTES = 1024 * 1024


class _RecordingStream:
    """A file that checksums what is written and remembers the OSError of a failed write
    before torch's zip writer hides it. Small writes are gathered; ``tell``, ``flush`` and
    ``fileno`` (which fsync uses) see them as written."""

    def __init__(self, stream: Any, owner: _Recording, hasher: Hasher) -> None:
        self._stream: Any = stream
        self._owner = owner
        self._hasher = hasher
        self._gathered = bytearray()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        if size < _GATHER_BYTES:
            self._gathered += view
            if len(self._gathered) >= _GATHER_BYTES:
                self.write_gathered()
            return size
        self.write_gathered()
        self._emit(view)
        return size

    def write_gathered(self) -> None:
        if self._gathered:
            gathered, self._gathered = self._gathered, bytearray()
            self._emit(memoryview(gathered))

    def _emit(self, view: memoryview) -> None:
        # A large record goes out in pieces, each hashed right after it is written, while it is
        # still in the cache: hashing the whole record after writing it read it from memory twice.
        for start in range(0, max(view.nbytes, 1), _PIECE_BYTES):
            piece = view[start : start + _PIECE_BYTES]
            try:
                self._stream.write(piece)
            except OSError as exc:
                self._owner.error = exc
                raise
            self._hasher.update(piece)
            progress.report(piece.nbytes)

    def write_filled(self, tensor: PendingTensor) -> None:
        """Write the bytes of ``tensor``, copied once by its ``fill``: straight into the aligned
        buffers of an O_DIRECT stream, else through this thread's reused scratch (a buffered
        stream copies into the page cache anyway); each piece hashed where it landed."""
        self.write_gathered()
        source_failed = False

        def fill(offset: int, n: int, at: int) -> None:
            nonlocal source_failed
            try:
                tensor.fill(offset, n, at)
            except OSError:
                source_failed = True  # the source's error, not the file system's
                raise

        direct = getattr(self._stream, "write_filled", None)
        try:
            if direct is not None:
                direct(tensor.nbytes, fill, self._done)
                return
            view, at = scratch()
            for offset in range(0, tensor.nbytes, SCRATCH_BYTES):
                n = min(SCRATCH_BYTES, tensor.nbytes - offset)
                fill(offset, n, at)
                self._stream.write(view[:n])
                self._done(view[:n])
        except OSError as exc:
            if not source_failed:
                self._owner.error = exc
            raise

    def _done(self, piece: memoryview) -> None:
        self._hasher.update(piece)
        progress.report(piece.nbytes)

    def tell(self) -> int:
        return int(self._stream.tell()) + len(self._gathered)

    def flush(self) -> None:
        self.write_gathered()
        self._stream.flush()

    def fileno(self) -> int:
        self.flush()  # whoever asks for the descriptor (os.fsync) must find every byte written
        return int(self._stream.fileno())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _Recording:
    """Mixed into a DCP file system: every stream it creates for writing is recorded."""

    checksums: bool
    error: OSError | None
    hashers: dict[str, Hasher]

    def start_recording(self, checksums: bool) -> None:
        self.checksums = checksums
        self.error = None
        self.hashers = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            raise ValueError(f"a shard writer only writes new files, not mode {mode!r}")
        hasher = self.hashers[os.path.basename(path)] = Hasher(checksum=self.checksums)
        with super().create_stream(path, mode) as stream:  # type: ignore[misc]
            recording = _RecordingStream(stream, self, hasher)
            yield recording  # type: ignore[misc]
            recording.write_gathered()


class _LocalRecording(_Recording, FileSystem):
    """Local files, recorded; each created new (never through a planted name: see
    :mod:`parallel_dcp.storage.safe_files`), with O_DIRECT when ``direct``."""

    direct = False

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            raise ValueError(f"a shard writer only writes new files, not mode {mode!r}")
        hasher = self.hashers[os.path.basename(path)] = Hasher(checksum=self.checksums)
        try:
            with new_file(path, direct=self.direct, buffering=_GATHER_BYTES) as stream:
                recording = _RecordingStream(stream, self, hasher)
                yield recording  # type: ignore[misc]
                recording.write_gathered()
        except OSError as exc:
            self.error = self.error or exc
            raise


class _RemoteRecording(_Recording, RemoteFileSystem):
    """Multipart uploads to object storage, recorded."""


class ShardWriter(_compat.NoExistingCheckpointProbe, FileSystemWriter):
    """Writes one task's shard file; a failed write is re-raised as the OSError that caused it.

    torch's zip writer turns a failed ``write`` (ENOSPC, EFBIG, EIO) into ``RuntimeError:
    unexpected pos ...``; :meth:`original_error` gives back what the file system said.

    On object storage (``path`` a :class:`Remote`) the shard is a multipart upload of parts sized
    for ``expected_bytes``; nothing is fsynced (an upload is durable once it completes).

    With ``compression``, every record (values and tensors) is one zstd frame, as stock's
    ``ZStandard`` extension writes it (see :mod:`parallel_dcp.storage.compression`).

    With ``direct`` (local files), the shard is written with O_DIRECT through aligned buffers
    (:class:`~parallel_dcp.storage.direct_write.DirectFile`): the same bytes, no page cache.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Remote,
        *,
        sync_files: bool,
        checksums: bool = True,
        expected_bytes: int = 0,
        compression: Compression | None = None,
        direct: bool = False,
    ) -> None:
        remote = isinstance(path, Remote)
        self.compression = compression
        if compression is not None:
            _compat.check_transform_descriptors()
        super().__init__(str(path), sync_files=sync_files and not remote, thread_count=1)
        self._recording: _Recording
        if isinstance(path, Remote):
            recording = _RemoteRecording(path.options, expected_bytes)
            self.path = path.url
        else:
            recording = _LocalRecording()  # type: ignore[assignment]
            recording.direct = direct  # type: ignore[attr-defined]
        recording.start_recording(checksums)
        self._recording = recording
        self.fs = recording  # type: ignore[assignment]

    def original_error(self) -> OSError | None:
        return self._recording.error

    def descriptors(self) -> list[str] | None:
        """What each record's ``_StorageInfo.transform_descriptors`` says (None: uncompressed)."""
        return [DESCRIPTOR] if self.compression is not None else None

    def digests(self) -> dict[str, FileDigest]:
        """Size and checksum of every file written, by file name."""
        return {name: hasher.result() for name, hasher in self._recording.hashers.items()}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write the plan as one file, laid out as ``FileSystemWriter`` (one thread) lays it out
        (see :meth:`write_records`)."""
        serialization = getattr(self, "serialization_format", None)
        transforms = getattr(self, "transforms", None)
        if (serialization is not None and serialization.name != "TORCH_SAVE") or getattr(transforms, "extensions", ()):
            return super().write_data(plan, planner)
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        values = [item for item in plan.items if item.type == WriteItemType.BYTE_IO]
        tensors = [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
        placed = self.write_records(
            name,
            [planner.resolve_data(item) for item in values],  # type: ignore[misc]
            [planner.resolve_data(item) for item in tensors],  # type: ignore[misc]
        )
        future: Future[list[WriteResult]] = Future()
        descriptors = self.descriptors()
        future.set_result(
            [_result(item, name, *at, descriptors) for item, at in zip(values + tensors, placed, strict=True)]
        )
        return future

    def write_records(
        self, name: str, values: list[io.BytesIO], tensors: list[torch.Tensor | StreamedTensor | PendingTensor]
    ) -> list[tuple[int, int]]:
        """Write file ``name``: each value (already serialized), then each tensor as one torch.save
        record, as DCP writes them; the (offset, length) of each, values first.

        A tensor whose storage holds more than its elements is cloned first, as DCP does; tensors of
        the cases :mod:`parallel_dcp.storage.records` knows are written from a cached record template.
        A :class:`~parallel_dcp.storage.read_ahead.StreamedTensor` is written from its template and
        the source's bytes (never compressed). A :class:`PendingTensor` (another process's tensor)
        is copied once, straight into the stream's buffer (:meth:`_RecordingStream.write_filled`),
        between its class's template. With compression, each record goes through its own zstd
        frame, a piece at a time; offsets and lengths are those of the stored (compressed) bytes.
        """
        placed: list[tuple[int, int]] = []
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            compressor = RecordCompressor(stream, self.compression) if self.compression is not None else None
            for value in values:
                offset = stream.tell()
                if compressor is None:
                    stream.write(value.getbuffer())
                else:
                    with compressor.record(value.getbuffer().nbytes) as out:
                        out.write(value.getbuffer())
                placed.append((offset, stream.tell() - offset))
            for tensor in tensors:
                if isinstance(tensor, PendingTensor):
                    pending = tensor
                    template = records.class_template(pending.dtype, pending.shape, pending.strides)
                    if template is not None:
                        offset = stream.tell()
                        if compressor is None:
                            stream.write(template.prefix)
                            stream.write_filled(pending)  # type: ignore[attr-defined]  # a _RecordingStream
                            stream.write(template.suffix)
                        else:
                            with compressor.record(template.size()) as out:
                                out.write(template.prefix)
                                _write_through_scratch(out, pending)
                                out.write(template.suffix)
                        placed.append((offset, stream.tell() - offset))
                        continue
                    tensor = pending.materialize()  # a class torch.save must write (its source charges it)
                if isinstance(tensor, StreamedTensor):  # its bytes come from the source file, read ahead
                    if compressor is not None:
                        raise ValueError("a streamed record is written uncompressed")
                    offset = stream.tell()
                    tensor.write_record(stream)
                    placed.append((offset, stream.tell() - offset))
                    continue
                tensor = tensor.detach().cpu()
                if tensor.untyped_storage().nbytes() != tensor.nbytes:
                    tensor = tensor.clone()  # never write more than the tensor's elements
                offset = stream.tell()
                template = records.template_for(tensor)
                if compressor is None:
                    _write_record(stream, tensor, template)
                else:
                    with compressor.record(template.size() if template is not None else None) as out:
                        _write_record(out, tensor, template)
                placed.append((offset, stream.tell() - offset))
            if self.sync_files:
                os.fsync(stream.fileno())
        return placed


def _write_through_scratch(stream: Any, tensor: PendingTensor) -> None:
    """``tensor``'s bytes into ``stream`` (a record's compressor), a scratch's worth at a time."""
    view, at = scratch()
    for offset in range(0, tensor.nbytes, SCRATCH_BYTES):
        n = min(SCRATCH_BYTES, tensor.nbytes - offset)
        tensor.fill(offset, n, at)
        stream.write(view[:n])


def _write_record(stream: Any, tensor: torch.Tensor, template: records.Template | None) -> None:
    """One tensor's torch.save record: from its class's template where there is one."""
    if template is None:
        torch.save(tensor, _NoClose(stream))  # type: ignore[arg-type]
    else:
        stream.write(template.prefix)
        stream.write(records.storage_bytes(tensor))
        stream.write(template.suffix)


class _NoClose:
    """The stream torch.save writes one record to: it must not close the shard file."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, data: Any) -> int:
        return int(self._stream.write(data))

    def flush(self) -> None:
        """The shard's stream flushes when the shard is done."""


def _result(item: WriteItem, name: str, offset: int, length: int, descriptors: list[str] | None) -> WriteResult:
    info = _compat.storage_info(name, offset, length, descriptors)
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=info)
