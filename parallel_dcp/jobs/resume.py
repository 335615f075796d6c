"""Resume a conversion that died: keep the tasks it finished, redo the rest, commit as usual.

    fresh run:  plan ── stage ── job record (identity + plan) ── tasks ──▶ each worker, after its
                                                                          files: a done record
    resume:     stage(resume) ── a dead save's job record, same identity? ── adopt its save id
                  │ no: ResumeError with the reasons (nothing removed)
                  ▼
                the recorded plan (validated against this job) ── each done record: sealed, of
                this job and task, names exactly the task's files, and every file re-hashed equal
                  │ kept: its result rebuilt from the record and the plan (no pickle)
                  │ not: its files and record removed, the task run again
                  ▼
                commit (.metadata / index / file) as a fresh run does

A job's *identity* is what makes its output what it is: the source's fingerprint (each file's
name, size and mtime, as the manifest records it), the output format, the dtype, the selected
keys under their output names with their nesting (so ``keys`` and ``rename`` both count), the
shard size and an explicit chunk size. Workers and the memory limit are not part of it: the
recorded plan is reused (and checked against the limit), so a resume may run with fewer workers
or another limit. Resume is for conversions to local destinations; object storage and
distributed jobs are refused with :class:`ResumeError`. The write pipeline reaches this module at
one place, :func:`parallel_dcp.jobs.staged.stage_job`: the staged job it returns knows what was kept.

Longer than 300 lines because the done record's writer (in the worker) and its reader (the
checks a resume runs on it) are one format, kept side by side so that they cannot drift apart.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from parallel_dcp.engine.memory import (
    TASK_MEMORY_BYTES,
    WORKER_MEMORY_BYTES,
    MemoryGovernor,
    format_bytes,
    parse_size,
)
from parallel_dcp.engine.partition import Task
from parallel_dcp.errors import ResumeError
from parallel_dcp.formats import lean
from parallel_dcp.formats.key_paths import NonStringKey
from parallel_dcp.formats.memory_format import MemorySource
from parallel_dcp.jobs.targets import (
    DcpTarget,
    Job,
    ShardedTarget,
    Target,
    _items,
    _whole_file_memory,
    task_file_names,
)
from parallel_dcp.options import Options
from parallel_dcp.storage.compression import DESCRIPTOR
from parallel_dcp.storage.layout import written_by_us
from parallel_dcp.storage.location import Remote
from parallel_dcp.storage.manifest import FileDigest
from parallel_dcp.storage.ownership import is_of_save
from parallel_dcp.storage.protocol import Staging
from parallel_dcp.storage.resume import (
    RECORD_VERSION,
    IdentityCheck,
    digest_entry,
    digest_of,
    done_name,
    job_name,
    read_sealed,
    remove_record,
    verify_file,
    write_job_record,
    write_sealed,
)

__all__ = [
    "Kept",
    "Recorder",
    "adopted_files",
    "check_identity",
    "finished_files",
    "identity",
    "job_digest",
    "keep_finished",
    "plan_record",
    "refuse_unsupported",
    "replan",
    "resumable",
    "start_record",
]

_HASH_THREADS = 4


def resumable(job: Job, target: Target, options: Options) -> bool:
    """True for a job whose tasks leave records: a conversion to a local destination, on one node."""
    return not isinstance(job.source, MemorySource) and not isinstance(target.path, Remote) and not options.distributed


def refuse_unsupported(job: Job, target: Target, options: Options) -> None:
    """With ``resume``, refuse what cannot resume, before anything is written."""
    if isinstance(job.source, MemorySource):
        raise ResumeError("resume is for conversions (convert), not for saving a state dict from memory")
    if options.distributed:
        raise ResumeError("resume is not supported for distributed (torchrun) conversions; run without resume")
    if isinstance(target.path, Remote):
        raise ResumeError(
            f"resume is supported for local destinations only, not {target.path} (object storage has no "
            "durable per-task records here); run without resume to convert from the start"
        )


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def identity(job: Job, target: Target, options: Options) -> dict[str, Any]:
    """What the job's output is made of (see the module docstring); JSON."""
    source = job.source
    old_names: dict[str, str] = getattr(source, "old_names", {})  # a renamed view: new name -> source name
    names = [[key, old_names.get(key, key), _json_path(source.mapping.get(key, (key,)))] for key in job.source_keys()]
    return {
        "source": source.fingerprint(),
        "format": target.kind,
        "dtype": str(job.dtype).removeprefix("torch.") if job.dtype is not None else None,
        "keys": {"count": len(names), "xxh3_64": xxhash.xxh3_64_hexdigest(_canonical(names))},
        "shard_size": getattr(target, "shard_size", None),
        # in bytes: "512KiB" and 524288 are one size (a record from before this holds the text: refused once)
        "chunk_size": parse_size(options.chunk_size, "chunk_size") if options.chunk_size is not None else None,
        "compress": str(compression) if (compression := getattr(target, "compression", None)) is not None else None,
    } | ({"keep_dtype": sorted(job.keep_dtype)} if job.keep_dtype else {})


def _json_path(path: tuple[Any, ...]) -> list[Any]:
    """A key's path in JSON: a key that is not a string (an optimizer's int key) as its repr in a
    list of one, apart from the string and the list index of the same text."""
    return [[repr(level.key)] if type(level) is NonStringKey else level for level in path]


def _same_size(recorded: str, now: Any) -> bool:
    try:
        return bool(parse_size(recorded, "chunk_size") == now)
    except ValueError:
        return False


def check_identity(now: dict[str, Any]) -> IdentityCheck:
    """The check a staging area runs on a dead conversion's recorded identity: why it is not ``now``."""

    def reasons(then: dict[str, Any]) -> list[str]:
        found: list[str] = []
        source_then, source_now = then.get("source"), now["source"]
        if source_then != source_now:
            found.append(_source_change(source_then, source_now))
        labels = {
            "format": "the output format",
            "dtype": "dtype",
            "keys": "the selected keys or their names (keys, rename)",
            "shard_size": "shard_size",
            "chunk_size": "chunk_size",
            "compress": "compress",
        }
        for name, label in labels.items():
            if then.get(name) != now[name]:
                if name == "keys":
                    found.append(f"{label} differ")
                elif name == "chunk_size" and isinstance(then.get(name), str) and _same_size(then[name], now[name]):
                    found.append(
                        f"chunk_size was recorded as {then[name]!r} by an older parallel_dcp, which this one cannot "
                        "match to its finished tasks: run it again without --resume"
                    )
                else:
                    found.append(f"{label} was {then.get(name)!r}, now {now[name]!r}")
        return found

    return reasons


def _source_change(then: object, now: dict[str, Any]) -> str:
    if not isinstance(then, dict) or then.get("path") != now["path"] or then.get("kind") != now["kind"]:
        was = then.get("path") if isinstance(then, dict) else None
        return f"another source: it converted {was!r}, now {now['path']!r}"
    files_then = then.get("files") if isinstance(then.get("files"), dict) else {}
    assert isinstance(files_then, dict)
    changed = sorted(n for n in set(files_then) | set(now["files"]) if files_then.get(n) != now["files"].get(n))
    shown = ", ".join(changed[:5]) + (" ..." if len(changed) > 5 else "")
    return f"the source changed since (size or modification time of {shown})"


def plan_record(tasks: list[Task], threshold: int, target: Target) -> dict[str, Any]:
    """The plan as the job record keeps it: the split threshold, and each task's units in order."""
    return {"split": target.splits_tensors, "threshold": threshold, "tasks": [list(t.keys) for t in tasks]}


def start_record(staging: Staging, job_identity: dict[str, Any], plan: dict[str, Any]) -> None:
    """Before the first task: the job record a later resume matches against."""
    assert isinstance(staging.location.root, Path)
    write_job_record(
        staging.location.root,
        staging.save_id,
        os.fspath(staging.destination),
        job_identity,
        plan,
        destination_id=staging.destination_id(),
    )


@dataclass(frozen=True, slots=True)
class Replan:
    job: Job
    tasks: list[Task]
    workers: int
    threshold: int


def replan(job: Job, target: Target, options: Options, governor: MemoryGovernor, record: dict[str, Any]) -> Replan:
    """The plan the dead conversion recorded, checked against this job (every unit once) and
    against the memory limit.

    Raises:
        ResumeError: the recorded plan does not fit this job.
        MemoryLimitExceeded: a recorded task can never fit under this memory limit.
    """
    plan = record["plan"]
    threshold, split, units = plan.get("threshold"), plan.get("split"), plan.get("tasks")
    bad = ResumeError("the dead conversion's recorded plan does not match this job; run without resume")
    if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0 or split != target.splits_tensors:
        raise bad
    if not isinstance(units, list) or not all(isinstance(u, list) and u for u in units):
        raise bad
    if split:
        job = job.split(threshold, governor.admit_units)
    flat = [unit for task in units for unit in task]
    if not all(isinstance(u, str) for u in flat) or len(flat) != len(set(flat)) or set(flat) != set(job.keys):
        raise bad
    items = {item.key: item for item in _items(job)}
    tasks = []
    for index, keys in enumerate(units):
        chosen = [items[k] for k in keys]
        # The whole-file figure bounds what a DCP task holds too (it keeps no more than each item).
        memory = TASK_MEMORY_BYTES + _whole_file_memory(chosen)
        tasks.append(Task(index=index, keys=tuple(keys), nbytes=sum(it.nbytes for it in chosen), memory=memory))
        if len(keys) > 1:
            governor.check_item(f"{len(keys)} keys written as one file to {target.path}", memory + WORKER_MEMORY_BYTES)
    if isinstance(target, ShardedTarget):
        target._count = len(tasks)  # workers name their shards from it, as after ShardedTarget.plan
    workers = governor.workers_for(((key, job.memory(key)) for key in job.keys), options.worker_count(len(job.keys)))
    return Replan(job, tasks, workers, threshold)


def _units_digest(task: Task) -> str:
    return xxhash.xxh3_64_hexdigest(_canonical(list(task.keys)))


@dataclass(frozen=True, slots=True)
class Recorder:
    """Runs in the worker once a task's files are written (and fsynced): its done record."""

    directory: Path
    save_id: str
    job_digest: str
    target: Target
    job: Job

    def __call__(self, task: Task, result: Any) -> None:
        digests = self._digests(result)
        if digests is None or any(d.digest is None for d in digests.values()):
            return  # nothing a resume could check (checksums off, or a part DCP's planner wrote)
        on_disk = {result_name: disk for disk, result_name in task_file_names(self.target, task, self.save_id).items()}
        document: dict[str, Any] = {
            "version": RECORD_VERSION,
            "save_id": self.save_id,
            "job": self.job_digest,
            "task": task.index,
            "units": _units_digest(task),
            "files": {on_disk[name]: digest_entry(d) for name, d in digests.items()},
        }
        if isinstance(result, lean.LeanPart):
            document["part"] = _part_record(self.job, task, result)
        write_sealed(self.directory, done_name(self.save_id, task.index), document)

    def _digests(self, result: Any) -> dict[str, FileDigest] | None:
        if isinstance(self.target, DcpTarget):
            return dict(result.digests) if isinstance(result, lean.LeanPart) else None
        if isinstance(self.target, ShardedTarget):
            return dict(result)
        assert isinstance(self.target.path, Path)
        return {self.target.path.name: result}


def _part_record(job: Job, task: Task, part: lean.LeanPart) -> list[list[Any]]:
    """Where each unit of a DCP task sits in its file, in the part's order:
    ``[unit, offset, length, requires_grad, pinned]`` (the rest is rebuilt from the plan)."""
    chunk_unit = {(c.key, c.offsets): u for u in task.keys if (c := job.chunks.get(u)) is not None}
    rows: list[list[Any]] = [[key, offset, length, False, False] for key, offset, length in part.values]
    for key, _dtype, grad, pinned, _shape, offsets, _sizes, offset, length in part.tensors:
        unit = key if offsets is None else chunk_unit[(key, tuple(offsets))]
        rows.append([unit, offset, length, bool(grad), bool(pinned)])
    return rows


@dataclass
class Kept:
    """What a resume keeps: each kept task's result (as its worker returned it), and its bytes."""

    results: dict[int, Any] = field(default_factory=dict)
    bytes_kept: int = 0
    files: set[str] = field(default_factory=set)


def keep_finished(job: Job, target: Target, tasks: list[Task], staging: Staging, job_digest: str) -> Kept:
    """Check every done record of the adopted save (re-hashing the files it names); the tasks
    whose records hold are kept, the others' files and records are removed (they run again)."""
    directory = staging.location.root
    assert isinstance(directory, Path)
    save_id = staging.save_id

    def check(task: Task) -> tuple[Task, Any]:
        return task, _kept_result(job, target, task, directory, save_id, job_digest)

    kept = Kept()
    with ThreadPoolExecutor(_HASH_THREADS) as pool:  # hashing reads files: threads overlap the I/O
        for task, result in pool.map(check, tasks):
            if result is None:
                remove_record(directory, done_name(save_id, task.index))
                for name in task_file_names(target, task, save_id):
                    remove_record(directory, name)
                continue
            kept.results[task.index] = result
            kept.bytes_kept += task.nbytes
            kept.files.update(task_file_names(target, task, save_id))
            kept.files.add(done_name(save_id, task.index))
    return kept


def _kept_result(job: Job, target: Target, task: Task, directory: Path, save_id: str, job_digest: str) -> Any:
    """The task's result rebuilt from its done record, or None when the record is not to be trusted
    (another user's included: their files never become this user's checkpoint)."""
    if not written_by_us(directory / done_name(save_id, task.index)):
        return None
    record = read_sealed(directory, done_name(save_id, task.index))
    if record is None or record.get("version") != RECORD_VERSION or record.get("save_id") != save_id:
        return None
    if (record.get("job"), record.get("task"), record.get("units")) != (job_digest, task.index, _units_digest(task)):
        return None
    files = record.get("files")
    expected = task_file_names(target, task, save_id)
    if not isinstance(files, dict) or set(files) != set(expected):  # names: exactly the task's, nothing else
        return None
    digests: dict[str, FileDigest] = {}
    for name, entry in files.items():
        digest = digest_of(entry)
        if digest is None or not verify_file(directory, name, digest):
            return None
        digests[expected[name]] = digest
    if isinstance(target, DcpTarget):
        name = lean.file_name(task.index, save_id)
        return _rebuilt_part(job, target, task, name, digests[name], record.get("part"))
    if isinstance(target, ShardedTarget):
        return digests
    return next(iter(digests.values()))


def _rebuilt_part(
    job: Job, target: Target, task: Task, name: str, digest: FileDigest, rows: object
) -> lean.LeanPart | None:
    """The task's :class:`~parallel_dcp.formats.lean.LeanPart` from the plan, with lengths from the
    record; its offsets must be exactly those the plan's layout gives: the units in the order the
    part is written (values, whole tensors, then chunks, each in task order), back to back from
    byte 0 to the end of the file. A record that says anything else (two same-shaped units with
    their offsets swapped and the record re-sealed) is not trusted: the task runs again."""
    if not isinstance(rows, list) or len(rows) != len(task.keys):
        return None
    values = [u for u in task.keys if u not in job.chunks and u not in job.source.entries]
    tensors = [u for u in task.keys if u not in job.chunks and u in job.source.entries]
    order = values + tensors + [u for u in task.keys if u in job.chunks]
    end = 0
    for row, unit in zip(rows, order, strict=True):
        if not isinstance(row, list) or len(row) != 5 or row[0] != unit or row[1] != end:
            return None
        if not isinstance(row[2], int) or isinstance(row[2], bool) or row[2] <= 0:
            return None
        end += row[2]
    if end != digest.size:
        return None
    # A compressed job's records are all zstd frames (the job record's identity says which).
    compression = getattr(target, "compression", None)
    part = lean.LeanPart(name, digests={name: digest}, descriptors=[DESCRIPTOR] if compression is not None else None)
    seen: set[str] = set()
    for row in rows:
        if not isinstance(row, list) or len(row) != 5:
            return None
        unit, offset, length, grad, pinned = row
        if unit not in task.keys or unit in seen or not isinstance(grad, bool) or not isinstance(pinned, bool):
            return None
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (offset, length)):
            return None
        # (a compressed record may be shorter than its tensor; a plain one never is)
        if offset + length > digest.size or (compression is None and length < job.out_bytes(unit)):
            return None
        seen.add(unit)
        chunk = job.chunks.get(unit)
        key = chunk.key if chunk is not None else unit
        entry = job.source.entries.get(key)
        if entry is None:
            part.values.append((unit, offset, length))
            continue
        dtype = job.out_dtype(entry.dtype, key)
        shape = tuple(entry.shape)
        if chunk is None:
            part.tensors.append((key, dtype, grad, pinned, shape, None, shape, offset, length))
        else:
            part.tensors.append((key, dtype, grad, pinned, shape, chunk.offsets, chunk.sizes, offset, length))
    return part


def job_digest(job_identity: dict[str, Any]) -> str:
    return xxhash.xxh3_64_hexdigest(_canonical(job_identity))


def finished_files(target: Target, tasks: list[Task], staging: Staging) -> set[str]:
    """After a failure: what to leave for a later resume, the job record, the done records and the
    files they name (checked again, re-hashed, by that resume). Empty when no task finished."""
    directory = staging.location.root
    assert isinstance(directory, Path)
    save_id = staging.save_id
    keep: set[str] = set()
    for task in tasks:
        name = done_name(save_id, task.index)
        if read_sealed(directory, name) is not None:
            keep.add(name)
            keep.update(task_file_names(target, task, save_id))
    return keep | {job_name(save_id)} if keep else set()


def kept_note(target: Target, tasks: list[Task], staging: Staging, kept: set[str]) -> str:
    """What a failed conversion left for a resume, and how to use it (added to its error)."""
    done = [t for t in tasks if done_name(staging.save_id, t.index) in kept]
    return (
        f"{len(done)} of {len(tasks)} tasks ({format_bytes(sum(t.nbytes for t in done))}) had finished and were kept "
        f"in {target.path}: run the same command with --resume (convert(..., resume=True)) to continue from them; "
        "a run without it removes them"
    )


def adopted_files(staging: Staging) -> set[str]:
    """Every file of the adopted save (left as they are when a resume is refused after adopting)."""
    directory = staging.location.root
    assert isinstance(directory, Path)
    return {name for name in os.listdir(directory) if is_of_save(name, staging.save_id)}
