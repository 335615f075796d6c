"""Each worker of a pool that outlives one job receives only what its own tasks need.

A Saver's workers (and the workers ``save()`` keeps) did not fork from the job: the job travels
to them. Pickled whole, every worker copied and unpickled every key (50,000 keys: ~2.7 us a key
per worker, whatever share of the keys it writes): O(keys x workers). Instead:

    coordinator                                        worker
    ───────────                                        ──────
    handler with the job's shell (no key) ── once ──▶  loaded before its first task
    per task, as it is dispatched: its units'          with_part(part, task): a Job of the
      places in the job, its chunks, and its source     task's units only, its source built
      keys' columns (source.part)      ── with task ──▶  from the columns (one entry per key)

Every key is sent and unpickled once, by the worker that writes it; the coordinator slices its
columns with a few C passes per task.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel_dcp.engine.chunks import Chunk
from parallel_dcp.engine.partition import Task
from parallel_dcp.formats.remote_memory_source import RemoteMemorySource, SourcePart
from parallel_dcp.jobs.targets import Job

__all__ = ["JobPart", "JobParts", "job_parts", "part_job"]


@dataclass(frozen=True, slots=True)
class JobPart:
    """What a worker needs of the job for one task: each unit's place in the job's keys (where its
    ``.metadata`` entry goes), the units that are chunks, and the source's columns for their keys."""

    positions: list[int]
    chunks: dict[str, Chunk]
    source: SourcePart


class JobParts:
    """In the coordinator: ``shell`` (the job without keys, pickled once for every worker) and,
    called with a task, that task's :class:`JobPart`."""

    def __init__(self, job: Job, source: RemoteMemorySource) -> None:
        self.job = job
        self.source = source
        self.shell = Job(source.shell(), (), job.dtype)
        self._positions = job.positions()

    def __call__(self, task: Task) -> JobPart:
        units, chunks = task.keys, self.job.chunks
        if chunks:
            picked = {unit: chunks[unit] for unit in units if unit in chunks}
            keys = list(dict.fromkeys(chunks[u].key if u in picked else u for u in units))
        else:
            picked, keys = {}, list(units)
        return JobPart(list(map(self._positions.__getitem__, units)), picked, self.source.part(keys))


def job_parts(job: Job) -> JobParts | None:
    """The job sent per task, where its source can be (an in-memory state dict read remotely);
    None otherwise (the job then travels whole)."""
    return JobParts(job, job.source) if isinstance(job.source, RemoteMemorySource) else None


def part_job(shell: Job, part: JobPart, task: Task) -> Job:
    """In a worker: the job of ``task``'s units only, from the shell it received once."""
    source = shell.source
    if not isinstance(source, RemoteMemorySource):
        raise TypeError(f"a job part needs a remote in-memory source, got {type(source).__name__}")
    units = task.keys
    positions = dict(zip(units, part.positions, strict=True))
    return Job(source.with_part(part.source), units, shell.dtype, part.chunks, _positions=positions)
