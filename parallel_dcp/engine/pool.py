"""A pool of forked worker processes that runs tasks and explains every way a worker can fail.

    coordinator                                  worker i (forked, inherits the job's data)
    ───────────                                  ──────────────────────────────────────────
    send (task_id, task) ───── pipe i ────────▶  handler(task)
    wait(pipes + sentinels)  ◀──── pipe i ─────  ("ok", result) | ("error", type, msg, traceback)
       │ a sentinel fires with no reply:  the worker died → WorkerCrashed(exit code / signal, keys)
       │ an "error" reply:                WorkerError(type, message, keys), __cause__ = traceback
       └ any failure: kill and reap every worker, raise; nothing is left running

A pool that outlives one job (a Saver's: ``run(handler=)``) also sends each busy worker its next
task ahead (``_Ahead``: the worker copies the pickled task out of the coordinator when it takes
it), so a worker that replies finds its next task waiting and the hand-off overlaps its work. A
task with its part of the job (``run(parts=)``) goes as where its bytes lie (``_PartAt``), sent
ahead or not: the coordinator keeps them until the worker replies, and copies none of them.

Workers are forked, never spawned: the job's data (a state dict, an open checkpoint's metadata)
is read copy-on-write and never travels through a pipe. Only task descriptions and small results
(metadata, write results, statistics) do; their large bytes travel beside (engine/messages.py).

Longer than 300 lines because a process pool's failure handling (crashes, signals, timeouts,
retries, orphans, tracebacks home) is one piece of logic that must stay together to stay right.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import signal
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import multiprocess as mp

from parallel_dcp.engine.fork_server import ForkServerProcess, start_fork_server
from parallel_dcp.engine.held_interrupts import HeldInterrupts
from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.engine.messages import Ahead as _Ahead
from parallel_dcp.engine.messages import NewHandler as _NewHandler
from parallel_dcp.engine.messages import PartAt as _PartAt
from parallel_dcp.engine.messages import TaskPart as _TaskPart
from parallel_dcp.engine.messages import gc_paused
from parallel_dcp.engine.messages import receive_reply as _recv
from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.process_memory import ChargeReport
from parallel_dcp.engine.ready import ReadySet, wait_ready
from parallel_dcp.engine.remote_memory import RemoteBytes, StaleRead
from parallel_dcp.engine.result_region import ResultNotMapped, ResultRegion
from parallel_dcp.engine.worker import REPORT_CHARGE, worker_main
from parallel_dcp.engine.worker import send as _send
from parallel_dcp.errors import (
    RemoteTraceback,
    StalePlan,
    TaskTimeoutError,
    WorkerCrashed,
    WorkerError,
    describe_exit,
    describe_keys,
)

__all__ = ["TaskResult", "WorkerPool", "gc_paused"]

R = TypeVar("R")

_JOIN_TIMEOUT_S = 5.0
_PROGRESS_TICK_S = 0.1
# Every worker process this process started, alive or not.
_STARTED: weakref.WeakSet[Any] = weakref.WeakSet()


def _forget_inherited_workers() -> None:
    """In a fork of this process (``os.fork()`` by the caller's program): its workers are its
    parent's, not its own children. multiprocess lists them as its children all the same, and at
    the fork's exit its atexit hook SIGTERMs the daemonic children it lists: a fork that exits
    normally would kill the parent's workers in the middle of their next task."""
    children = getattr(mp.process, "_children", None)
    if children is not None:
        children.difference_update(list(_STARTED))
    _STARTED.clear()


os.register_at_fork(after_in_child=_forget_inherited_workers)


@dataclass(frozen=True, slots=True)
class TaskResult(Generic[R]):
    """What a task returned, with who ran it and how long it took inside the worker."""

    task: Task
    worker: int
    seconds: float
    value: R
    # Seconds the worker spent before this task loading the run's handler (its first task of a
    # run that brings one: the per-job cost each worker pays, outside every task's seconds).
    setup: float = 0.0
    # Seconds the worker spent on this task outside ``seconds``: taking its message (copying and
    # unpickling it) and pickling its result: each worker's own, beside the others'.
    handling: float = 0.0
    # Seconds the worker spent handing over its previous result of the run (writing it into its
    # pipe while the coordinator reads it, trimming its heap after): also its own, beside the
    # others'. A run's last hand-over is reported with no task: it falls before the commit.
    handover: float = 0.0


def _freeze_heap() -> bool:
    """Move this process's objects to the garbage collector's permanent generation, so that its
    collections, while forked workers share its pages, do not write to them: a full collection
    writes every tracked object's header, and each page written is copied, once for the parent
    and once for the worker sharing it. Measured: a coordinator holding 190 MiB of Python objects
    grew a forked worker's private memory by 186 MiB with one ``gc.collect()``, charged to the job
    under its memory limit. True when this call froze them (the caller then ``gc.unfreeze()``s
    when its workers are gone); False where objects were frozen already (by the caller's own
    program: its choice stands, and it is not undone)."""
    if gc.get_freeze_count():
        return False
    gc.freeze()
    return True


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
        start: int | None = None,
        fork_server: Sequence[str] | None = None,
        report_charges: bool = False,
    ) -> None:
        """``start``: how many workers to fork now (default: all); :meth:`run` forks the others
        one at a time while the first ones work, when a task is waiting and no worker is free.
        A fork copies the coordinator's page tables (~50 ms per GiB it holds), one after
        another: forked as the work needs them, those forks overlap the work instead of all
        preceding it.

        ``fork_server``: the modules to import in multiprocessing's fork server, a fresh process
        the workers are then forked from instead of from this process (so they hold none of
        this process's memory, and import nothing themselves); ``handler`` and ``initializer``
        must then be picklable, and the work reaches them through :meth:`run`'s ``handler``.

        ``report_charges``: at the end of each run that completes, :meth:`request_charges`."""
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._fork_server = fork_server is not None
        if fork_server is not None:
            self._ctx = mp.get_context("forkserver")
            self._ctx.set_forkserver_preload(["torch", "parallel_dcp.engine.pool", *fork_server])
            start_fork_server()  # from this process's sys.path, never its working directory
        else:
            self._ctx = mp.get_context("fork")
        self._handler = handler
        self._initializer = initializer
        self._owed_charges: list[int] = []  # workers asked for their charge, not yet read
        self._report_charges = report_charges
        self._conns: list[Any] = [None] * workers
        self._procs: list[Any] = [None] * workers
        self._unstarted = deque(range(workers))
        self._new_handler: _NewHandler | None = None
        self._parts: Callable[[Task], Any] | None = None
        self._primed: set[int] = set()
        self._pickled: dict[int, tuple[Task, bytes]] = {}  # id(task) -> (task, its pickle): _message
        # A running task's bytes that its worker copies out of this process (_message): kept until
        # its reply.
        self._held: dict[int, object] = {}
        # A run's running workers' pipes and sentinels, registered as each starts a task and
        # unregistered as it stops (a wake then costs what happened, not the number of workers);
        # and those of them with no task sent ahead, in the order they started theirs (_send_ahead).
        self._ready: ReadySet[int] = ReadySet()
        self._bare: dict[int, None] = {}
        # Where this run's results are mapped, side by side (dropped at its end: unmapped at once
        # when the last of them goes).
        self._region: ResultRegion | None = None
        # Seconds the last run spent waiting on its workers (the rest of it: the coordinator's own
        # work, handing tasks out and taking results in, while the workers work).
        self.waited_seconds = 0.0
        # Forked workers share this process's pages: keep its collections off them till the end.
        self._froze_heap = not self._fork_server and _freeze_heap()
        try:
            for _ in range(workers if start is None else max(1, min(start, workers))):
                self._start(self._unstarted.popleft())
        except BaseException:
            self.kill()
            raise

    def _start(self, i: int) -> None:
        parent_end, child_end = self._ctx.Pipe(duplex=True)
        process = ForkServerProcess if self._fork_server else self._ctx.Process
        proc = process(
            target=worker_main,
            args=(child_end, self._handler, self._initializer, None if self._fork_server else os.getpid()),
            name=f"parallel_dcp-worker-{i}",
            daemon=True,
        )
        # SIGINT blocked across the fork: the child inherits the mask and ignores it before it
        # unblocks. Here a Ctrl-C that came meanwhile is held and raised once the worker is
        # recorded (so the pool's cleanup kills it): the mask alone does not hold it where another
        # thread takes the signal, and Python then raised it inside a fork callback, which
        # swallows it ("Exception ignored in _releaseLock"): the save went on and committed.
        held = HeldInterrupts()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            with held:
                proc.start()
            _STARTED.add(proc)
            child_end.close()
            self._conns[i] = parent_end
            self._procs[i] = proc
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        held.deliver()

    def request_charges(self) -> None:
        """Ask every worker (idle: between runs) to read its own ``smaps_rollup`` now
        (own_charge.own_charge: ~1-2 ms of its time, none of this process's), for a charge
        reader that outlives the run (a Saver's next baseline): :meth:`charge_reports`."""
        for worker, conn in enumerate(self._conns):
            if conn is not None and worker not in self._owed_charges:
                with contextlib.suppress(OSError):
                    _send(conn, REPORT_CHARGE)
                    self._owed_charges.append(worker)

    def charge_reports(self) -> dict[int, ChargeReport]:
        """By pid, what each worker asked by :meth:`request_charges` read of itself (waiting for
        those that have not answered yet); none from a worker that died meanwhile (its death is
        found as usual, by the next run)."""
        reports: dict[int, ChargeReport] = {}
        owed, self._owed_charges = self._owed_charges, []
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for worker in owed:
            conn, proc = self._conns[worker], self._procs[worker]
            if conn is None or proc is None:
                continue
            with contextlib.suppress(EOFError, OSError):
                ready = wait_ready([conn, proc.sentinel], max(0.0, deadline - time.monotonic()))
                if not ready:  # still owed: read before any reply of a run (run, _receive)
                    self._owed_charges.append(worker)
                elif conn in ready:
                    reply, _ = _recv(conn)
                    if reply[0] == "charge" and reply[1] is not None:
                        reports[proc.pid] = reply[1]
        return reports

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p is not None]

    def dead(self) -> list[tuple[int, int | None]]:
        """(pid, exit code) of each worker that has exited (without a wait: an idle pool's
        workers, killed meanwhile by the OOM killer, an admin or their fork server's death)."""
        started = [p for p in self._procs if p is not None and p.pid is not None]
        return [(p.pid, p.exitcode) for p in started if p.exitcode is not None]

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            self.close()
        else:
            self.kill()

    def run(
        self,
        tasks: Sequence[Task],
        *,
        governor: MemoryGovernor | None = None,
        task_timeout: float | None = None,
        retries: int = 0,
        on_tick: Callable[[], None] | None = None,
        handler: Callable[[Task], Any] | None = None,
        parts: Callable[[Task], Any] | None = None,
    ) -> Iterator[TaskResult[Any]]:
        """Run every task, yielding results as they complete (in completion order).

        Tasks are handed out in the given order to whichever worker is free, each only when the
        governor admits its memory beside those in flight.

        Args:
            governor: enforces the memory ceiling (admission and watchdog); None for no ceiling.
            task_timeout: seconds a task may run before its worker is killed.
            retries: how often a task whose worker died is run again (same task, same part
                index, on a fresh worker). Tasks that raise are not retried.
            on_tick: called every few tens of milliseconds while tasks run (a progress bar).
            handler: runs this run's tasks instead of the pool's own (a pool that outlives one
                job); pickled once here, each worker copies it before its first task.
            parts: ``parts(task)`` is sent with each task (made when the task is dispatched, or
                earlier by ``parts.ahead()`` if it has one: called before each wait on the
                workers), and the worker runs ``handler.with_part(part, task)(task)``: the job's
                per-key data then travels per task, so no worker receives the keys of tasks it
                does not run.

        Raises:
            WorkerError: a task raised; ``__cause__`` is the worker's traceback.
            WorkerCrashed: a worker died while running a task (after ``retries`` attempts).
            TaskTimeoutError: a task ran past ``task_timeout``.
            MemoryLimitExceeded: a task cannot fit, or the tree went over the ceiling.
        """
        if self._owed_charges:  # answers to a request nobody read: out of the way of the replies
            self.charge_reports()
        pending = deque(tasks)
        running: dict[int, tuple[Task, float]] = {}
        # Where the workers copy what this process holds (a run that brings its handler): a
        # task sent ahead to each busy worker, so that its next task is there when it replies
        # (the hand-off overlaps its work); its bytes kept here until its reply.
        ahead: dict[int, tuple[Task, object]] | None = {} if handler is not None else None
        held = self._held  # a running task's bytes (sent ahead, or as a _PartAt)
        held.clear()
        ready = self._ready = ReadySet()
        bare = self._bare
        bare.clear()
        self._region = ResultRegion()
        self.waited_seconds = 0.0
        attempts: dict[int, int] = {}
        idle = deque(w for w, proc in enumerate(self._procs) if proc is not None)
        pickled = bytearray(pickle.dumps(handler, protocol=pickle.HIGHEST_PROTOCOL)) if handler is not None else None
        self._new_handler = _NewHandler(RemoteBytes.of(pickled)) if pickled is not None else None
        self._parts = parts
        self._primed = set()
        # The pickles of this run's tasks kept from the last run (a Saver's next save of a layout
        # runs the same Task objects): the others dropped, so the memo holds one run's tasks.
        kept = self._pickled
        self._pickled = {id(t): kept[id(t)] for t in tasks if id(t) in kept and kept[id(t)][0] is t}
        tick = governor.interval if governor is not None else None
        if on_tick is not None:
            tick = min(tick or _PROGRESS_TICK_S, _PROGRESS_TICK_S)
        if task_timeout is not None:
            tick = min(tick or task_timeout, max(task_timeout / 10, 0.01))
        try:
            if governor is not None:
                governor.settle(self.pids, planned=sum(task.memory for task in tasks))
            while pending or running:
                self._dispatch(pending, idle, running, governor)
                # A task waits and every started worker is busy: fork the next one for it (it
                # is admitted, or refused, as any task is: by the governor, in _dispatch).
                while pending and not idle and self._unstarted and self._admissible(pending[0], governor):
                    worker = self._unstarted.popleft()
                    self._start(worker)
                    if governor is not None:
                        governor.add_worker(self._procs[worker].pid)
                    idle.append(worker)
                    self._dispatch(pending, idle, running, governor)
                if ahead is not None:
                    self._send_ahead(pending, idle, running, ahead, governor)
                make_ahead = getattr(self._parts, "ahead", None)
                if make_ahead is not None:  # the next task's part (or a check), made while the workers work
                    make_ahead()
                waited = time.perf_counter()
                found = ready.wait(tick)
                self.waited_seconds += time.perf_counter() - waited
                for worker in found:
                    if worker not in running:
                        continue  # its reply and its sentinel were both ready; handled once
                    task, _ = running.pop(worker)
                    bare.pop(worker, None)
                    if governor is not None:
                        governor.release(task.memory)
                    try:
                        result = self._receive(worker, task)
                    except WorkerCrashed:
                        ready.discard(worker)  # (its pipe closed: before a new one may take its number)
                        attempts[task.index] = attempts.get(task.index, 0) + 1
                        if attempts[task.index] > retries:
                            raise
                        self._start(worker)
                        self._primed.discard(worker)
                        held.pop(worker, None)
                        if ahead is not None and worker in ahead:  # never started: it waits again
                            later, _ = ahead.pop(worker)
                            if governor is not None:
                                governor.release(later.memory)
                            pending.appendleft(later)
                        pending.appendleft(task)
                    else:
                        held.pop(worker, None)  # replied: it copied the task's bytes long ago
                        yield result
                        if ahead is not None and worker in ahead:  # its next task is with it already
                            later, held[worker] = ahead.pop(worker)
                            running[worker] = (later, time.monotonic())  # (still waited on)
                            bare[worker] = None
                            continue
                    ready.discard(worker)
                    idle.append(worker)
                # The freed workers take their next tasks before the watchdog's reading (up to a
                # tenth of a second once a second, under load), not after it.
                self._dispatch(pending, idle, running, governor)
                # Idle workers too: what they keep still counts (mapped only when it is read).
                if governor is not None and governor.due():
                    governor.watch(self._watched(running), aside=self._fork_server)
                if task_timeout is not None:
                    self._check_timeouts(running, task_timeout)
                if on_tick is not None:
                    on_tick()
            if governor is not None:  # a reading still taken aside: acted on as any
                governor.finish(self._watched(running))
            if self._report_charges:  # each worker reads itself while this process commits
                self.request_charges()
        except StalePlan:  # what was sent is waited for and dropped: the workers stay usable
            self._drain(running, ahead or {})
            raise
        except BaseException:
            self.kill()
            raise
        finally:
            if governor is not None:
                governor.finish()
            self._new_handler = None
            self._parts = None
            self._region = None  # (its results' views keep it mapped)
            del pickled  # the workers copied it before their first task
            held.clear()  # (every worker replied, or was killed above)
            if ahead is not None:
                ahead.clear()

    def _watched(self, running: dict[int, tuple[Task, float]]) -> dict[int, tuple[int, tuple[str, ...]]]:
        """What the governor's watch takes: each live worker's pid, number and running task's keys."""
        procs = [(w, proc) for w, proc in enumerate(self._procs) if proc is not None]
        return {proc.pid: (w, running[w][0].keys if w in running else ()) for w, proc in procs}

    @staticmethod
    def _admissible(task: Task, governor: MemoryGovernor | None) -> bool:
        """Whether one more worker, and ``task`` on it, would fit beside what is in flight."""
        return governor is None or governor.room_for_worker(task.memory)

    def _dispatch(
        self,
        pending: deque[Task],
        idle: deque[int],
        running: dict[int, tuple[Task, float]],
        governor: MemoryGovernor | None,
    ) -> None:
        while pending and idle:
            task = pending[0]
            if governor is not None and not governor.admit_task(
                task.index, task.keys, task.memory, others_running=bool(running)
            ):
                return  # wait until a running task frees its memory
            pending.popleft()
            worker = idle.popleft()
            message, keep = self._message(task)
            if keep is not None:
                self._held[worker] = keep
            # A worker that died idle (or loading this run's handler) closed its pipe: the task
            # is its now, and its sentinel reports the death with the task's keys.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                if self._new_handler is not None and worker not in self._primed:
                    self._primed.add(worker)
                    _send(self._conns[worker], self._new_handler)
                _send(self._conns[worker], message)
            running[worker] = (task, time.monotonic())
            self._ready.add(worker, (self._conns[worker], self._procs[worker].sentinel))
            self._bare[worker] = None

    def _message(self, task: Task) -> tuple[Any, object]:
        """What a worker receives for ``task``, and what this process must keep, unchanged, until
        the worker's reply for it (None: nothing). The task alone; or with its part of the job and
        its pickle kept from an earlier run of the same Task object (``_pickled``): where the part
        is bytes, as where both lie (``_PartAt``, kept: the pickle and the part), else pickled whole."""
        if self._parts is None:
            return task, None
        kept = self._pickled.get(id(task))
        if kept is None or kept[0] is not task:
            kept = (task, pickle.dumps(task, protocol=pickle.HIGHEST_PROTOCOL))
            self._pickled[id(task)] = kept
        part = self._parts(task)
        if isinstance(part, bytes):
            return _PartAt(RemoteBytes.of(kept[1]), RemoteBytes.of(part)), (kept[1], part)
        return _TaskPart(task, part, kept[1]), None

    def _send_ahead(
        self,
        pending: deque[Task],
        idle: deque[int],
        running: dict[int, tuple[Task, float]],
        ahead: dict[int, tuple[Task, object]],
        governor: MemoryGovernor | None,
    ) -> None:
        """Every worker busy, and as many tasks waiting as there are workers: send each busy worker
        its next task now, admitted (and its memory reserved) as any task is. The last tasks (fewer
        than the workers) stay with the first worker to be free, so no task waits behind a long one
        while another worker idles."""
        if idle or self._unstarted:
            return
        bare = self._bare  # the busy workers with nothing ahead, in the order they started
        while bare and len(pending) >= len(running):
            worker = next(iter(bare))
            task = pending[0]
            if governor is not None and not governor.admit_task(
                task.index, task.keys, task.memory, others_running=True
            ):
                return
            pending.popleft()
            del bare[worker]
            message, keep = self._message(task)
            if not isinstance(message, _PartAt):  # pickled here; the worker copies it out
                keep = bytearray(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
                message = _Ahead(RemoteBytes.of(keep))
            ahead[worker] = (task, keep)
            # A worker that died meanwhile closed its pipe: its sentinel reports it (and both tasks
            # wait again where retries allow).
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                _send(self._conns[worker], message)

    def _drain(self, running: dict[int, tuple[Task, float]], ahead: dict[int, Any]) -> None:
        """Wait for the reply of every task sent (running, or sent ahead) and drop it; a worker
        that dies meanwhile (or a Ctrl-C) fails as in :meth:`run`: every worker killed."""
        owed = {w: (w in running) + (w in ahead) for w in {*running, *ahead}}
        try:
            while owed:
                found = wait_ready([self._conns[w] for w in owed] + [self._procs[w].sentinel for w in owed], None)
                for worker in [w for w in owed if self._conns[w] in found or self._procs[w].sentinel in found]:
                    task = running[worker][0] if worker in running else ahead[worker][0]
                    if not wait_ready([self._conns[worker]], 0):  # its sentinel, and no reply: it died
                        self._receive(worker, task)  # raises WorkerCrashed
                    try:
                        _recv(self._conns[worker])  # dropped, with its buffers
                    except (EOFError, OSError):  # its pipe's end, not a reply: it died
                        self._receive(worker, task)  # raises WorkerCrashed
                        raise
                    owed[worker] -= 1
                    if not owed[worker]:
                        del owed[worker]
        except BaseException:
            self.kill()
            raise

    def _check_timeouts(self, running: dict[int, tuple[Task, float]], task_timeout: float) -> None:
        # ``running`` holds its tasks in the order they started (each added at its start, after a
        # worker's last one was removed): none is past the timeout unless the first one is.
        if running:
            worker = next(iter(running))
            task, started = running[worker]
            now = time.monotonic()
            if now - started > task_timeout:
                proc = self._procs[worker]
                # (a task given a long pass before its keys, such as hashing a large source file
                # whole, may have spent the time there: the message names it)
                before = f". Before its keys it {task.duty}: that may be what ran long" if task.duty else ""
                raise TaskTimeoutError(
                    f"task {task.index} with keys {describe_keys(task.keys)} ran {now - started:.1f} s on worker "
                    f"{worker} (pid {proc.pid}), past the task timeout of {task_timeout:g} s; the worker was killed"
                    f"{before}",
                    worker=worker,
                    keys=task.keys,
                    seconds=now - started,
                )

    def _receive(self, worker: int, task: Task) -> TaskResult[Any]:
        conn = self._conns[worker]
        try:
            # (Not conn.poll(): multiprocess's selector, ~0.1 ms a result.)
            reply, raw = _recv(conn, self._region) if wait_ready([conn], 0) else (None, [])
            while reply is not None and reply[0] == "charge":  # a late answer to request_charges
                proc = self._procs[worker]
                reply, raw = (
                    _recv(conn, self._region) if conn in wait_ready([conn, proc.sentinel], None) else (None, [])
                )
        except ResultNotMapped:
            raise  # this process's own failure: the worker replied (it is no crash, nor retried)
        except (EOFError, OSError):
            reply = None
        if reply is None:
            proc = self._procs[worker]
            proc.join(_JOIN_TIMEOUT_S)
            conn.close()
            raise WorkerCrashed(
                f"worker {worker} (pid {proc.pid}) died with {describe_exit(proc.exitcode)} while running "
                f"task {task.index} with keys {describe_keys(task.keys)}" + _hint(proc.exitcode),
                worker=worker,
                keys=task.keys,
                exitcode=proc.exitcode,
            )
        if reply[0] == "ok":
            with gc_paused():
                value = pickle.loads(reply[2], buffers=raw)
            return TaskResult(
                task=task,
                worker=worker,
                seconds=reply[1],
                value=value,
                setup=reply[3],
                handling=reply[4],
                handover=reply[5],
            )
        _, error_type, message, remote_tb = reply
        kind = StalePlan if error_type == StaleRead.__qualname__ else WorkerError
        error = kind(
            f"worker {worker} raised {error_type}: {message} (task {task.index}, keys {describe_keys(task.keys)})",
            worker=worker,
            keys=task.keys,
            error_type=error_type,
        )
        raise error from RemoteTraceback(remote_tb)

    def close(self) -> None:
        """Ask every worker to exit, then reap it (killing any that does not exit in time)."""
        for conn in self._conns:
            if conn is not None:
                with contextlib.suppress(OSError):
                    _send(conn, None)
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for proc in self._procs:
            if proc is not None:
                proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill and reap every worker that is still alive. Safe to call more than once."""
        for proc in self._procs:
            if proc is not None and proc.pid is not None and proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        for proc in self._procs:
            if proc is not None and proc.pid is not None:
                proc.join()
        for conn in self._conns:
            if conn is not None:
                conn.close()
        self._procs = [None] * len(self._procs)
        self._conns = [None] * len(self._conns)
        if self._froze_heap:
            self._froze_heap = False
            gc.unfreeze()


def _hint(exitcode: int | None) -> str:
    if exitcode == -signal.SIGKILL:
        return (
            "; unless something else killed it, the kernel's out-of-memory killer did (it sends SIGKILL): "
            "lower --workers or the memory limit"
        )
    return ""
