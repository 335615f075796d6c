"""What the coordinator of a :class:`~parallel_dcp.engine.pool.WorkerPool` sends its workers
besides plain tasks, ``gc_paused``, which both sides use around their pickles, and how a result's
large bytes travel back (:func:`pickled_result`). (Kept apart from engine/pool.py, whose failure
handling is long enough on its own.)"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.remote_memory import RemoteBytes

__all__ = ["Ahead", "NewHandler", "TaskPart", "gc_paused", "pickled_result", "read_buffers", "write_buffers"]


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


def pickled_result(value: Any) -> tuple[bytes, list[memoryview]]:
    """``value`` pickled, and the bytes it wraps in :class:`pickle.PickleBuffer` (a task's pickled
    ``.metadata`` runs: formats/lean.py) as raw views, sent after the pickle without a copy.
    Pickled in band (a copy each way), 15 MB of runs cost the coordinator ~13 ms at 50,000 keys:
    the pipe read into a buffer, the reply's bytes, then the runs' own, each a new copy."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return data, [buffer.raw() for buffer in buffers]


def write_buffers(fd: int, views: Sequence[memoryview]) -> None:
    """In the worker, right after its reply: the raw bytes of :func:`pickled_result`'s views."""
    for view in views:
        while view:
            view = view[os.write(fd, view) :]


def read_buffers(fd: int, sizes: Sequence[int]) -> list[memoryview]:
    """The raw buffers a worker sent behind its reply (:func:`write_buffers`), read straight into one
    new buffer (no copy in Python: the bytes pass from the kernel into the memory the result then
    uses), as read-only views.

    Raises:
        EOFError: the worker died before it sent them all."""
    whole = bytearray(sum(sizes))
    view = memoryview(whole)
    while view:
        got = os.readv(fd, [view])
        if got == 0:
            raise EOFError("the worker's pipe closed in the middle of its result")
        view = view[got:]
    views: list[memoryview] = []
    at = 0
    frozen = memoryview(whole).toreadonly()
    for size in sizes:
        views.append(frozen[at : at + size])
        at += size
    return views
