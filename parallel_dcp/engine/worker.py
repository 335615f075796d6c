"""A pool worker's side: its loop over the pipe from its coordinator (engine/pool.py).

Each message is a task (run by the handler, its result or error sent back), a task sent ahead, a
new handler for the coordinator's next run, the request to read its own memory (a Saver's pool,
as a run ends: own_charge.own_charge), or None (exit). Linux kills it if its parent dies.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

from parallel_dcp.engine.malloc import fix_mmap_threshold, return_freed_memory
from parallel_dcp.engine.messages import Ahead as _Ahead
from parallel_dcp.engine.messages import NewHandler as _NewHandler
from parallel_dcp.engine.messages import PartAt as _PartAt
from parallel_dcp.engine.messages import TaskPart as _TaskPart
from parallel_dcp.engine.messages import gc_paused, pickled_result, send_reply
from parallel_dcp.engine.own_charge import own_charge
from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.remote_memory import StaleRead

__all__ = ["REPORT_CHARGE", "send", "worker_main"]

_PR_SET_PDEATHSIG = 1


def worker_main(
    conn: Any, handler: Callable[[Task], Any], initializer: Callable[[], None] | None, coordinator: int | None
) -> None:
    # Ctrl-C goes to the whole process group; the coordinator decides how workers stop. SIGINT
    # was blocked across the fork (see WorkerPool._start): ignored first, then unblocked, so a
    # Ctrl-C at that instant is discarded here, never raised in the middle of the worker's start.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _die_with_parent(coordinator)
    # A read freed is given back, not kept on the heap for the task's next read (engine/malloc.py):
    # a caller that freed large tensors before forking would otherwise hand its raised threshold on.
    fix_mmap_threshold()
    broken: BaseException | None = None  # a run's handler that could not be loaded
    setup = 0.0  # seconds spent loading it, reported with the next task's result
    handed = 0.0  # seconds spent handing over the run's last result, reported with the next one
    # Objects inherited from the coordinator (the state dict's tensors and dicts) go to the
    # permanent generation: the worker's collections skip them instead of copying their pages.
    gc.freeze()
    if initializer is not None:
        initializer()
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the coordinator is gone
        taken = time.perf_counter()  # from here to the task's start, and its reply's pickling: handling
        with gc_paused():
            message = pickle.loads(data)
        del data
        if message is None:
            return
        if isinstance(message, str) and message == REPORT_CHARGE:  # the run is over: what it keeps
            try:
                return_freed_memory()
                report = own_charge()
            except Exception:  # no report (the coordinator then reads this worker itself), no crash
                report = None
            send(conn, ("charge", report))
            continue
        if isinstance(message, (_Ahead, _PartAt)):  # copied out of the coordinator
            try:
                message = message.load()
            except BaseException as exc:  # this task's error: the coordinator expects its reply next
                send(conn, ("error", type(exc).__qualname__, _message_of(exc), traceback.format_exc()))
                continue
        if isinstance(message, _NewHandler):
            began = time.perf_counter()
            try:
                handler, broken = _load_handler(message), None
            except BaseException as exc:  # reported with the run's first task on this worker
                broken = exc
            setup = time.perf_counter() - began
            handed = 0.0  # a new run: its first task is not charged with the last run's hand-over
            continue
        task: Task = message.task if isinstance(message, _TaskPart) else message
        start = time.perf_counter()
        try:
            if broken is not None:
                raise broken
            run = handler
            if isinstance(message, _TaskPart):  # reading its part of the job is the task's work (and error)
                run = handler.with_part(message.part, task)  # type: ignore[attr-defined]
            value = run(task)
            seconds = time.perf_counter() - start
            pickling = time.perf_counter()
            value, sizes, shared = pickled_result(value)  # (its error, a memory file's too, is the task's)
            handling = start - taken + time.perf_counter() - pickling
            reply: tuple[Any, ...] = ("ok", seconds, value, setup, handling, handed, sizes)
        except BaseException as exc:  # DCP raises CheckpointException, a BaseException
            reply, shared = ("error", _error_type(exc), _message_of(exc), traceback.format_exc()), None
        setup = 0.0  # reported with this run's first task on this worker only
        sending = time.perf_counter()
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # a result that cannot be pickled is the task's error, not a crash
            data = pickle.dumps(("error", type(exc).__qualname__, _message_of(exc), traceback.format_exc()))
            reply = ("error",)
        send_reply(conn, data, shared if reply[0] == "ok" else None)  # the file with the reply
        if reply[0] != "ok" and shared is not None:
            os.close(shared)
        return_freed_memory()
        handed = time.perf_counter() - sending


REPORT_CHARGE = "report your charge"  # (WorkerPool.request_charges)


def _error_type(exc: BaseException) -> str:
    """The name the coordinator gets for ``exc``: ``StaleRead`` where a copy out of the coordinator
    failed anywhere in its chain (a writer may wrap it), so the coordinator knows a stale plan."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, StaleRead):
            return StaleRead.__qualname__
        seen = seen.__cause__ or seen.__context__
    return type(exc).__qualname__


def _load_handler(message: _NewHandler) -> Callable[[Task], Any]:
    with gc_paused():
        handler: Callable[[Task], Any] = pickle.loads(message.pickled.fetch())
    prepare = getattr(handler, "prepare", None)
    if prepare is not None:
        prepare()
    return handler


def send(conn: Any, message: Any) -> None:
    # The C pickler: multiprocess's own (dill, pure Python) costs seconds on 50,000-entry Metadata.
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


def _die_with_parent(coordinator: int | None) -> None:
    """Ask Linux to SIGKILL this worker if its parent dies, so no worker is ever orphaned
    (``coordinator`` None: a fork server's child, which also ends on EOF from its pipe)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "prctl"):
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if coordinator is not None and os.getppid() != coordinator:  # it died before prctl took effect
        os._exit(1)


def _message_of(exc: BaseException) -> str:
    # CheckpointException keeps the per-rank errors in .failures; show them, not just the type.
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = "; ".join(f"{type(e).__name__}: {e}" for e in failures.values())
        return f"{exc} ({inner})"
    return str(exc) or type(exc).__name__
