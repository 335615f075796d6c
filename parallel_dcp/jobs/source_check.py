"""A conversion checks its source's bytes against the checksums the source carries, as it reads them.

    coordinator: source_checks(job) ── the files whose checksums the source carries (a DCP or
      │   sharded directory's .parallel_dcp.json, a torch.save file's NAME.manifest.json, a
      │   safetensors file's own header: jobs/verify_files.py, the records verify reads), each
      │   with the keys stored in it; a safetensors header that is not the one recorded: refused here
      ▼
    coordinator, once the tasks are planned: plan_checks ── every recorded file that any task
      │   reads any bytes of (a tensor whole, a row range of one, one key of a --keys selection)
      │   goes to exactly one of the tasks that read it (the least loaded, counting the hashing:
      │   a file one task reads all of stays with that task), whose memory gains the pass's buffer
      │   (SOURCE_CHECK_BYTES: admission and the dry run count it)
      ▼
    worker, before a task reads its units: each file it was given ── hashed whole in one
      │   sequential pass (xxh3-64, 1 MiB pieces, as verify hashes it); the format's reads that
      │   follow (torch.load, safetensors' mmap, DCP's records), this task's and the others',
      │   find the bytes in the page cache, so storage is read once (where it holds the file)
      ▼
    the commit runs only once every task, so every file's verdict, is in; a mismatch:
    SourceChecksumError naming the file; the pipeline discards everything the job wrote (no
    finished task is kept for resume, not even a resumed run's: a task finished before the verdict
    may have read the damaged bytes)

A file modified after its sidecar record was written is hashed like the others: a rewrite on
purpose (a training loop's torch.save over model.pt) leaves it so, but so does every copy that
does not keep modification times (cp without -p, a download, s3 cp), damaged or not. Its
mismatch says both (a stale record: --no-source-checks; or damage: restore it), never "damaged"
alone. So does any mismatch of a safetensors file's own header record: stock safetensors keeps it
in a rewrite (save_file(..., metadata=f.metadata())). A single file named through a symlink is
checked as the file it leads to, which every read of it reads: its record is that file's
(recorded_checksums resolves the name once), and the hash pass opens the resolved path; so is a
Hugging Face folder's shard that links within its tree (_files_read). A mismatch names both (the
name given, the file read: "LINK -> PATH"); a sidecar beside a link's name alone is warned of,
not used (verify_files.record_beside_link). A file of a Hugging Face cache reached through the
user's own link is checked against the snapshot's record (the snapshot's link on the way decides),
and its mismatch says both that its uploader may have left the record stale and how to download it
again (blob times say only when the download wrote each). A folder's file that its record does not
list is checked against its own record, else named in a warning; its recorded index changed is refused.
The files a conversion copies beside the weights are checked against the same record by
jobs/side_file_checks.py (with the message of :func:`changed_file`).

Whole-file checksums cannot be split: xxh3 of a file is not made of the digests of its parts, so
a file whose tensors several tasks share (or split into row ranges) is hashed whole by one of them
while the others read their parts. A selection (``--keys``) that reads only some of a file's
tensors hashes the whole file anyway: only the bytes read need to be right, but a damaged file
should not convert silently (and the file is refused even where the damage lies outside the
selection). Not checked, since that would read the source a second time: files read with O_DIRECT
(the page cache would not hold what the hash pass read; under io="auto" a checked safetensors
source keeps the mmap for that reason: jobs/streamed.py) and files on object storage, each named in
a SourceNotCheckedWarning; nor dequantizing or quantizing views. docs/guarantees.md says the same.

Longer than 300 lines because which files a source records, which task hashes each, and the hash
pass are one contract, kept together so that a reader sees every file either checked or warned of.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from parallel_dcp.engine.memory import format_bytes
from parallel_dcp.engine.partition import Task
from parallel_dcp.errors import (
    CorruptCheckpointError,
    SourceChecksumError,
    SourceNotCheckedWarning,
    UnsafeCheckpointError,
    WorkerError,
)
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.dcp_format import DcpSource
from parallel_dcp.formats.renamed_source import RenamedSource
from parallel_dcp.formats.safetensors_format import SafetensorsSource
from parallel_dcp.formats.torch_format import TorchSource
from parallel_dcp.jobs.unrecorded import index_name, index_read, unrecorded_files, with_own_records
from parallel_dcp.jobs.verify_files import Recorded, links_within, record_beside_link, recorded_checksums, shown_as
from parallel_dcp.storage.location import Remote
from parallel_dcp.storage.manifest import MANIFEST_FILE, FileDigest, file_digest
from parallel_dcp.storage.safe_files import hub_cache_repo, resolve_in_tree
from parallel_dcp.storage.safe_reader import open_bounded

__all__ = [
    "SOURCE_CHECK_BYTES",
    "CheckedFile",
    "SourceChecks",
    "as_source_error",
    "changed_file",
    "check_task",
    "plan_checks",
    "refuse_by_records",
    "source_checks",
    "warn_unchecked_direct",
]

# The hash pass reads through one buffer of this size: a task given files to hash holds it beside
# its reads, so plan_checks adds it to that task's memory (admission and the dry run count it).
SOURCE_CHECK_BYTES = 1024 * 1024
_ADVICE = "(or convert anyway with --no-source-checks, check_source=False)"
# A safetensors file's own record travels with its header: stock safetensors keeps it in a rewrite
# (safe_open, edit, save_file(..., metadata=f.metadata())), so other bytes under it need not be damage.
_HEADER_KEPT = (
    'either a program rewrote it keeping its "parallel_dcp" metadata entry (safetensors\' '
    "save_file(..., metadata=f.metadata()) keeps it)"
)
# A file of a Hugging Face cache is a blob as downloaded: its time says when the download wrote it,
# not whether it changed since its record, and a record its uploader left stale is downloaded too.
_UPLOADED_STALE = (
    "either its uploader replaced it on the hub and not its record (downloading it again gives the same bytes)"
)


@dataclass(frozen=True, slots=True)
class CheckedFile:
    """One source file with a recorded checksum: its path (a single file's resolved path: the
    file a link named as the source leads to), the bytes the checksum covers (from ``start`` on),
    the record, the source keys whose bytes lie in it, its name as the source's reads name it
    (``name``: the link's own, where the source was named through one), and how an error names it
    (``shown``: the path, after the name the user gave where that is a link to it: "LINK -> PATH")."""

    path: str
    start: int
    digest: FileDigest
    keys: frozenset[str]
    record: str  # where the checksum was recorded, for the error
    name: str
    # How other bytes may be a rewrite on purpose, not damage ("either ..."; "" where nothing says
    # so): a mismatch then names both and the way out of each (:func:`_mismatch_advice`).
    rewritten: str
    shown: str
    listed: str = ""  # (its name as the source lists it, where ``name`` is a link's target's: a warning's)
    restore: str = "restore it"  # (a file of a Hugging Face cache: delete its blob and download it again)


@dataclass(frozen=True, slots=True)
class SourceChecks:
    """What a conversion's workers check: the recorded files, how the job's units name the source
    keys (a renamed source: new name -> old), and which task hashes which file (``duties``: task
    index -> the files it hashes, set by :func:`plan_checks` once the tasks are planned)."""

    files: tuple[CheckedFile, ...]
    source: Source  # the source as opened (job.source may be a renamed view of it)
    old_names: dict[str, str] | None = None
    duties: Mapping[int, tuple[CheckedFile, ...]] = field(default_factory=dict)

    def source_key(self, unit: str, chunks: Mapping[str, Any]) -> str:
        """The source key whose bytes the job's ``unit`` (a key, or one of ``chunks``) reads."""
        key = chunks[unit].key if unit in chunks else unit
        return self.old_names.get(key, key) if self.old_names is not None else key


def plan_checks(
    checks: SourceChecks | None, tasks: Sequence[Task], chunks: Mapping[str, Any], *, skip: Container[int] = ()
) -> tuple[SourceChecks | None, list[Task]]:
    """In the coordinator, once the tasks are planned: give every recorded file that any task
    (but those in ``skip``: kept by a resume, not run) reads bytes of to exactly one of those tasks,
    whose memory gains ``SOURCE_CHECK_BYTES``. Returns the checks with their duties, and the tasks.
    Files read with O_DIRECT get no task (hashing them would read storage twice).

    A file goes to the task that reads it with the least work so far (its bytes to write, plus
    the files it already hashes; the lowest index of equals), largest file first: a file one task
    reads alone stays with it, and a file of a one-file source goes to one of its readers. The
    same tasks give the same duties (every rank of a distributed job computes them alike).
    """
    if checks is None:
        return None, list(tasks)
    direct = _direct_files(checks.source)  # (chosen before the tasks are planned: warn_unchecked_direct)
    held: dict[str, list[int]] = {}
    for place, checked in enumerate(checks.files):
        for key in checked.keys if checked.name not in direct else ():
            held.setdefault(key, []).append(place)
    readers: dict[int, list[Task]] = {}
    for task in tasks:
        if task.index in skip:
            continue
        read = {place for unit in task.keys for place in held.get(checks.source_key(unit, chunks), ())}
        for place in read:
            readers.setdefault(place, []).append(task)
    load = {task.index: task.nbytes for task in tasks}
    duties: dict[int, list[CheckedFile]] = {}
    for place in sorted(readers, key=lambda p: (-checks.files[p].digest.size, p)):
        checked = checks.files[place]
        chosen = min(readers[place], key=lambda task: (load[task.index], task.index))
        load[chosen.index] += checked.digest.size
        duties.setdefault(chosen.index, []).append(checked)
    planned = [
        dataclasses.replace(task, memory=task.memory + SOURCE_CHECK_BYTES, duty=_duty(duties[task.index]))
        if task.index in duties
        else task
        for task in tasks
    ]
    return dataclasses.replace(checks, duties={index: tuple(files) for index, files in duties.items()}), planned


def _duty(files: Sequence[CheckedFile]) -> str:
    """What a task given ``files`` to hash does before its keys, as a message names it (a task
    timeout: the pass reads each file whole, which may be what took the time)."""
    if len(files) == 1:
        return f"hashes {files[0].shown} ({format_bytes(files[0].digest.size)}) whole against its checksum"
    named = ", ".join(f"{f.shown} ({format_bytes(f.digest.size)})" for f in files[:3])
    more = f" and {len(files) - 3} more" if len(files) > 3 else ""
    total = format_bytes(sum(f.digest.size for f in files))
    return f"hashes {len(files)} source files ({total}) whole against their checksums: {named}{more}"


def warn_unchecked_direct(checks: SourceChecks | None, keys: Sequence[str], chunks: Mapping[str, Any]) -> None:
    """In the coordinator, once the read choice is made: warn about the recorded files that the
    job's units ``keys`` read with O_DIRECT (a hash pass through the page cache would read them
    from storage a second time, so they are not checked)."""
    if checks is None:
        return
    direct = _direct_files(checks.source)
    if not direct:
        return
    read = {checks.source_key(unit, chunks) for unit in keys}
    names = [f.listed or f.name for f in checks.files if f.name in direct and f.keys & read]
    if names:
        warnings.warn(
            f"{checks.source.path}: not checked against its checksums: {', '.join(names[:3])}"
            f"{f' and {len(names) - 3} more' if len(names) > 3 else ''} read with O_DIRECT (checking would read "
            "them from storage twice; run verify on the source first, or convert with --io buffered)",
            SourceNotCheckedWarning,
            stacklevel=2,
        )


def source_checks(view: Source, source: Source) -> SourceChecks | None:
    """In the coordinator, before any worker starts: what a job reading ``view`` (``source`` as
    opened, or a view of it) can check as it reads; None when the source carries no checksums or is read
    in a way no task can check (object storage: warned of where it carries checksums; a dequantizing
    or quantizing view; a record that cannot be read, or not by this user: warned of).

    Raises:
        SourceChecksumError: a single safetensors file whose header is not the one recorded.

    Warns (and converts unchecked, never raising for it):
        SourceNotCheckedWarning: a record that exists but cannot be read (recorded_checksums'
            CorruptCheckpointError: a link, another tool's entry, a damaged record; a
            PermissionError: another user's), a sidecar beside a link's name only, a source on
            object storage that carries checksums.
    """
    old_names: dict[str, str] | None = None
    if isinstance(view, RenamedSource) and view.inner is source:
        old_names = dict(view.old_names)
    elif view is not source:
        return None
    if not isinstance(source, (DcpSource, SafetensorsSource, TorchSource)):
        return None
    if isinstance(source.location, Remote):
        _warn_remote(source)
        return None
    try:
        recorded = recorded_checksums(source)
    except (CorruptCheckpointError, PermissionError) as exc:
        # A record that cannot be read (by the one rule: a Hugging Face cache snapshot's record is
        # a link into its blobs; or another tool's "parallel_dcp" header entry; or one this user
        # may not read, beside data it may) proves nothing about the data: converted unchecked,
        # and said so (verify reports the record).
        warnings.warn(f"{source.path}: not checked against its checksums: {exc}", SourceNotCheckedWarning, stacklevel=2)
        return None
    if recorded is None:
        if (beside_link := record_beside_link(source)) is not None:  # (never silence: a record was found)
            warnings.warn(
                f"{source.path}: not checked against its checksums: {beside_link}",
                SourceNotCheckedWarning,
                stacklevel=2,
            )
        return None
    _refuse_by_records(source, recorded)
    recorded = _added_files_checked(source, recorded)
    stored = _files_read(source, recorded)
    directory = Path(os.fspath(source.location))  # (a folder's files as its listing names them)
    files = tuple(
        CheckedFile(
            os.fspath(read),
            recorded.starts.get(name, 0),
            digest,
            keys,
            recorded.record_of(name),
            os.path.basename(read) if source.location.is_dir() else source.location.name,
            # (hashed all the same: the pass is the task's own read; only a mismatch needs the hint)
            _why_rewritten(recorded, name, _changed_since(read, _record_written(recorded, name, read)), read),
            shown_as(source.path if not source.location.is_dir() else directory / name, read),
            name if source.location.is_dir() else source.location.name,
            _restore(read),
        )
        for name, digest in recorded.files.items()
        if digest.digest is not None and name in stored
        for read, keys in [stored[name]]
    )
    return SourceChecks(files, source, old_names) if files else None


def refuse_by_records(source: Source) -> None:
    """In the coordinator, with several sources, before the first is converted: the refusals that
    need no hashing of a source's files (a safetensors header, or a folder's recorded index, that
    is not the one recorded), so that a later source's is known before anything is written. A
    record that cannot be read, or none: nothing (its own job warns of it).

    Raises:
        SourceChecksumError: as :func:`source_checks` would, when that source's job starts.
    """
    if not isinstance(source, (DcpSource, SafetensorsSource, TorchSource)) or isinstance(source.location, Remote):
        return
    try:
        recorded = recorded_checksums(source, warn_stale=False)
    except (CorruptCheckpointError, PermissionError):
        return
    if recorded is not None:
        _refuse_by_records(source, recorded)
        if links_within(source) is not None and recorded.record == MANIFEST_FILE and not recorded.records:
            _refuse_added_problems(source, with_own_records(source, recorded)[0])


def _refuse_by_records(source: Source, recorded: Recorded) -> None:
    """A source's header record (read on open) or recorded index that is not the one recorded.

    Raises:
        SourceChecksumError: either.
    """
    if recorded.problems:  # the safetensors header differs from the one recorded (read on open)
        real = Path(os.fspath(recorded.directory)) / next(iter(recorded.files))  # (where a link leads)
        problem = recorded.problems[0].removeprefix(f"file {real.name}: ")  # (named here: "LINK -> FILE")
        raise SourceChecksumError(  # (the problem names both causes: verify reports it alike)
            f"{shown_as(source.path, real)}: {problem}: if rewritten on purpose, its record is stale "
            "(convert it anyway with --no-source-checks, check_source=False); if damaged (in a copy, on the device), "
            "restore it"
        )
    _refuse_changed_folder(source, recorded)


def _refuse_added_problems(source: Source, merged: Recorded) -> None:
    """An added file (one the folder's record does not list) whose own header record fails.

    Raises:
        SourceChecksumError: its header is not the one its own record was taken of.
    """
    if merged.problems:
        raise SourceChecksumError(
            f"{source.location}: {merged.problems[0]}: if rewritten on purpose, its record is stale (convert it "
            "anyway with --no-source-checks, check_source=False); if damaged (in a copy, on the device), restore it"
        )


def _refuse_changed_folder(source: Source, recorded: Recorded) -> None:
    """A local Hugging Face folder with a record of its own whose recorded index the job reads has
    other bytes (read when the source was opened: it decides which shard each key is read from,
    and holds no key, so no task hashes it; a shard merged in and named there changes it). Refused,
    not warned of: a file the record lists is not the one recorded; the error names the file, the
    files read that the record does not list, and both ways out (a change on purpose: the record
    is stale; or damage). Files the record does not list are no refusal: :func:`_added_files_checked`.

    Raises:
        SourceChecksumError: the recorded index changed.
    """
    if (tree := links_within(source)) is None or recorded.record != MANIFEST_FILE or recorded.records:
        return
    directory = Path(os.fspath(source.location))
    index = index_name(source)
    if index not in recorded.files or not index_read(source):
        return
    read = resolve_in_tree(directory / index, tree)
    found = file_digest(read, checksum=recorded.files[index].digest is not None)
    if found != recorded.files[index]:
        added = unrecorded_files(source, recorded)
        also = f"; its reads also open {_some(added)}, which the record does not list" if added else ""
        raise SourceChecksumError(changed_file(recorded, index, read, found, shown_as(directory / index, read), also))


def changed_file(
    recorded: Recorded, name: str, read: Path, found: FileDigest, shown: str, also: str = "", advice: str = ""
) -> str:
    """How a refusal says that file ``name``, which ``recorded`` lists, has other bytes (``found``,
    read at ``read``, named ``shown``; ``also``: what the difference adds), with both ways out:
    a change on purpose (the record is stale: --no-source-checks) or damage (restore it; a file of
    a Hugging Face cache: download it again), or ``advice`` where given. A folder's recorded
    index, and the side files a conversion copies (jobs/side_file_checks.py)."""
    if not advice:
        rewritten = _why_rewritten(recorded, name, _changed_since(read, _record_written(recorded, name, read)), read)
        advice = _mismatch_advice(rewritten, _restore(read))
    return (
        f"{shown}: its bytes are not the ones its checksum in {recorded.record_of(name)} was taken of "
        f"({_difference(found, recorded.files[name])}{also}): {advice}"
    )


def _added_files_checked(source: Source, recorded: Recorded) -> Recorded:
    """A local Hugging Face folder's record with the files the job reads that it does not list
    (jobs/unrecorded.py) added where they carry their own record (a safetensors header's, a
    sidecar), so that they are hashed against it like the others; the rest are read unchecked and
    named in a warning (a ``model.safetensors`` the hub's bot put beside recorded ``.bin`` shards
    is not damage of what was recorded).

    Raises:
        SourceChecksumError: an added safetensors file whose header is not the one its own record
            was taken of.

    Warns:
        SourceNotCheckedWarning: added files that carry no record.
    """
    if links_within(source) is None or recorded.record != MANIFEST_FILE or recorded.records:
        return recorded
    merged, unchecked = with_own_records(source, recorded)
    directory = Path(os.fspath(source.location))
    _refuse_added_problems(source, merged)
    if unchecked:
        warnings.warn(
            f"{directory}: not checked against its checksums: {_some(unchecked)}, which its reads open, "
            f"{'is' if len(unchecked) == 1 else 'are'} not in its {MANIFEST_FILE} and carr"
            f"{'ies' if len(unchecked) == 1 else 'y'} no record of {'its' if len(unchecked) == 1 else 'their'} own "
            "(added to the folder after its record was written: a conversion the hub's bot or a script put there)",
            SourceNotCheckedWarning,
            stacklevel=3,
        )
    return merged


def _some(names: Sequence[str]) -> str:
    """Up to three names, and how many more."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _difference(found: FileDigest, want: FileDigest) -> str:
    """How a file's bytes differ from its record, as a mismatch says it."""
    if found.size != want.size:
        return f"{found.size} bytes where {want.size} were recorded"
    return f"xxh3_64 {found.digest}, not the {want.digest} recorded"


def _warn_remote(source: Source) -> None:
    """A source on object storage is not checked (its tasks read ranges of its files: hashing a file
    whole would fetch it a second time), but where it carries checksums a warning says so, at the
    cost of reading its record (one small request; a safetensors file's header)."""
    try:
        recorded = recorded_checksums(source)
    except (CorruptCheckpointError, OSError):
        return  # (nothing usable: nothing unchecked to warn of)
    if recorded is not None and any(digest.digest is not None for digest in recorded.files.values()):
        warnings.warn(
            f"{source.path}: not checked against its checksums: on object storage (checking would read every "
            "file a second time); run verify on it first where that matters",
            SourceNotCheckedWarning,
            stacklevel=3,
        )


def _record_written(recorded: Recorded, name: str, read: Path) -> int | None:
    """When file ``name``'s sidecar record was last written (ns), None for a header's own (written
    with the file). A folder's own record is in the folder; a file's own sidecar, beside the file
    read (``read``: where a link leads)."""
    if name in recorded.starts:
        return None
    record = recorded.record_of(name)
    where = read.parent if name in recorded.records else Path(os.fspath(recorded.directory))
    try:  # (followed: a Hugging Face cache snapshot's record is a link into its blobs/, read where it leads)
        return os.stat(where / record).st_mtime_ns
    except OSError:
        return None


def _changed_since(path: Any, written: int | None) -> bool:
    """A file modified after its sidecar record was written: either rewritten on purpose (a
    training loop's torch.save over ``model.pt``, ``save_pretrained`` over a shard; the record is
    stale) or merely copied by a program that does not keep modification times (cp without -p,
    a download, s3 cp), damaged or not. Our writers write each file before its record; so the
    time alone decides nothing, and the file is hashed anyway: only a mismatch says both."""
    if written is None:
        return False
    try:
        return os.lstat(path).st_mtime_ns > written
    except OSError:
        return False


def _files_read(source: Source, recorded: Recorded) -> dict[str, tuple[Path, frozenset[str]]]:
    """Each recorded file that the source's keys lie in, by its recorded name -> the path the
    job's reads open (the hash pass opens the same, never through a link) and those keys.

    A single file is the resolved one recorded_checksums found (a link's target); a Hugging
    Face folder's shard that is a link within its tree is read where it leads (formats/base.py
    shard_files, by the same resolve_in_tree); a DCP shard is read by its own name.
    """
    directory = Path(os.fspath(recorded.directory))
    if not source.location.is_dir():  # one file, whatever name it was named by
        return {name: (directory / name, frozenset(source.entries)) for name in recorded.files}
    found: dict[str, set[str]] = {}
    if isinstance(source, DcpSource):
        assert source.metadata is not None
        for index, info in (source.metadata.storage_data or {}).items():
            found.setdefault(str(info.relative_path), set()).add(index.fqn)
        return {name: (directory / name, frozenset(keys)) for name, keys in found.items()}
    for key, entry in source.entries.items():
        found.setdefault(os.fspath(entry.file), set()).add(key)
    tree = links_within(source)
    assert tree is not None  # (a local folder that is no DCP)
    read: dict[str, tuple[Path, frozenset[str]]] = {}
    for name in recorded.files:
        try:
            path = resolve_in_tree(directory / name, tree)
        except UnsafeCheckpointError:
            continue  # (a link out of the tree: no key's bytes are read through it, or opening refused)
        if (keys := found.get(os.fspath(path))) is not None:
            read[name] = (path, frozenset(keys))
    return read


def _direct_files(source: Source) -> set[str]:
    """Files read with O_DIRECT, past the page cache: hashing them first would read storage twice."""
    if not isinstance(source, SafetensorsSource):
        return set()
    return {os.path.basename(file) for file in source.direct_files()}


def check_task(checks: SourceChecks | None, task: Task) -> None:
    """In a worker, before ``task`` reads its units: hash every recorded file :func:`plan_checks`
    gave it, whole.

    Raises:
        SourceChecksumError: a file's bytes are not the ones its checksum was taken of.
    """
    if checks is None:
        return
    for checked in checks.duties.get(task.index, ()):
        hasher = xxhash.xxh3_64()  # (not manifest.Hasher: that one counts what an output hashes)
        size = 0
        buffer = bytearray(SOURCE_CHECK_BYTES)
        view = memoryview(buffer)
        with open_bounded(checked.path, listed=True) as stream:
            stream.seek(checked.start)
            while n := stream.readinto(buffer):
                hasher.update(view[:n])
                size += n
        found = FileDigest(size, hasher.hexdigest())
        if found != checked.digest:
            raise SourceChecksumError(
                f"{checked.shown}: its bytes are not the ones its checksum in {checked.record} was taken of "
                f"({_difference(found, checked.digest)}): {_mismatch_advice(checked.rewritten, checked.restore)}"
            )


def _why_rewritten(recorded: Recorded, name: str, changed: bool, read: Path) -> str:
    """How file ``name`` (read at ``read``)'s other bytes may be a rewrite on purpose: its own
    header's record (kept by any rewrite that keeps the metadata), a file of a Hugging Face cache
    (replaced on the hub, its record not: the times of blobs say nothing), or a sidecar record
    older than the file; "" otherwise."""
    if name in recorded.starts:
        return _HEADER_KEPT
    if _in_cache(read):
        return _UPLOADED_STALE
    record = recorded.record_of(name)
    return f"it changed after {record} was written: either another program rewrote it on purpose" if changed else ""


def _mismatch_advice(rewritten: str, restore: str = "restore it") -> str:
    """What a mismatch means and the way out: damage (``restore``: how to restore it), or
    (``rewritten``: how it may be) a file rewritten on purpose since its record, whose record is
    then stale."""
    if not rewritten:
        return f"the source is damaged; {restore} {_ADVICE}"
    return (
        f"{rewritten}, and then its record is stale (convert it anyway with --no-source-checks, "
        f"check_source=False), or it is damaged (in a copy, on the device): {restore}"
    )


def _in_cache(read: Path) -> bool:
    """Whether ``read`` is a blob of a Hugging Face cache repository (``models--X/blobs/<sha>``)."""
    return read.parent.name == "blobs" and hub_cache_repo(read.parent.parent)


def _restore(read: Path) -> str:
    """How a damaged source file read at ``read`` is restored, as a mismatch says it."""
    return f"download it again (force_download=True, or delete {read} first)" if _in_cache(read) else "restore it"


def as_source_error(failure: BaseException) -> BaseException:
    """A source mismatch a worker found, as the caller sees it: the worker's own error (naming the
    file), not a WorkerError around it; any other failure as it is."""
    if isinstance(failure, WorkerError) and failure.error_type == SourceChecksumError.__qualname__:
        message = str(failure).split(": ", 1)[1].rsplit(" (task ", 1)[0]
        error = SourceChecksumError(message)
        error.__cause__ = failure
        return error
    return failure
