"""What the coordinator of a :class:`~parallel_dcp.engine.pool.WorkerPool` sends its workers
besides plain tasks, and ``gc_paused``, which both sides use around their pickles. (Kept apart
from engine/pool.py, whose failure handling is long enough on its own.)"""

from __future__ import annotations

import contextlib
import gc
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.remote_memory import RemoteBytes

__all__ = ["Ahead", "NewHandler", "TaskPart", "gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection inside: building many objects (a task's metadata for 6,000 keys)
    otherwise triggers collections that walk the caller's whole heap, a 15x slowdown when the
    caller holds a state dict of 50,000 tensors."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True, slots=True)
class NewHandler:
    """Sent before a worker's first task of a run that brings its own handler: the pickled
    handler lies in the coordinator's memory, and the worker copies it out (remote_memory), so
    the coordinator sends each worker a few bytes, however large the job."""

    pickled: RemoteBytes


@dataclass(frozen=True, slots=True)
class Ahead:
    """A task sent to a worker that is still busy with its previous one (``WorkerPool.run(handler=)``):
    the pickled task lies in the coordinator's memory until the worker has replied for it, and
    the worker copies it out when it takes it, so the coordinator never blocks on a pipe the
    worker is not reading (a part of thousands of keys does not fit a pipe's buffer)."""

    pickled: RemoteBytes

    def load(self) -> Any:
        data = self.pickled.fetch()
        with gc_paused():
            return pickle.loads(data)


@dataclass(frozen=True, slots=True)
class TaskPart:
    """A task with the part of the job only it needs (``WorkerPool.run(parts=)``): the worker runs
    ``handler.with_part(part, task)(task)``, so a handler that outlives one job is sent without the
    job's per-key data and each worker receives only its own tasks' keys."""

    task: Task
    part: Any
    # ``task`` pickled, where the pool kept it from an earlier run of the same tasks (a Saver's
    # saves of one layout): pickled in its place, so that its keys (thousands of strings) are not
    # pickled again by the coordinator at every save. The worker gets the task; this is None there.
    pickled_task: bytes | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        if self.pickled_task is None:
            return (TaskPart, (self.task, self.part))
        return (_task_part, (self.pickled_task, self.part))


def _task_part(pickled_task: bytes, part: Any) -> TaskPart:
    """A :class:`TaskPart` unpickled from its task's kept pickle (``TaskPart.__reduce__``)."""
    with gc_paused():
        task = pickle.loads(pickled_task)
    return TaskPart(task, part)
