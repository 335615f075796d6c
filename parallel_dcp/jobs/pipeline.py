"""The write pipeline of every job (save, convert): one coordinator, forked workers, one commit.

source: state_dict in memory | safetensors | torch.save | DCP   (formats/: headers only here)
  │ flatten (DCP's own rules) and check: keys, devices, layouts   ── bad input fails here
  │ memory governor: an item that can never fit fails here
  ▼
partition ── disjoint tasks balanced by bytes, largest first; task i writes part i
  │
  ▼                 stage: lock the destination, note this save as the owner (destination.py);
  │                 with resume, what a dead conversion finished is kept (staged.py: the one seam)
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
import dataclasses
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any

import fsspec.core  # noqa: F401  (see below)
import numpy.ctypeslib  # noqa: F401
import torch
import torch.utils.serialization.config

from parallel_dcp import _compat
from parallel_dcp.engine import progress
from parallel_dcp.engine.chunks import MIN_MEMORY_CHUNK_BYTES, chunk_threshold
from parallel_dcp.engine.held_interrupts import HeldInterrupts
from parallel_dcp.engine.memory import (
    ITEM_MEMORY_BYTES,
    TASK_MEMORY_BYTES,
    WORKER_MEMORY_BYTES,
    MemoryGovernor,
    format_bytes,
    parse_size,
)
from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.pool import TaskResult, WorkerPool
from parallel_dcp.engine.threads import THREAD_MIN_ITEM_BYTES, ThreadPool, plain_value
from parallel_dcp.errors import SourceChecksumError
from parallel_dcp.formats.memory_format import MemorySource
from parallel_dcp.jobs import fallback
from parallel_dcp.jobs.source_check import as_source_error, check_task, plan_checks
from parallel_dcp.jobs.staged import stage_job
from parallel_dcp.jobs.streamed import streamed_data
from parallel_dcp.jobs.targets import Job, Target, task_file_names
from parallel_dcp.jobs.task_parts import job_parts, part_job
from parallel_dcp.options import Options
from parallel_dcp.storage import direct_write
from parallel_dcp.storage.location import CLIENT_MEMORY, Remote, clients_opened_since
from parallel_dcp.storage.protocol import WriteLocation
from parallel_dcp.storage.read_choice import ReadChoice

__all__ = ["SaveResult", "WorkerStats", "run_job", "terminate_as_interrupt"]

# Each torch.save record adds about 1 KiB of zip headers and pickle to its tensor's bytes.
_RECORD_OVERHEAD = 1024


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """What one worker did: tasks run, bytes written, seconds spent inside its tasks, and
    ``setup_seconds`` spent loading the job before its first task (a Saver's workers, which
    receive each job; 0 for forked workers and threads, which inherit it), and
    ``handling_seconds`` spent on its tasks outside them (taking each task in, pickling its
    result; 0 for threads), and ``handover_seconds`` handing its results over (sending each into
    its pipe, but the last of a run, which falls before the commit; 0 for threads)."""

    worker: int
    tasks: int
    bytes: int
    seconds: float
    setup_seconds: float = 0.0
    handling_seconds: float = 0.0
    handover_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class SaveResult:
    """What a job did. ``gib_per_s`` is the bytes of tensor data over the whole wall time.

    ``peak_memory`` is the highest memory the job added to its process tree in the governor's
    samples (taken about once a second while resident sizes prove the job far under the limit,
    every 50 ms otherwise), next to the ``memory_limit`` it ran under: 0 for a job that ended
    before its first sample (under a second, far under the limit: the resident sizes proved it),
    and below the true peak where the peak fell between samples.
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
    # workers and measure what they cost idle), ``write`` (until the last task's result is
    # back), ``merge`` (join the tasks' metadata) and ``commit`` (write .metadata and the
    # manifest, publish).
    phases: dict[str, float] = field(default_factory=dict)
    # Of the write phase, the coordinator's own seconds (handing tasks out, taking results in, the
    # governor's readings), spent while the workers work: on a pool that outlives the job (a
    # Saver's), where each worker has its next task before it finishes one; None elsewhere.
    coordinator_write_seconds: float | None = None
    # What ``resume`` kept of a dead conversion (bytes of tensor data of its finished, re-hashed
    # tasks) and what this run wrote; a fresh run keeps 0 and writes ``bytes``.
    bytes_kept: int = 0
    bytes_rewritten: int = 0
    resumed: bool = False
    # How the shards reached local files: "direct" (O_DIRECT, at least one file) or "buffered".
    io: str = "buffered"
    # How a conversion read its local source and why (for ``io="auto"``: the rates measured;
    # storage.copy_choice for safetensors -> DCP); None where no choice was made.
    read_choice: ReadChoice | None = None

    @property
    def gib_per_s(self) -> float:
        return self.bytes / 2**30 / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class TaskHandler:
    """What a worker runs for each task: read its units, write them, record, send the result.
    Picklable (a pool that outlives one job receives it per job: ``WorkerPool.run(handler=)``)."""

    job: Job
    target: Target
    staging: WriteLocation
    options: Options
    recorder: Callable[[Task, Any], None] | None = None
    # How many aligned write buffers each worker keeps from one file to the next (a Saver's
    # workers, which outlive the job: see jobs/saver.py); None leaves the worker as it is.
    keep_buffers: int | None = None

    def __reduce__(self) -> Any:
        # The job without its planning caches (sizes, positions: rebuilt where needed).
        job = Job(
            self.job.source,
            self.job.keys,
            self.job.dtype,
            self.job.chunks,
            keep_dtype=self.job.keep_dtype,
            checks=self.job.checks,
        )
        return (TaskHandler, (job, self.target, self.staging, self.options, self.recorder, self.keep_buffers))

    def with_part(self, part: Any, task: Task) -> TaskHandler:
        """In a worker of a pool that outlives one job: this handler, whose job is the shell, for
        ``task``'s part of the job only (:mod:`parallel_dcp.jobs.task_parts`)."""
        return dataclasses.replace(self, job=part_job(self.job, part, task))

    def prepare(self) -> None:
        """In a worker that did not fork for this job: what ``_worker_setup`` does at a fork."""
        _worker_setup(self.options)()
        if self.keep_buffers is not None:
            direct_write.keep_buffers(self.keep_buffers)

    def __call__(self, task: Task) -> Any:
        try:
            # The source files given to this task (plan_checks) are hashed against their checksums
            # first: that pass reads them from storage, the reads below find them in the page cache.
            check_task(self.job.checks, task)
            if self.options.retries and isinstance(self.staging.root, Path):
                # A retried task writes its files again under the same names, each created new:
                # what its dead attempt left goes first (this save's names only).
                self.staging.clear_attempt(task_file_names(self.target, task, self.staging.save_id))
            # A conversion to DCP writes what it can straight from the source's files, reading ahead.
            with streamed_data(self.job, self.target, task) as streamed:
                data = streamed if streamed is not None else self.job.read(task.keys)
                result = self.target.write(self.job, task, data, self.staging, self.options)
            if self.recorder is not None:  # the task's files are complete: its done record, for resume
                self.recorder(task, result)
            return self.target.outgoing(self.job, result)
        finally:
            self.job.source.release()
            progress.flush()


# The modules imported above are ones every worker otherwise imports at its first task (the
# location layer, numpy's ctypes bridge for aligned buffers, torch's record serialization):
# imported here, before any job measures its baseline and forks, they are shared by the workers
# instead of costing each of them private memory the governor's idle cost did not plan for.


def _worker_setup(options: Options) -> Any:
    def setup() -> None:
        # Parallelism comes from processes; intra-op threads in each would only fight for cores.
        torch.set_num_threads(1)
        _compat.set_crc32(options.crc32)

    return setup


def run_job(
    job: Job,
    target: Target,
    options: Options,
    governor: MemoryGovernor,
    *,
    start: float | None = None,
    pool: WorkerPool | None = None,
    before_tasks: Callable[[WriteLocation, int], None] | None = None,
    keep_buffers: int | None = None,
) -> SaveResult:
    """Plan, check, run and commit one job on this node (on ``pool``'s workers where given); on any
    failure the destination is as it was, except that a conversion leaves its finished tasks for
    ``resume`` (see :mod:`parallel_dcp.jobs.staged`, the one place resume is reached). (Across the
    ranks of a torchrun job the same steps run in :mod:`parallel_dcp.jobs.distributed`;
    :func:`parallel_dcp.jobs.runner.run_job` picks one.)

    ``governor`` must have been created before the source was opened, so that whatever opening
    it loaded counts against the limit. ``before_tasks(staging, workers)`` runs once the job and
    its destination are checked and staged, before any worker starts (a conversion measures how
    to read its source there). ``keep_buffers``: see ``TaskHandler.keep_buffers`` (``pool``'s
    workers; the caller charges what they keep: ``MemoryGovernor.worker_extra``).
    """
    _compat.check_torch()
    start = time.perf_counter() if start is None else start
    with terminate_as_interrupt():
        # The one place a job meets resume: the staged job knows which tasks a resume kept, what
        # each task records for a later one, and what a failure leaves (see jobs/staged.py).
        staged = stage_job(job, target, options, governor, plan_job)
        job, tasks, workers, staging = staged.job, staged.tasks, staged.workers, staged.staging
        todo = staged.todo
        phases: dict[str, float] = {}
        writing = False
        held = HeldInterrupts()  # Ctrl-C while committing and publishing: delivered after them
        try:
            staging.check_space(max(0, needed_space(job) - staged.bytes_kept))
            if before_tasks is not None and todo:  # (a resume that kept every task runs none)
                before_tasks(staging.location, min(workers, len(todo)))
            phases["plan"] = time.perf_counter() - start
            began = time.perf_counter()
            writing = True  # a failure from here to the commit leaves the finished tasks for resume
            executor = "saver" if pool is not None else choose_executor(job, options)
            results = run_tasks(
                job,
                target,
                todo,
                staging.location,
                options,
                governor,
                min(workers, max(1, len(todo))),
                phases=phases,
                recorder=staged.recorder,
                kept=staged.bytes_kept,
                executor=executor,
                pool=pool,
                keep_buffers=keep_buffers,
            )
            phases["write"] = time.perf_counter() - began - phases.get("fork", 0.0)
            busy = None if pool is None or not todo else max(0.0, phases["write"] - pool.waited_seconds)
            writing = False
            began = time.perf_counter()
            with held:
                files = target.commit(job, tasks, staged.values(results), staging, options)
                staging.publish()
            phases["merge"] = target.merge_seconds
            phases["commit"] = time.perf_counter() - began - target.merge_seconds
        except BaseException as caught:
            # A damaged source keeps nothing for resume, not even a resumed run's: a task finished
            # before the verdict may have read the damaged bytes. (A copied side file found changed
            # at the commit, jobs/side_file_checks.py, is read by no task: it fails as a commit does.)
            failure = as_source_error(caught)
            damaged = isinstance(failure, SourceChecksumError) and writing
            staged.fail(failure, writing=writing and failure is caught, damaged=damaged)
            held.deliver()  # (a Ctrl-C held while the commit failed: raised, from the failure)
            if failure is caught:
                raise
            raise failure from caught
    held.deliver(committed=str(staging.location.root))
    result = result_of(target, job, tasks, workers, results, files, governor, options, start, phases, executor)
    return dataclasses.replace(
        result,
        bytes_kept=staged.bytes_kept,
        bytes_rewritten=sum(t.nbytes for t in todo),
        resumed=staged.resumed,
        coordinator_write_seconds=busy,
    )


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
    Before refusing, the planner falls back (:mod:`parallel_dcp.jobs.fallback`): buffered writes
    where ``io="auto"`` would write direct (whose aligned buffers count), then smaller chunks;
    a refusal names the smallest memory limit under which the job plans.

    Raises:
        MemoryLimitExceeded: a unit, or a whole-file output, can never fit under the limit.
    """
    remote = [target.path, job.source.location]
    if any(isinstance(location, Remote) for location in remote):
        governor.worker_extra = max(governor.worker_extra, CLIENT_MEMORY)
    # The coordinator's own connection, where this job opens it (the first on that storage in this
    # process): 16.4 MiB measured for s3fs, and the governor counts it in every reading. Planned
    # without it, a 128 MiB S3 -> S3 conversion under 96 MiB predicted 85.2 MiB and was read at
    # 95.7 (the test's 2 ms sampler: 81.1, 97.1 once in a suite run; 64.7 with the client open).
    governor.hold_coordinator(CLIENT_MEMORY * clients_opened_since(governor.started, remote))
    return fallback.plan_with_fallbacks(
        lambda gov, divisor: _plan_once(job, target, options, gov, scale=scale, divisor=divisor),
        target,
        governor,
        can_shrink=target.splits_tensors and options.chunk_size is None,
    )


def _plan_once(
    job: Job, target: Target, options: Options, governor: MemoryGovernor, *, scale: int, divisor: int
) -> Plan:
    """One attempt of :func:`plan_job`, chunks ``divisor`` times smaller than the room allows."""
    threshold = 0
    if target.splits_tensors:  # only DCP can hold one tensor as several chunks
        total = job.totals()[0]
        io = target.io_memory(total)
        # A split may give every worker work, however few the keys; under a tight limit, as many
        # workers as leave each task room for a chunk.
        most = options.worker_count(2**31)
        while most > 1 and _chunk_room(governor.task_budget(most) - io) < MIN_MEMORY_CHUNK_BYTES:
            most -= 1
        threshold = _chunk_threshold(total, options, most * scale, governor.task_budget(most) - io)
        if divisor > 1:
            threshold = max(
                MIN_MEMORY_CHUNK_BYTES, min(threshold, _chunk_room(governor.task_budget(most) - io)) // divisor
            )
        job = job.split(threshold, governor.admit_units)
    workers = governor.workers_for(_largest_need(job), options.worker_count(len(job.keys)))
    tasks = target.plan(job, workers * scale, governor.task_budget(workers))
    if job.checks is not None:  # every checksummed source file read goes to one task to hash
        checks, tasks = plan_checks(job.checks, tasks, job.chunks)
        job = dataclasses.replace(job, checks=checks)
    # Every task must fit as a whole beside its worker, as its admission will count it: a whole-file
    # output's task, and a task of one key with the output stream's buffers (a shard written with
    # O_DIRECT passed this plan and was refused at its admission, under the limit advised).
    # With more workers, each one's resting cost is held beside the largest task: as many as leave it room.
    resting = WORKER_MEMORY_BYTES + governor.worker_extra
    for task in tasks:
        if not task.keys:
            continue
        what = f"{len(task.keys)} keys written as one file to {target.path}" if len(task.keys) > 1 else task.keys[0]
        governor.check_item(what, task.memory + resting)
    largest = max((task.memory for task in tasks), default=0)
    workers = max(1, min(workers, (governor.limit - governor.reserved - largest) // resting))
    return Plan(job, tasks, workers, threshold)


def _largest_need(job: Job) -> list[tuple[str, int]]:
    """The unit whose worker allocates the most (the first of equals), all ``workers_for`` needs:
    if it fits, every unit does (found in one C pass over the sizes, not one call per key)."""
    _, most, place = job.totals()
    return [(job.keys[place], most)] if place >= 0 else []


def needed_space(job: Job) -> int:
    """Bytes the output will take, records' overhead and non-tensor values included."""
    entries, values = job.source.entries, job.source.values
    sizes = job.sizes()
    pickled = sum(sizes[k][1] for k in values if k in sizes and k not in entries)
    return int(job.totals()[0]) + pickled + _RECORD_OVERHEAD * len(job.keys)


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
    executor: str | None = None,
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
        executor=executor or choose_executor(job, options),
        phases={"plan": 0.0, "fork": 0.0, "write": 0.0, "merge": 0.0, "commit": 0.0} | (phases or {}),
        io="direct" if any(target.uses_direct(t.nbytes) for t in tasks) else "buffered",
    )


def _chunk_room(budget: int) -> int:
    """The largest chunk a task with ``budget`` bytes can hold: a chunk may cost twice its bytes
    in a worker (a mapped source plus DCP's copy of the view)."""
    return (budget - TASK_MEMORY_BYTES - ITEM_MEMORY_BYTES) // 2


def _chunk_threshold(total: int, options: Options, workers: int, budget: int) -> int:
    if options.chunk_size is not None:
        return parse_size(options.chunk_size)
    return chunk_threshold(total, workers, _chunk_room(budget))


def choose_executor(job: Job, options: Options) -> str:
    """``"threads"`` or ``"processes"`` for this job (see :class:`Options` ``executor``)."""
    if options.executor != "auto":
        return options.executor
    if not isinstance(job.source, MemorySource) or options.retries or options.task_timeout is not None:
        return "processes"
    if not all(plain_value(v) for v in job.source.values.values()):
        return "processes"  # pickling user objects runs their code: keep it out of the caller
    # Large tensors go to threads, compressed or not: zstandard compresses without the GIL
    # (measured, 582 MiB of bf16 at zstd:3: threads 1.27 s / 0.84 s at 1 / 2 workers, forked
    # processes 1.47 s / 0.96 s, which also pay the fork and the first touch of inherited pages).
    sizes = job.sizes()
    units = [*filter(job.source.entries.__contains__, sizes), *filter(job.chunks.__contains__, sizes)]  # C loops
    total = sum(map(itemgetter(0), map(sizes.__getitem__, units)))
    return "threads" if units and total / len(units) >= THREAD_MIN_ITEM_BYTES else "processes"


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
    recorder: Callable[[Task, Any], None] | None = None,
    kept: int = 0,
    executor: str | None = None,
    pool: WorkerPool | None = None,
    keep_buffers: int | None = None,
) -> list[TaskResult[Any]]:
    """Run ``tasks`` on ``workers`` threads or forked processes; the results in task order.
    ``phases["fork"]`` gets the seconds spent starting the pool; ``recorder`` runs in the worker
    after each task; ``kept``: bytes a resume kept (the bar says so, and counts the rest);
    ``executor``: the one :func:`choose_executor` picked, where the caller has it already;
    ``pool``: started workers that outlive this job (``parallel_dcp.Saver``) to run it on."""
    if not tasks:
        return []
    results: list[TaskResult[Any]] = []
    handler = TaskHandler(job, target, staging, options, recorder, keep_buffers)
    label = "save" if isinstance(job.source, MemorySource) else "convert"
    if kept:
        label += f" (resumed: {format_bytes(kept)} kept, rewriting {format_bytes(sum(t.nbytes for t in tasks))})"
    with progress.Progress(total=sum(t.nbytes for t in tasks), enabled=options.progress, desc=label) as bar:
        began = time.perf_counter()
        if pool is not None:
            if phases is not None:
                phases["fork"] = time.perf_counter() - began
            # Each worker receives the job's shell once and each task's keys with the task.
            parts = target.plans.job_parts(job, tasks) if target.plans is not None else job_parts(job, tasks)
            for result in pool.run(
                tasks if parts is None else parts.order,
                governor=governor,
                task_timeout=options.task_timeout,
                retries=options.retries,
                on_tick=bar.refresh,
                handler=handler if parts is None else dataclasses.replace(handler, job=parts.shell),
                parts=parts,
            ):
                results.append(result)
                progress.advance(result.task.nbytes)  # its workers do not share the bar's counter
                bar.refresh()
        elif (executor or choose_executor(job, options)) == "threads":
            with ThreadPool(workers, handler, initializer=lambda: _compat.set_crc32(options.crc32)) as threads:
                if phases is not None:
                    phases["fork"] = time.perf_counter() - began
                for result in threads.run(tasks, governor=governor, on_tick=bar.refresh):
                    results.append(result)
                    bar.refresh()
        else:
            job.positions()  # built here once, inherited by every fork (not once per worker)
            # One worker forked before the first task; the others as the work needs them.
            with WorkerPool(workers, handler, initializer=_worker_setup(options), start=1) as pool:
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
    if phases is not None:  # measuring the idle workers is part of starting them
        phases["fork"] = phases.get("fork", 0.0) + governor.settle_seconds
    return sorted(results, key=lambda r: r.task.index)


def _per_worker(results: list[TaskResult[Any]]) -> list[WorkerStats]:
    stats: dict[int, WorkerStats] = {}
    for r in results:
        old = stats.get(r.worker, WorkerStats(r.worker, 0, 0, 0.0))
        stats[r.worker] = WorkerStats(
            r.worker,
            old.tasks + 1,
            old.bytes + r.task.nbytes,
            old.seconds + r.seconds,
            old.setup_seconds + r.setup,
            old.handling_seconds + r.handling,
            old.handover_seconds + r.handover,
        )
    return [stats[w] for w in sorted(stats)]
