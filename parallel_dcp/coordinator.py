"""The save pipeline: one coordinator, a pool of forked workers, one commit.

state_dict (in memory)
  │ flatten (DCP's own rules) and check: keys, devices, layouts   ── bad input fails here
  ▼
partition ── disjoint tasks balanced by bytes, largest first; task i writes part i
  │
  ▼                                   staging dir  <parent>/.<name>.staging-<id>/
WorkerPool (fork: workers read the state dict copy-on-write, no tensor bytes in pipes)
  │ worker: partial_save(its keys, FileSystemWriter(staging), part_idx=i) → __i_0.distcp
  │ ◀── (Metadata, [WriteResult]) per task, pickled through the pipe
  ▼
merge_metadata + planner_data of the whole source (so nesting survives)
  │ commit: FileSystemWriter.finish → staging/.metadata
  ▼
publish: rename (or atomic exchange) staging → destination     ── the checkpoint exists
any failure before this: workers killed and reaped, staging removed, destination untouched
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata

from parallel_dcp import _compat
from parallel_dcp.destination import Staging
from parallel_dcp.memory import MemoryGovernor
from parallel_dcp.options import Options
from parallel_dcp.partial import commit, merge_metadata, partial_save
from parallel_dcp.partition import ITEM_MEMORY_BYTES, TASK_MEMORY_BYTES, Task, items_of, partition
from parallel_dcp.pool import TaskResult, WorkerPool
from parallel_dcp.progress import Progress
from parallel_dcp.validate import flatten_checked
from parallel_dcp.writer import CommitWriter, ShardWriter

__all__ = ["SaveResult", "WorkerStats", "save"]

# Each torch.save record adds about 1 KiB of zip headers and pickle to its tensor's bytes.
_RECORD_OVERHEAD = 1024


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """What one worker did: tasks run, bytes written, seconds spent inside its tasks."""

    worker: int
    tasks: int
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class SaveResult:
    """What a save did. ``gib_per_s`` is the bytes of tensor data over the whole wall time.

    ``peak_memory`` is the highest memory the job added to its process tree in the governor's
    samples, next to the ``memory_limit`` it ran under.
    """

    path: str
    bytes: int
    files: int
    tasks: int
    workers: int
    seconds: float
    per_worker: list[WorkerStats] = field(default_factory=list)
    memory_limit: int = 0
    peak_memory: int = 0

    @property
    def gib_per_s(self) -> float:
        return self.bytes / 2**30 / self.seconds if self.seconds > 0 else 0.0


def _save_handler(flat: dict[str, Any], staging: str, options: Options) -> Any:
    def run(task: Task) -> tuple[Metadata, list[Any], int]:
        part = {key: flat[key] for key in task.keys}
        writer = ShardWriter(staging, sync_files=options.sync_files)
        try:
            metadata, writes = partial_save(
                part, writer, DefaultSavePlanner(flatten_state_dict=False), part_idx=task.index
            )
        except Exception as exc:
            original = writer.original_error()
            if original is not None:  # say what the file system said, not "unexpected pos ..."
                raise OSError(original.errno, f"{original.strerror} writing {staging}") from exc
            raise
        return metadata, writes, task.nbytes

    return run


def _worker_setup(options: Options) -> Any:
    def setup() -> None:
        # Parallelism comes from processes; intra-op threads in each would only fight for cores.
        torch.set_num_threads(1)
        _compat.set_crc32(options.crc32)

    return setup


def save(state_dict: Any, path: str | os.PathLike[str], options: Options) -> SaveResult:
    """Run the save pipeline above; see :func:`parallel_dcp.save` for the contract."""
    _compat.check_torch()
    start = time.perf_counter()
    flat, mapping = flatten_checked(state_dict)
    governor = MemoryGovernor(options.memory_ceiling())
    items = items_of(flat)
    for item in items:
        governor.check_item(item.key, TASK_MEMORY_BYTES + ITEM_MEMORY_BYTES + item.memory)
    workers = options.worker_count(len(flat))
    tasks = partition(items, workers, max_task_memory=governor.limit // workers)
    staging = Staging(path, overwrite=options.overwrite)
    try:
        staging.check_space(sum(item.nbytes for item in items) + _RECORD_OVERHEAD * len(items))
        results = _run_tasks(flat, tasks, staging, options, governor)
        merged = merge_metadata([r.value[0] for r in results]) if results else Metadata(state_dict_metadata={})
        merged.planner_data = mapping
        writer = CommitWriter(str(staging.path), str(staging.destination), sync_files=options.sync_files)
        commit(merged, [r.value[1] for r in results], writer)
        staging.publish()
    except BaseException:
        staging.discard()
        raise
    files = sum(1 for name in os.listdir(staging.destination) if name.endswith(".distcp"))
    return SaveResult(
        path=str(staging.destination),
        bytes=sum(t.nbytes for t in tasks),
        files=files,
        tasks=len(tasks),
        workers=options.worker_count(len(tasks)) if tasks else 0,
        seconds=time.perf_counter() - start,
        per_worker=_per_worker(results),
        memory_limit=governor.limit,
        peak_memory=governor.peak,
    )


def _run_tasks(
    flat: dict[str, Any], tasks: list[Task], staging: Staging, options: Options, governor: MemoryGovernor
) -> list[TaskResult[Any]]:
    if not tasks:
        return []
    results: list[TaskResult[Any]] = []
    with (
        Progress(total=sum(t.nbytes for t in tasks), enabled=options.progress, desc="save") as bar,
        WorkerPool(
            options.worker_count(len(tasks)),
            _save_handler(flat, str(staging.path), options),
            initializer=_worker_setup(options),
        ) as pool,
    ):
        for result in pool.run(tasks, governor=governor, task_timeout=options.task_timeout, retries=options.retries):
            results.append(result)
            bar.update(result.task.nbytes)
    return results


def _per_worker(results: list[TaskResult[Any]]) -> list[WorkerStats]:
    stats: dict[int, WorkerStats] = {}
    for r in results:
        old = stats.get(r.worker, WorkerStats(r.worker, 0, 0, 0.0))
        stats[r.worker] = WorkerStats(r.worker, old.tasks + 1, old.bytes + r.task.nbytes, old.seconds + r.seconds)
    return [stats[w] for w in sorted(stats)]
