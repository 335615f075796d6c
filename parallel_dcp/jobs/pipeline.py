"""The write pipeline of every job (save, convert): one coordinator, forked workers, one commit.

source: state_dict in memory | safetensors | torch.save | DCP   (formats/: headers only here)
  │ flatten (DCP's own rules) and check: keys, devices, layouts   ── bad input fails here
  │ memory governor: an item that can never fit fails here
  ▼
partition ── disjoint tasks balanced by bytes, largest first; task i writes part i
  │
  ▼                 stage: lock the destination, note this save as the owner (destination.py)
WorkerPool (fork: workers read the state dict copy-on-write, no tensor bytes in pipes)
  │ worker: read its keys (lazily, mmap), cast, then write them (targets.py) into the
  │ destination itself, under names carrying this save's id:
  │   DCP: partial_save(keys, FileSystemWriter(dst), part_idx=i) → __i_<save id>_0.distcp
  │   safetensors / torch: one shard file per task (a hidden temporary name until the commit)
  │ ◀── (Metadata, [WriteResult], checksums) per task, pickled through the pipe
  ▼
DCP: merge_metadata + planner_data of the whole source (so nesting survives)
  │ commit: .metadata in one atomic rename (or one upload), then the manifest
  ▼
publish: the replaced checkpoint's own files removed; the lock released
any failure (SIGTERM included) before the commit: workers killed and reaped, this save's files
removed, the destination as it was

Longer than 300 lines because the diagram, SaveResult and the plan, run and result steps of the
one pipeline are kept together so it reads top to bottom.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from parallel_dcp import _compat
from parallel_dcp.engine import progress
from parallel_dcp.engine.chunks import MIN_MEMORY_CHUNK_BYTES, chunk_threshold
from parallel_dcp.engine.memory import (
    ITEM_MEMORY_BYTES,
    TASK_MEMORY_BYTES,
    WORKER_MEMORY_BYTES,
    MemoryGovernor,
    parse_size,
)
from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.pool import TaskResult, WorkerPool, gc_paused
from parallel_dcp.engine.threads import THREAD_MIN_ITEM_BYTES, ThreadPool, plain_value
from parallel_dcp.formats.memory_format import MemorySource
from parallel_dcp.jobs.targets import Job, Target
from parallel_dcp.options import Options
from parallel_dcp.storage.location import CLIENT_MEMORY, Remote
from parallel_dcp.storage.protocol import WriteLocation

__all__ = ["SaveResult", "WorkerStats", "run_job", "terminate_as_interrupt"]

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
    """What a job did. ``gib_per_s`` is the bytes of tensor data over the whole wall time.

    ``peak_memory`` is the highest memory the job added to its process tree in the governor's
    samples (taken about once a second while resident sizes prove the job far under the limit,
    every 50 ms otherwise), next to the ``memory_limit`` it ran under.
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
    keys: int = 0
    format: str = "dcp"
    executor: str = "processes"
    # Seconds of each phase of the job, in the coordinator's wall time: ``plan`` (open and
    # flatten the source, split and partition, create the staging path), ``fork`` (start the
    # workers), ``write`` (until the last task's result is back), ``merge`` (join the tasks'
    # metadata) and ``commit`` (write .metadata and the manifest, publish).
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def gib_per_s(self) -> float:
        return self.bytes / 2**30 / self.seconds if self.seconds > 0 else 0.0


def _handler(job: Job, target: Target, staging: WriteLocation, options: Options) -> Any:
    def run(task: Task) -> Any:
        try:
            return target.write(job, task, job.read(task.keys), staging, options)
        finally:
            job.source.release()
            progress.flush()

    return run


def _worker_setup(options: Options) -> Any:
    def setup() -> None:
        # Parallelism comes from processes; intra-op threads in each would only fight for cores.
        torch.set_num_threads(1)
        _compat.set_crc32(options.crc32)

    return setup


def run_job(
    job: Job, target: Target, options: Options, governor: MemoryGovernor, *, start: float | None = None
) -> SaveResult:
    """Plan, check, run and commit one job on this node; on any failure the destination is as it
    was. (Across the ranks of a torchrun job the same steps run in :mod:`parallel_dcp.jobs.distributed`;
    :func:`parallel_dcp.jobs.runner.run_job` picks one.)

    ``governor`` must have been created before the source was opened, so that whatever opening
    it loaded counts against the limit.
    """
    _compat.check_torch()
    start = time.perf_counter() if start is None else start
    with gc_paused():
        plan = plan_job(job, target, options, governor)
    job, tasks, workers = plan.job, plan.tasks, plan.workers
    with terminate_as_interrupt():
        staging = target.stage(options.overwrite, protect=list(job.source.files))
        phases: dict[str, float] = {}
        try:
            staging.expect(target.output_names(tasks))
            staging.check_space(needed_space(job))
            phases["plan"] = time.perf_counter() - start
            began = time.perf_counter()
            results = run_tasks(
                job, target, tasks, staging.location, options, governor, min(workers, len(tasks)), phases=phases
            )
            phases["write"] = time.perf_counter() - began - phases.get("fork", 0.0)
            began = time.perf_counter()
            files = target.commit(job, tasks, [r.value for r in results], staging, options)
            staging.publish()
            phases["merge"] = target.merge_seconds
            phases["commit"] = time.perf_counter() - began - target.merge_seconds
        except BaseException:
            staging.discard()
            raise
    return result_of(target, job, tasks, workers, results, files, governor, options, start, phases)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt while a job runs, so it ends as Ctrl-C does: workers
    stopped, this save's files removed, nothing committed (only in the main thread, where
    Python delivers signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass(frozen=True, slots=True)
class Plan:
    """A job's units (chunks split), its tasks, and how many workers run them."""

    job: Job
    tasks: list[Task]
    workers: int
    threshold: int


def plan_job(job: Job, target: Target, options: Options, governor: MemoryGovernor, *, scale: int = 1) -> Plan:
    """Split, check every unit against the limit, and plan the tasks (before anything is written).

    ``scale`` multiplies the workers the tasks are planned for (the ranks of a distributed job).

    Raises:
        MemoryLimitExceeded: a unit, or a whole-file output, can never fit under the limit.
    """
    if isinstance(target.path, Remote) or isinstance(job.source.location, Remote):
        governor.worker_extra = CLIENT_MEMORY
    threshold = 0
    if target.splits_tensors:  # only DCP can hold one tensor as several chunks
        io = target.io_memory(sum(job.out_bytes(k) for k in job.keys))
        # A split may give every worker work, however few the keys; under a tight limit, as many
        # workers as leave each task room for a chunk.
        most = options.worker_count(2**31)
        while most > 1 and _chunk_room(governor.task_budget(most) - io) < MIN_MEMORY_CHUNK_BYTES:
            most -= 1
        threshold = _chunk_threshold(job, options, most * scale, governor.task_budget(most) - io)
        job = job.split(threshold)
    workers = governor.workers_for(((key, job.memory(key)) for key in job.keys), options.worker_count(len(job.keys)))
    tasks = target.plan(job, workers * scale, governor.task_budget(workers))
    for task in tasks:  # a whole-file output is one task: it must fit as a whole
        if len(task.keys) > 1:
            governor.check_item(
                f"{len(task.keys)} keys written as one file to {target.path}", task.memory + WORKER_MEMORY_BYTES
            )
    return Plan(job, tasks, workers, threshold)


def needed_space(job: Job) -> int:
    """Bytes the output will take, records' overhead and non-tensor values included."""
    values = sum(job.memory(k) for k in job.keys if k in job.source.values and k not in job.source.entries)
    return sum(job.out_bytes(k) for k in job.keys) + values + _RECORD_OVERHEAD * len(job.keys)


def result_of(
    target: Target,
    job: Job,
    tasks: list[Task],
    workers: int,
    results: list[TaskResult[Any]],
    files: int,
    governor: MemoryGovernor,
    options: Options,
    start: float,
    phases: dict[str, float] | None = None,
) -> SaveResult:
    return SaveResult(
        path=str(target.path),
        bytes=sum(t.nbytes for t in tasks),
        files=files,
        tasks=len(tasks),
        workers=min(workers, len(tasks)),
        seconds=time.perf_counter() - start,
        per_worker=_per_worker(results),
        memory_limit=governor.limit,
        peak_memory=governor.peak,
        keys=len(job.source_keys()),  # the keys written, not the chunks they were split into
        format=target.kind,
        executor=choose_executor(job, options),
        phases={"plan": 0.0, "fork": 0.0, "write": 0.0, "merge": 0.0, "commit": 0.0} | (phases or {}),
    )


def _chunk_room(budget: int) -> int:
    """The largest chunk a task with ``budget`` bytes can hold: a chunk may cost twice its bytes
    in a worker (a mapped source plus DCP's copy of the view)."""
    return (budget - TASK_MEMORY_BYTES - ITEM_MEMORY_BYTES) // 2


def _chunk_threshold(job: Job, options: Options, workers: int, budget: int) -> int:
    if options.chunk_size is not None:
        return parse_size(options.chunk_size)
    total = sum(job.out_bytes(key) for key in job.keys)
    return chunk_threshold(total, workers, _chunk_room(budget))


def choose_executor(job: Job, options: Options) -> str:
    """``"threads"`` or ``"processes"`` for this job (see :class:`Options` ``executor``)."""
    if options.executor != "auto":
        return options.executor
    if not isinstance(job.source, MemorySource) or options.retries or options.task_timeout is not None:
        return "processes"
    if options.compress is not None:
        return "processes"  # compression is CPU work: one process per worker scales whatever zstd does with the GIL
    if not all(plain_value(v) for v in job.source.values.values()):
        return "processes"  # pickling user objects runs their code: keep it out of the caller
    sizes = [job.out_bytes(u) for u in job.keys if u in job.chunks or u in job.source.entries]
    return "threads" if sizes and sum(sizes) / len(sizes) >= THREAD_MIN_ITEM_BYTES else "processes"


def run_tasks(
    job: Job,
    target: Target,
    tasks: list[Task],
    staging: WriteLocation,
    options: Options,
    governor: MemoryGovernor,
    workers: int,
    *,
    phases: dict[str, float] | None = None,
) -> list[TaskResult[Any]]:
    """Run ``tasks`` on ``workers`` threads or forked processes; the results in task order.
    ``phases["fork"]`` gets the seconds spent starting the pool."""
    if not tasks:
        return []
    results: list[TaskResult[Any]] = []
    handler = _handler(job, target, staging, options)
    label = "save" if isinstance(job.source, MemorySource) else "convert"
    with progress.Progress(total=sum(t.nbytes for t in tasks), enabled=options.progress, desc=label) as bar:
        began = time.perf_counter()
        if choose_executor(job, options) == "threads":
            with ThreadPool(workers, handler, initializer=lambda: _compat.set_crc32(options.crc32)) as threads:
                if phases is not None:
                    phases["fork"] = time.perf_counter() - began
                for result in threads.run(tasks, governor=governor, on_tick=bar.refresh):
                    results.append(result)
                    bar.refresh()
        else:
            with WorkerPool(workers, handler, initializer=_worker_setup(options)) as pool:
                if phases is not None:
                    phases["fork"] = time.perf_counter() - began
                for result in pool.run(
                    tasks,
                    governor=governor,
                    task_timeout=options.task_timeout,
                    retries=options.retries,
                    on_tick=bar.refresh,
                ):
                    results.append(result)
                    bar.refresh()
    return sorted(results, key=lambda r: r.task.index)


def _per_worker(results: list[TaskResult[Any]]) -> list[WorkerStats]:
    stats: dict[int, WorkerStats] = {}
    for r in results:
        old = stats.get(r.worker, WorkerStats(r.worker, 0, 0, 0.0))
        stats[r.worker] = WorkerStats(r.worker, old.tasks + 1, old.bytes + r.task.nbytes, old.seconds + r.seconds)
    return [stats[w] for w in sorted(stats)]
