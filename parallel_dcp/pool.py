"""A pool of forked worker processes that runs tasks and explains every way a worker can fail.

    coordinator                                  worker i (forked, inherits the job's data)
    ───────────                                  ──────────────────────────────────────────
    send (task_id, task) ───── pipe i ────────▶  handler(task)
    wait(pipes + sentinels)  ◀──── pipe i ─────  ("ok", result) | ("error", type, msg, traceback)
       │ a sentinel fires with no reply:  the worker died → WorkerCrashed(exit code / signal, keys)
       │ an "error" reply:                WorkerError(type, message, keys), __cause__ = traceback
       └ any failure: kill and reap every worker, raise; nothing is left running

Workers are forked, never spawned: the job's data (a state dict, an open checkpoint's metadata)
is read copy-on-write and never travels through a pipe. Only task descriptions and small results
(metadata, write results, statistics) do.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import multiprocess as mp
import multiprocess.connection as mp_connection

from parallel_dcp.errors import RemoteTraceback, WorkerCrashed, WorkerError, describe_exit, describe_keys
from parallel_dcp.partition import Task

__all__ = ["TaskResult", "WorkerPool"]

R = TypeVar("R")

_JOIN_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class TaskResult(Generic[R]):
    """What a task returned, with who ran it and how long it took inside the worker."""

    task: Task
    worker: int
    seconds: float
    value: R


def _worker_main(conn: Any, handler: Callable[[Task], Any], initializer: Callable[[], None] | None) -> None:
    # Ctrl-C goes to the whole process group; the coordinator decides how workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if initializer is not None:
        initializer()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the coordinator is gone
        if message is None:
            return
        task: Task = message
        start = time.perf_counter()
        try:
            value = handler(task)
            reply: tuple[Any, ...] = ("ok", time.perf_counter() - start, value)
        except BaseException as exc:  # DCP raises CheckpointException, a BaseException
            reply = ("error", type(exc).__qualname__, _message_of(exc), traceback.format_exc())
        conn.send(reply)


def _message_of(exc: BaseException) -> str:
    # CheckpointException keeps the per-rank errors in .failures; show them, not just the type.
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = "; ".join(f"{type(e).__name__}: {e}" for e in failures.values())
        return f"{exc} ({inner})"
    return str(exc) or type(exc).__name__


class WorkerPool:
    """Forked workers that run ``handler(task)`` for each task and send back its result.

    Use as a context manager; leaving it (normally or by an exception) stops and reaps every
    worker. After any task fails, the pool kills all workers before raising, so a failure never
    leaves processes running or tasks half-done behind the caller's back.
    """

    def __init__(
        self,
        workers: int,
        handler: Callable[[Task], Any],
        *,
        initializer: Callable[[], None] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        ctx = mp.get_context("fork")
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        try:
            for i in range(workers):
                parent_end, child_end = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_worker_main,
                    args=(child_end, handler, initializer),
                    name=f"parallel_dcp-worker-{i}",
                    daemon=True,
                )
                proc.start()
                child_end.close()
                self._conns.append(parent_end)
                self._procs.append(proc)
        except BaseException:
            self.kill()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            self.close()
        else:
            self.kill()

    def run(self, tasks: Sequence[Task]) -> Iterator[TaskResult[Any]]:
        """Run every task, yielding results as they complete (in completion order).

        Tasks are handed out in the given order to whichever worker is free.

        Raises:
            WorkerError: a task raised; ``__cause__`` is the worker's traceback.
            WorkerCrashed: a worker died while running a task.
        """
        pending = deque(tasks)
        running: dict[int, Task] = {}
        idle = deque(range(len(self._procs)))
        try:
            while pending or running:
                while pending and idle:
                    worker = idle.popleft()
                    task = pending.popleft()
                    self._conns[worker].send(task)
                    running[worker] = task
                waitables = [self._conns[w] for w in running] + [self._procs[w].sentinel for w in running]
                for ready in mp_connection.wait(waitables):
                    worker = self._worker_of(ready)
                    if worker not in running:
                        continue  # its reply and its sentinel were both ready; handled once
                    task = running.pop(worker)
                    yield self._receive(worker, task)
                    idle.append(worker)
        except BaseException:
            self.kill()
            raise

    def _worker_of(self, ready: Any) -> int:
        for i, (conn, proc) in enumerate(zip(self._conns, self._procs, strict=True)):
            if ready is conn or ready == proc.sentinel:
                return i
        raise AssertionError("wait() returned an object that is not ours")

    def _receive(self, worker: int, task: Task) -> TaskResult[Any]:
        conn = self._conns[worker]
        try:
            reply = conn.recv() if conn.poll() else None
        except (EOFError, OSError):
            reply = None
        if reply is None:
            proc = self._procs[worker]
            proc.join(_JOIN_TIMEOUT_S)
            raise WorkerCrashed(
                f"worker {worker} (pid {proc.pid}) died with {describe_exit(proc.exitcode)} while running "
                f"task {task.index} with keys {describe_keys(task.keys)}" + _hint(proc.exitcode),
                worker=worker,
                keys=task.keys,
                exitcode=proc.exitcode,
            )
        if reply[0] == "ok":
            return TaskResult(task=task, worker=worker, seconds=reply[1], value=reply[2])
        _, error_type, message, remote_tb = reply
        error = WorkerError(
            f"worker {worker} raised {error_type}: {message} (task {task.index}, keys {describe_keys(task.keys)})",
            worker=worker,
            keys=task.keys,
            error_type=error_type,
        )
        raise error from RemoteTraceback(remote_tb)

    def close(self) -> None:
        """Ask every worker to exit, then reap it (killing any that does not exit in time)."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill and reap every worker that is still alive. Safe to call more than once."""
        for proc in self._procs:
            if proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        for proc in self._procs:
            proc.join()
        for conn in self._conns:
            conn.close()
        self._procs.clear()
        self._conns.clear()


def _hint(exitcode: int | None) -> str:
    if exitcode == -signal.SIGKILL:
        return "; SIGKILL is what the kernel's OOM killer sends: lower --workers or the memory limit"
    return ""
