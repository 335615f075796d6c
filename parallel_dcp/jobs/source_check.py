"""A conversion checks its source's bytes against the checksums the source carries, as it reads them.

    coordinator: source_checks(job) ── the files whose checksums the source carries (a DCP or
      │   sharded directory's .parallel_dcp.json, a torch.save file's NAME.manifest.json, a
      │   safetensors file's own header: jobs/verify_files.py, the records verify reads), each
      │   with the keys stored in it; a safetensors header that is not the one recorded: refused here
      ▼
    worker, before a task reads its units: every recorded file all of whose tensors the task
      │   reads whole ── hashed in one sequential pass (xxh3-64, 1 MiB pieces, as verify hashes it),
      │   the task's first read of those bytes: the format's own reads that follow (torch.load,
      │   safetensors' mmap, DCP's records) find them in the page cache, so storage is read once
      ▼
    a mismatch: SourceChecksumError naming the file; the pipeline discards everything the job
    wrote (no finished task is kept for resume: a resume would read the same damaged bytes)

Whole-file checksums cannot be split: xxh3 of a file is not made of the digests of its parts, and
a task that reads some of a file's tensors reads only their bytes. So a file is checked only where
one task reads all of its tensors (a small checkpoint, or a shard of a few large tensors); a file
whose tensors several tasks share, a tensor split into row ranges, a selection (``--keys``) that
leaves some of a file's tensors out, and files read with O_DIRECT (where the page cache would not
hold what the hash pass read: a second read of storage) or from object storage are not checked.
docs/guarantees.md says the same.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from parallel_dcp.errors import CorruptCheckpointError, SourceChecksumError, SourceNotCheckedWarning, WorkerError
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.dcp_format import DcpSource
from parallel_dcp.formats.renamed_source import RenamedSource
from parallel_dcp.formats.safetensors_format import SafetensorsSource
from parallel_dcp.formats.torch_format import TorchSource
from parallel_dcp.jobs.verify_files import recorded_checksums
from parallel_dcp.storage.location import Remote
from parallel_dcp.storage.manifest import FileDigest
from parallel_dcp.storage.safe_reader import open_bounded

__all__ = ["CheckedFile", "SourceChecks", "as_source_error", "check_task", "source_checks"]

# The hash pass reads through one buffer of this size per task (inside a task's fixed allowance).
_PIECE = 1024 * 1024
_ADVICE = "restore it (or convert anyway with --no-source-checks, check_source=False)"


@dataclass(frozen=True, slots=True)
class CheckedFile:
    """One source file with a recorded checksum: its path, the bytes the checksum covers (from
    ``start`` on), the record, and the source keys whose bytes lie in it."""

    path: str
    start: int
    digest: FileDigest
    keys: frozenset[str]
    record: str  # where the checksum was recorded, for the error


@dataclass(frozen=True, slots=True)
class SourceChecks:
    """What a conversion's workers check: the recorded files, and how the job's units name the
    source keys (a renamed source: new name -> old)."""

    files: tuple[CheckedFile, ...]
    source: Source  # the source as opened (job.source may be a renamed view of it)
    old_names: dict[str, str] | None = None

    def due(self, units: Iterable[str], chunks: Mapping[str, Any]) -> list[CheckedFile]:
        """The files whose every key is among ``units`` read whole (not one of ``chunks``)."""
        whole = {unit for unit in units if unit not in chunks}
        if self.old_names is not None:
            whole = {self.old_names.get(unit, unit) for unit in whole}
        # (the read choice may have set the source to O_DIRECT reads after this was planned)
        direct = _direct_files(self.source)
        return [f for f in self.files if f.keys and f.keys <= whole and os.path.basename(f.path) not in direct]


def source_checks(view: Source, source: Source) -> SourceChecks | None:
    """In the coordinator, before any worker starts: what a job reading ``view`` (``source`` as
    opened, or a view of it) can check as it reads; None when the source carries no checksums or is read
    in a way no task can check (object storage, O_DIRECT, a dequantizing or quantizing view).

    Raises:
        SourceChecksumError: a single safetensors file whose header is not the one recorded.
        CorruptCheckpointError: a record exists but cannot be read.
    """
    old_names: dict[str, str] | None = None
    if isinstance(view, RenamedSource) and view.inner is source:
        old_names = dict(view.old_names)
    elif view is not source:
        return None
    if isinstance(source.location, Remote) or not isinstance(source, (DcpSource, SafetensorsSource, TorchSource)):
        return None
    try:
        recorded = recorded_checksums(source)
    except CorruptCheckpointError as exc:
        # A record that cannot be read (by the one rule: a Hugging Face cache snapshot's record is
        # a link into its blobs; or another tool's "parallel_dcp" header entry) proves nothing
        # about the data: converted unchecked, and said so (verify reports the record).
        warnings.warn(f"{source.path}: not checked against its checksums: {exc}", SourceNotCheckedWarning, stacklevel=2)
        return None
    if recorded is None:
        return None
    record = _record_name(source)
    if recorded.problems:  # the safetensors header differs from the one recorded (read on open)
        raise SourceChecksumError(f"{source.path}: {recorded.problems[0]}; {_ADVICE}")
    stored = _keys_by_file(source)
    written = _record_written(source, record, recorded.directory)
    named = [(name, digest) for name, digest in recorded.files.items() if digest.digest is not None and name in stored]
    stale = [name for name, _ in named if _changed_since(recorded.directory / name, written)]
    if stale:
        warnings.warn(
            f"{source.path}: not checked against its checksums: {', '.join(stale[:3])}"
            f"{f' and {len(stale) - 3} more' if len(stale) > 3 else ''} changed after {record} was written "
            "(rewritten by another program: the record is stale)",
            SourceNotCheckedWarning,
            stacklevel=2,
        )
    files = tuple(
        CheckedFile(os.fspath(recorded.directory / name), recorded.starts.get(name, 0), digest, stored[name], record)
        for name, digest in named
        if name not in stale
    )
    return SourceChecks(files, source, old_names) if files else None


def _record_written(source: Source, record: str, directory: Any) -> int | None:
    """When a sidecar record was last written (ns), None for a header's own (written with the file)."""
    if source.kind == "safetensors" and not source.location.is_dir():
        return None
    try:
        return os.lstat(directory / record).st_mtime_ns
    except OSError:
        return None


def _changed_since(path: Any, written: int | None) -> bool:
    """A file modified after its sidecar record was written (a training loop's torch.save over
    ``model.pt``, ``save_pretrained`` over a shard) is not what the record describes: the record
    is stale, not the file damaged. Our writers write each file before its record; a flipped bit
    on the device changes no modification time."""
    if written is None:
        return False
    try:
        return os.lstat(path).st_mtime_ns > written
    except OSError:
        return False


def _record_name(source: Source) -> str:
    if source.location.is_dir():
        return ".parallel_dcp.json"
    if source.kind == "safetensors":
        return "its header"
    return f"{source.location.name}.manifest.json"


def _keys_by_file(source: Source) -> dict[str, frozenset[str]]:
    """Each file's name (as the manifest records it) -> the keys whose bytes lie in it."""
    found: dict[str, set[str]] = {}
    if isinstance(source, DcpSource):
        assert source.metadata is not None
        for index, info in (source.metadata.storage_data or {}).items():
            found.setdefault(str(info.relative_path), set()).add(index.fqn)
    else:
        for key, entry in source.entries.items():
            found.setdefault(os.path.basename(entry.file), set()).add(key)
    return {name: frozenset(keys) for name, keys in found.items()}


def _direct_files(source: Source) -> set[str]:
    """Files read with O_DIRECT, past the page cache: hashing them first would read storage twice."""
    if not isinstance(source, SafetensorsSource):
        return set()
    return {os.path.basename(file) for file in source.direct_files()}


def check_task(checks: SourceChecks | None, units: Iterable[str], chunks: Mapping[str, Any]) -> None:
    """In a worker, before the task reads ``units`` (``chunks``: the units that are row ranges of
    a tensor): hash every recorded file it reads whole.

    Raises:
        SourceChecksumError: a file's bytes are not the ones its checksum was taken of.
    """
    if checks is None:
        return
    for checked in checks.due(units, chunks):
        hasher = xxhash.xxh3_64()  # (not manifest.Hasher: that one counts what an output hashes)
        size = 0
        buffer = bytearray(_PIECE)
        view = memoryview(buffer)
        with open_bounded(checked.path) as stream:
            stream.seek(checked.start)
            while n := stream.readinto(buffer):
                hasher.update(view[:n])
                size += n
        found = FileDigest(size, hasher.hexdigest())
        if found != checked.digest:
            what = (
                f"{found.size} bytes where {checked.digest.size} were recorded"
                if found.size != checked.digest.size
                else f"xxh3_64 {found.digest}, not the {checked.digest.digest} recorded"
            )
            raise SourceChecksumError(
                f"{checked.path}: its bytes are not the ones its checksum in {checked.record} was taken of "
                f"({what}): the source is damaged; {_ADVICE}"
            )


def as_source_error(failure: BaseException) -> BaseException:
    """A source mismatch a worker found, as the caller sees it: the worker's own error (naming the
    file), not a WorkerError around it; any other failure as it is."""
    if isinstance(failure, WorkerError) and failure.error_type == SourceChecksumError.__qualname__:
        message = str(failure).split(": ", 1)[1].rsplit(" (task ", 1)[0]
        error = SourceChecksumError(message)
        error.__cause__ = failure
        return error
    return failure
