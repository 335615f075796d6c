"""Dry runs: plan a save or conversion exactly as a real run would, and write nothing.

    sources ── open, select, rename, dtype ── pipeline.plan_job ────┬─ files, keys, bytes, chunks
                                                                     ├─ workers the limit affords
                                                                     ├─ predicted peak memory
                                                                     └─ space needed / free

The plan is :func:`parallel_dcp.jobs.pipeline.plan_job`'s, the one a real run executes. The
predicted peak replays the pool's dispatch on that plan: tasks in order, each to the first free
worker, each only when the governor would admit its memory estimate (``Task.memory``) beside
those in flight; tasks take time in proportion to their bytes plus a per-item overhead. The peak
is the idle workers' cost plus the most memory in flight at once: the figures admission uses,
so the prediction is as honest as admission is (tests compare it with the measured peak).
"""

from __future__ import annotations

import heapq
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parallel_dcp import _compat
from parallel_dcp.engine.memory import WORKER_MEMORY_BYTES, MemoryGovernor, format_bytes
from parallel_dcp.engine.partition import ITEM_OVERHEAD_BYTES, Task
from parallel_dcp.engine.pool import gc_paused
from parallel_dcp.errors import describe_unit, plural, printable
from parallel_dcp.formats import folder_weights
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.memory_format import MemorySource
from parallel_dcp.jobs.pipeline import Plan, choose_executor, needed_space, plan_job
from parallel_dcp.jobs.source_check import SOURCE_CHECK_BYTES
from parallel_dcp.jobs.targets import DcpTarget, Job, ShardedTarget, Target, prepare_io
from parallel_dcp.options import Options
from parallel_dcp.storage.local_staging import free_bytes
from parallel_dcp.storage.location import Remote
from parallel_dcp.storage.ownership import METADATA_FILE

__all__ = ["DryRunPlan", "describe_plan", "dry_run_save", "plan_dry_run"]


@dataclass(frozen=True, slots=True)
class DryRunPlan:
    """What a save or conversion would do; nothing was written.

    ``files`` lists each data file with the units (keys, or ``key[dim:start:stop]`` chunks) it
    would hold and their bytes; ``per_worker`` the tasks and bytes each worker would run in the
    replayed dispatch. ``predicted_peak_memory`` is next to ``memory_limit``, ``space_needed``
    next to ``space_free`` (None where unknown, such as object storage).
    """

    path: str
    source: str
    format: str
    keys: int
    bytes: int
    tasks: int
    workers: int
    workers_allowed: int
    workers_wanted: int
    executor: str
    memory_limit: int
    predicted_peak_memory: int
    space_needed: int
    space_free: int | None
    chunk_threshold: int
    chunks: dict[str, int] = field(default_factory=dict)
    files: list[dict[str, Any]] = field(default_factory=list)
    per_worker: list[dict[str, int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # The file whose rename commits the output (``.metadata``, a sharded directory's index; None
    # for a single file): the run counts it among its files (SaveResult.files), ``files`` does not.
    marker: str | None = None

    @property
    def file_count(self) -> int:
        """The files the run will report (``SaveResult.files``): the data files and the marker."""
        return len(self.files) + (self.marker is not None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "dry_run": True,
            "path": self.path,
            "source": self.source,
            "format": self.format,
            "keys": self.keys,
            "bytes": self.bytes,
            "tasks": self.tasks,
            "workers": self.workers,
            "workers_allowed": self.workers_allowed,
            "workers_wanted": self.workers_wanted,
            "executor": self.executor,
            "memory_limit": self.memory_limit,
            "predicted_peak_memory": self.predicted_peak_memory,
            "space_needed": self.space_needed,
            "space_free": self.space_free,
            "chunk_threshold": self.chunk_threshold,
            "chunks": self.chunks,
            "files": self.files,
            "per_worker": self.per_worker,
            "notes": self.notes,
            "marker": self.marker,
            "file_count": self.file_count,
        }


def _file_names(target: Target, tasks: list[Task]) -> list[str]:
    """The data file each task writes (DCP shards on object storage get a per-save tag as well)."""
    if isinstance(target, DcpTarget):
        return [f"__{t.index}_0.distcp" for t in tasks]
    if isinstance(target, ShardedTarget):
        names = target._shard_names(len(tasks))
        return [names[t.index] for t in tasks]
    return [target.path.name for _ in tasks]


def _marker(target: Target, tasks: list[Task]) -> str | None:
    """The commit marker the run writes beside the data files, as its commit counts it."""
    if isinstance(target, DcpTarget):
        return METADATA_FILE
    if isinstance(target, ShardedTarget) and (len(tasks) > 1 or target.always_index):
        return target.format.index_name
    return None


def _replay(tasks: list[Task], workers: int, limit: int, overhead: int) -> tuple[int, list[dict[str, int]]]:
    """Most memory in flight at once, and what each worker ran, in the pool's dispatch order."""
    pending = deque(tasks)
    idle = deque(range(workers))
    running: list[tuple[float, int, int, int]] = []  # (end, task index, memory, worker)
    now = 0.0
    in_flight = peak = 0
    ran = [{"worker": w, "tasks": 0, "bytes": 0} for w in range(workers)]
    while pending or running:
        while pending and idle and (not running or overhead + in_flight + pending[0].memory <= limit):
            task = pending.popleft()
            worker = idle.popleft()
            duration = task.nbytes + ITEM_OVERHEAD_BYTES * len(task.keys)
            heapq.heappush(running, (now + duration, task.index, task.memory, worker))
            in_flight += task.memory
            peak = max(peak, in_flight)
            ran[worker]["tasks"] += 1
            ran[worker]["bytes"] += task.nbytes
        now, _, memory, worker = heapq.heappop(running)
        in_flight -= memory
        idle.append(worker)
    return peak, ran


def _space_free(target: Target) -> int | None:
    if isinstance(target.path, Remote):
        return None
    where = Path(target.path).parent
    while not where.exists() and where != where.parent:
        where = where.parent
    return free_bytes(where)


def _notes(target: Target, options: Options, needed: int, free: int | None) -> list[str]:
    """What the real run would stop at after planning: an existing output, too little space."""
    notes = []
    if not isinstance(target.path, Remote):
        path = Path(target.path)
        exists = (path / ".metadata").exists() if isinstance(target, DcpTarget) else path.exists()
        if exists and not (path.is_dir() and not any(path.iterdir())):
            notes.append(
                f"{path} exists: the run replaces it (overwrite)"
                if options.overwrite
                else f"{path} exists: the run would refuse it without overwrite=True (--overwrite)"
            )
    if free is not None and free < needed:
        notes.append(f"the run would fail: it needs {format_bytes(needed)} and {format_bytes(free)} is free")
    return notes


def plan_dry_run(job: Job, target: Target, options: Options, governor: MemoryGovernor) -> DryRunPlan:
    """Plan ``job`` as :func:`parallel_dcp.jobs.pipeline.run_job` would, and write nothing.

    Raises:
        ValueError: ``options.distributed`` (a dry run plans one process's job).
        InvalidDestinationError: a destination the real run refuses before writing.
        MemoryLimitExceeded: as a real run would, before anything is written.
    """
    _compat.check_torch()
    if options.distributed:
        raise ValueError("a dry run plans the job of one process: run it without distributed (--distributed)")
    target.check_destination()  # what the real run refuses before writing, a dry run refuses too
    options = prepare_io(target, options, probe=False)  # direct writes' buffers count
    with gc_paused():
        plan: Plan = plan_job(job, target, options, governor)
    tasks = plan.tasks
    executor = choose_executor(plan.job, options)
    used = min(plan.workers, len(tasks)) if tasks else 0
    overhead = used * (WORKER_MEMORY_BYTES + governor.worker_extra) if executor == "processes" else 0
    peak, per_worker = _replay(tasks, used, governor.limit - governor.reserved, overhead)
    if executor == "processes":  # and beside the workers, the coordinator's own growth (set aside in reserved)
        overhead += governor.coordinator
    chunks: dict[str, int] = {}
    for chunk in plan.job.chunks.values():
        chunks[chunk.key] = chunks.get(chunk.key, 0) + 1
    files = [
        {"name": name, "task": t.index, "keys": list(t.keys), "bytes": t.nbytes}
        for name, t in zip(_file_names(target, tasks), tasks, strict=True)
    ]
    needed, free = needed_space(plan.job), _space_free(target)
    return DryRunPlan(
        path=os.fspath(target.path),
        source=job.source.path,
        format=target.kind,
        keys=len(job.keys),
        bytes=sum(t.nbytes for t in tasks),
        tasks=len(tasks),
        workers=used,
        workers_allowed=plan.workers,
        workers_wanted=options.worker_count(len(plan.job.keys)),
        executor=executor,
        memory_limit=governor.limit,
        predicted_peak_memory=overhead + peak,
        space_needed=needed,
        space_free=free,
        chunk_threshold=plan.threshold,
        chunks=chunks,
        files=files,
        per_worker=per_worker,
        notes=_notes(target, options, needed, free) + _check_notes(plan.job) + _source_notes(job.source),
        marker=_marker(target, tasks),
    )


def _source_notes(source: Source) -> list[str]:
    """Which of a folder's weight files the run reads, where it holds others it leaves or its
    config.json names the file (as the client does: formats/folder_choice.py)."""
    read, unread = folder_weights(source)
    named = source.folder is not None and source.folder.named is not None
    if not unread and not named:
        return []
    shown = ", ".join(read[:3]) + (f" and {len(read) - 3} more" if len(read) > 3 else "")
    why = "which its config.json names (transformers_weights): " if named else ""
    left = f"; not read: {', '.join(unread)}" if unread else ""
    return [f"reads {shown} of {source.path}, {why}the weights transformers loads from it{left}"]


def _check_notes(job: Job) -> list[str]:
    """What the job checks of its source (jobs/source_check.py), and the buffer that costs."""
    duties = job.checks.duties if job.checks is not None else {}
    hashed = sum(map(len, duties.values()))
    if not hashed:
        return []
    return [
        f"hashes {plural(hashed, 'source file')} against the checksums the source carries before reading "
        f"({plural(len(duties), 'task')} holding a {format_bytes(SOURCE_CHECK_BYTES)} buffer for it, counted above)"
    ]


def dry_run_save(state_dict: Any, path: str | os.PathLike[str], options: Options) -> DryRunPlan:
    """Plan :func:`parallel_dcp.save` of ``state_dict`` to ``path``; write nothing."""
    target = DcpTarget(path, options.storage_options, compression=options.compression())
    governor = MemoryGovernor(options.memory_ceiling())
    with gc_paused():
        source = MemorySource(str(path), state_dict=state_dict)
        job = Job(source, source.keys())
    return plan_dry_run(job, target, options, governor)


# "1 process", "2 processes": the executor's name, in the number the worker count takes.
_EXECUTOR_NOUNS = {"processes": ("process", "processes"), "threads": ("thread", "threads")}


def describe_plan(plan: DryRunPlan, *, files_shown: int = 20) -> str:
    """A human-readable summary of a :class:`DryRunPlan` (names escaped, chunks said in words)."""
    free = "unknown" if plan.space_free is None else format_bytes(plan.space_free)
    workers = plural(plan.workers, *_EXECUTOR_NOUNS.get(plan.executor, ("worker", "workers")))
    lines = [
        f"dry run: {printable(plan.source)} -> {printable(plan.path)} ({plan.format}); nothing was written",
        f"  {plural(plan.keys, 'key')}, {format_bytes(plan.bytes)} in {plural(plan.file_count, 'file')}"
        + (f" ({plural(len(plan.files), 'data file')} and {plan.marker})" if plan.marker else "")
        + f", {plural(plan.tasks, 'task')}",
        f"  workers: {workers} (the memory limit allows {plan.workers_allowed} of the {plan.workers_wanted} wanted)",
        f"  predicted peak memory {format_bytes(plan.predicted_peak_memory)} of the limit "
        f"{format_bytes(plan.memory_limit)}",
        f"  space needed {format_bytes(plan.space_needed)}, free {free}",
    ]
    if plan.chunks:
        lines.append(
            f"  {plural(len(plan.chunks), 'tensor')} split into {plural(sum(plan.chunks.values()), 'chunk')} "
            f"(threshold {format_bytes(plan.chunk_threshold)}): a chunk is a range of rows of one tensor "
            "that one task writes; DCP records every chunk in that tensor's metadata"
        )
    for w in plan.per_worker:
        lines.append(f"  worker {w['worker']}: {plural(w['tasks'], 'task')}, {format_bytes(w['bytes'])}")
    for f in plan.files[:files_shown]:
        units = [describe_unit(unit, quote=False) for unit in f["keys"][:3]]
        keys = "; ".join(units) + (f" ... (+{len(f['keys']) - 3})" if len(f["keys"]) > 3 else "")
        lines.append(f"  {printable(f['name'])}: {format_bytes(f['bytes'])}: {keys}")
    if len(plan.files) > files_shown:
        lines.append(f"  ... and {plural(len(plan.files) - files_shown, 'more file')}")
    lines += [f"  note: {printable(note)}" for note in plan.notes]
    return "\n".join(lines)
