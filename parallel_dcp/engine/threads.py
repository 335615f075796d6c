"""Writer threads in the coordinator: the fast path for in-memory state dicts of large tensors.

    coordinator process
      ├ dispatch loop: admits tasks under the memory governor, as the process pool does
      └ thread i: handler(task) → torch.save records, written with the GIL released

Writing a large tensor is one ``write`` system call per record, and CPython releases the GIL for
it, so threads write large tensors in parallel. They also skip what forked workers pay: on the
VMs this was measured on, a forked child's first pass over inherited memory ran at ~0.1 s/GiB
slower than its parent (two threads wrote 2 GiB to /dev/shm in 0.33 s, two forked children in
0.52 s). Processes stay the choice for many small tensors (Python work, which the GIL
serializes), for sources read from disk, and whenever crash isolation (``retries``) or killing
(``task_timeout``, the memory watchdog) is needed: a thread cannot be killed. See
:func:`choose_executor`.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from parallel_dcp.engine.malloc import return_freed_memory
from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.pool import TaskResult
from parallel_dcp.errors import RemoteTraceback, WorkerError, describe_keys

__all__ = ["THREAD_MIN_ITEM_BYTES", "ThreadPool", "plain_value"]

# A job whose tensors average at least this many bytes is bytes-bound, not Python-bound.
THREAD_MIN_ITEM_BYTES = 1024 * 1024
_TICK_S = 0.1


class ThreadPool:
    """``WorkerPool``'s interface (``run`` yielding ``TaskResult``), with threads.

    Args:
        threads: how many tasks run at once.
        handler: runs one task; called in a pool thread.
        initializer: called once in each thread before its first task (thread-local settings).
    """

    def __init__(
        self, threads: int, handler: Callable[[Task], Any], initializer: Callable[[], None] | None = None
    ) -> None:
        self._handler = handler
        self._initializer = initializer
        self._threads = threads
        self._local = threading.local()
        self._names: dict[int, int] = {}
        self._executor = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="parallel_dcp-writer")

    def __enter__(self) -> ThreadPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        # Threads cannot be killed: on failure, pending tasks are cancelled and running ones finish.
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _call(self, task: Task) -> tuple[int, float, Any]:
        if not getattr(self._local, "ready", False):
            if self._initializer is not None:
                self._initializer()
            self._local.ready = True
        ident = threading.get_ident()
        worker = self._names.setdefault(ident, len(self._names))
        start = time.perf_counter()
        try:
            value = self._handler(task)
        except BaseException as exc:  # DCP raises CheckpointException, a BaseException
            raise _ThreadFailure(worker, exc, traceback.format_exc()) from exc
        finally:
            return_freed_memory()  # copies freed into malloc's arenas would otherwise stay counted
        return worker, time.perf_counter() - start, value

    def run(
        self,
        tasks: Sequence[Task],
        *,
        governor: MemoryGovernor | None = None,
        on_tick: Callable[[], None] | None = None,
    ) -> Iterator[TaskResult[Any]]:
        """Run every task, yielding results as they complete; the first failure is raised.

        Raises:
            WorkerError: a task raised; ``__cause__`` is its traceback.
            MemoryLimitExceeded: a task cannot fit beside the job's other memory, or the process
                went over the limit (no further task starts; running ones finish, unkillable).
        """
        pending = deque(tasks)
        running: dict[cf.Future[tuple[int, float, Any]], Task] = {}
        slots = self._threads
        while pending or running:
            while pending and len(running) < slots:
                task = pending[0]
                if governor is not None and not governor.admit_task(
                    task.index, task.keys, task.memory, others_running=bool(running)
                ):
                    break
                pending.popleft()
                running[self._executor.submit(self._call, task)] = task
            done, _ = cf.wait(running, timeout=_TICK_S, return_when=cf.FIRST_COMPLETED)
            for future in done:
                task = running.pop(future)
                if governor is not None:
                    governor.release(task.memory)
                try:
                    worker, seconds, value = future.result()
                except _ThreadFailure as failure:
                    exc = failure.error
                    raise WorkerError(
                        f"writer thread {failure.worker} raised {type(exc).__name__}: {exc} "
                        f"(task {task.index}, keys {describe_keys(task.keys)})",
                        worker=failure.worker,
                        keys=task.keys,
                        error_type=type(exc).__qualname__,
                    ) from RemoteTraceback(failure.trace)
                yield TaskResult(task=task, worker=worker, seconds=seconds, value=value)
            if governor is not None:
                governor.watch({})
            if on_tick is not None:
                on_tick()


_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})


def plain_value(value: Any) -> bool:
    """True for values whose pickling runs no user code (so a writer thread may pickle them)."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return True
    if isinstance(value, (list, tuple)):
        # A list of plain scalars (an optimizer's 25,000 param ids) in one C pass over the types.
        return set(map(type, value)) <= _ATOMS or all(plain_value(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain_value(v) for k, v in value.items())
    return False


class _ThreadFailure(Exception):
    def __init__(self, worker: int, error: BaseException, trace: str) -> None:
        super().__init__(str(error))
        self.worker = worker
        self.error = error
        self.trace = trace
