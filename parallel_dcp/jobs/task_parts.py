"""Each worker of a pool that outlives one job receives only what its own tasks need.

A Saver's workers (and the workers ``save()`` keeps) did not fork from the job: the job travels
to them. Pickled whole, every worker copied and unpickled every key (50,000 keys: ~2.7 us a key
per worker, whatever share of the keys it writes): O(keys x workers). Instead:

    coordinator                                        worker
    ───────────                                        ──────
    handler with the job's shell (no key) ── once ──▶  loaded before its first task
    per task: its units' places in the job, its        with_part(part, task): a Job of the
      chunks, and its source keys' columns              task's units only, its source built
      (source.part), pickled; made while the workers    from the columns (one entry per key)
      run the tasks before it           ── with task ──▶

Every key is sent and unpickled once, by the worker that writes it; the coordinator slices its
columns with a few C passes per task.

A task whose keys include non-tensor values travels as two pickles: its part without the values
(kept, as bytes, from one save of a layout to the next) and the values as they are now (this
save's). Pickled as one, a task of 12,500 tensor keys and one value was pickled again every save
(~11 ms of the coordinator's time at 50,000 keys) for the sake of the value alone.
"""

from __future__ import annotations

import collections
import dataclasses
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from parallel_dcp.engine.chunks import Chunk
from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.pool import gc_paused
from parallel_dcp.errors import InvalidStateDictError
from parallel_dcp.formats.remote_memory_source import RemoteMemorySource, SourcePart
from parallel_dcp.jobs.targets import Job

__all__ = ["JobPart", "JobParts", "KeptPart", "ValuedPart", "job_parts", "load_part", "part_job"]


@dataclass(frozen=True, slots=True)
class JobPart:
    """What a worker needs of the job for one task: each unit's place in the job's keys (where its
    ``.metadata`` entry goes), the units that are chunks, and the source's columns for their keys."""

    positions: list[int]
    chunks: dict[str, Chunk]
    source: SourcePart


@dataclass(frozen=True, slots=True)
class ValuedPart:
    """A task's part whose keys include non-tensor values: the :class:`JobPart` without them,
    pickled (``part``: the same every save of a layout), and the keys of the values, whose
    contents each save sends as they are then."""

    part: bytes
    values: tuple[str, ...]


# What a layout keeps of a task's part from one save to the next: its pickled JobPart where it
# holds no value, else a ValuedPart.
KeptPart = bytes | ValuedPart


class JobParts:
    """In the coordinator: ``shell`` (the job without keys, pickled once for every worker) and,
    called with a task, that task's :class:`JobPart`, pickled. :meth:`ahead` (the pool calls it
    before it waits on its workers) makes the next task's part meanwhile, so a worker that
    finishes a task gets its next one without waiting for its part to be made."""

    def __init__(
        self,
        job: Job,
        source: RemoteMemorySource,
        tasks: Sequence[Task] = (),
        kept: dict[int, KeptPart] | None = None,
    ) -> None:
        self.job = job
        self.source = source
        self.shell = Job(source.shell(), (), job.dtype)
        self.order = list(tasks)  # the order to dispatch them in
        self._upcoming = collections.deque(tasks)  # in that order
        self._made: dict[int, bytes] = {}
        self._sent: set[int] = set()
        # Parts of these very tasks, made by an earlier save of the same layout whose tensors lay
        # where these lie (jobs/plan_reuse.py): taken as they are; parts made here are added.
        self._kept = kept

    def __call__(self, task: Task) -> bytes:
        self._sent.add(task.index)
        made = self._made.pop(task.index, None)
        return made if made is not None else self._make(task)

    def ahead(self) -> None:
        """Make the next unsent task's part now (one per call: a wait is delayed by one part)."""
        while self._upcoming and (self._upcoming[0].index in self._sent or self._upcoming[0].index in self._made):
            self._upcoming.popleft()
        if self._upcoming:
            task = self._upcoming.popleft()
            self._made[task.index] = self._make(task)

    def _make(self, task: Task) -> bytes:
        kept = self._kept
        made = kept.get(task.index) if kept is not None else None
        if isinstance(made, bytes):
            return made
        if made is None:
            made = self._part(task)
            if kept is not None:
                kept[task.index] = made
            if isinstance(made, bytes):
                return made
        # The part without its values as it was pickled, and the values as they are now.
        values = {key: self.source.values[key] for key in made.values}
        try:
            return pickle.dumps((made.part, values), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # which value, by name (DCP pickles each value it saves: so must we)
            raise _unpicklable(values, exc) from exc

    def _part(self, task: Task) -> KeptPart:
        """``task``'s part, pickled (without its values, if it has any: see :class:`ValuedPart`)."""
        # Lists of a task's shapes and strides, thousands of tuples: no collection walking the
        # caller's heap meanwhile (one took 0.19 s against 0.02 s for the part itself).
        with gc_paused():
            units, chunks = task.keys, self.job.chunks
            if chunks:
                picked = {unit: chunks[unit] for unit in units if unit in chunks}
                keys = list(dict.fromkeys(chunks[u].key if u in picked else u for u in units))
            else:
                picked, keys = {}, list(units)
            part = JobPart(list(map(self.job.positions().__getitem__, units)), picked, self.source.part(keys))
            values = tuple(part.source.values)
            if values:
                part = dataclasses.replace(part, source=dataclasses.replace(part.source, values={}))
            made = pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL)
        return ValuedPart(made, values) if values else made


def _unpicklable(values: dict[str, Any], failure: Exception) -> InvalidStateDictError:
    """The error for ``values`` that ``pickle`` refused (``failure``), naming the first that fails alone."""
    for key, value in values.items():
        try:
            pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            return InvalidStateDictError(
                f"value {key!r} cannot be pickled ({type(exc).__name__}: {exc}); nothing was committed"
            )
    return InvalidStateDictError(f"the values {sorted(values)} cannot be pickled ({type(failure).__name__}: {failure})")


def job_parts(job: Job, tasks: Sequence[Task] = (), kept: dict[int, KeptPart] | None = None) -> JobParts | None:
    """The job sent per task (``tasks``: in the order they are dispatched), where its source can
    be (an in-memory state dict read remotely); None otherwise (the job then travels whole).
    ``kept``: parts of these tasks an earlier save made, still right (see :class:`JobParts`)."""
    return JobParts(job, job.source, tasks, kept) if isinstance(job.source, RemoteMemorySource) else None


def load_part(pickled: bytes) -> JobPart:
    """A task's :class:`JobPart` from what :class:`JobParts` sent: one pickle, or (a part with
    values) the part without them and the values."""
    with gc_paused():
        loaded: JobPart | tuple[bytes, dict[str, Any]] = pickle.loads(pickled)
        if not isinstance(loaded, tuple):
            return loaded
        plain, values = loaded
        part: JobPart = pickle.loads(plain)
    return dataclasses.replace(part, source=dataclasses.replace(part.source, values=values))


def part_job(shell: Job, pickled: bytes, task: Task) -> Job:
    """In a worker: the job of ``task``'s units only, from the shell it received once and the
    task's pickled :class:`JobPart`."""
    source = shell.source
    if not isinstance(source, RemoteMemorySource):
        raise TypeError(f"a job part needs a remote in-memory source, got {type(source).__name__}")
    part = load_part(pickled)
    units = task.keys
    positions = dict(zip(units, part.positions, strict=True))
    return Job(source.with_part(part.source), units, shell.dtype, part.chunks, _positions=positions)
