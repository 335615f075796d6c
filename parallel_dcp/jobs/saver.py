"""The workers behind ``parallel_dcp.Saver``: started once, reused by every save.

    Saver(workers=N)    fork server (a fresh process: torch imported, none of the caller's memory)
       │                  └ N workers forked from it (a few ms each, whatever the caller holds)
       │                  probe: one worker copies a few bytes out of the caller (process_vm_readv)
    saver.save(sd, p)   the pipeline of parallel_dcp.save (plan, stage, run, commit, publish) on
       │                  those workers: each worker copies the job's shell (no key) out of the
       │                  caller once, and receives with each task only that task's keys, tensor
       │                  addresses and layouts (jobs/task_parts.py); then the task's tensor bytes,
       │                  copied out of the caller straight into the writer's buffers
       │                  (formats/remote_memory_source.py, storage/pending.py), which each worker
       │                  keeps from one task to the next
    failure             the pool is stopped (as save does), the next save starts a new one
    close()             workers asked to exit and reaped, then the fork server stopped (unless
                          it ran before: it may serve the caller's own processes)

Where the kernel refuses ``process_vm_readv`` (Yama ``ptrace_scope`` >= 1: the workers are not
the caller's descendants), the Saver says so once (a RuntimeWarning naming the reason) and each
save runs as ``parallel_dcp.save`` does, forking its workers.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any

from parallel_dcp._compat import forget_inherited_fork_server, fork_server_pid, running_servers, stop_fork_server
from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.pool import WorkerPool, gc_paused
from parallel_dcp.engine.process_memory import ChargeReader
from parallel_dcp.engine.prompt_gil import prompt_gil
from parallel_dcp.engine.remote_memory import RemoteBytes, refusal
from parallel_dcp.errors import StalePlan, describe_exit
from parallel_dcp.jobs import pipeline
from parallel_dcp.jobs.pipeline import SaveResult
from parallel_dcp.jobs.plan_reuse import PlanReuse
from parallel_dcp.jobs.targets import DcpTarget, Job, prepare_io
from parallel_dcp.options import Options
from parallel_dcp.storage.direct_write import BUFFER_BYTES, DEPTH, keep_buffers, kept_buffers_fit

__all__ = ["SaverWorkers"]


_PROBE = b"parallel_dcp reads the caller's memory"
# Imported once in the fork server (no worker imports them, ~1 s of CPU each): this module, writers, DCP's planner.
_PRELOAD = (
    "parallel_dcp.jobs.saver",
    "parallel_dcp.formats.lean",
    "parallel_dcp.partial",
    "parallel_dcp.storage.writers",
)


class _ServerUsers:
    """Every pool of this process forked from the one fork server (several Savers, the workers
    save() keeps) uses it; it stops with the last of them (its children die with it), unless it
    ran before the first (the caller's own)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.before = (False, False)

    def acquire(self) -> None:
        with self.lock:
            if self.count == 0:
                self.before = running_servers()
            self.count += 1

    def release(self) -> None:
        with self.lock:
            self.count -= 1
            if self.count == 0:
                stop_fork_server(self.before)

    def forget(self) -> None:
        """In a fork: the parent's server and users are not ours; the child starts its own."""
        self.lock = threading.Lock()
        self.count = 0
        forget_inherited_fork_server()


_server = _ServerUsers()
os.register_at_fork(after_in_child=_server.forget)


def _worker_start() -> None:
    """In each worker: keep the aligned write buffers from one task (and save) to the next."""
    keep_buffers(DEPTH)


def _no_job(task: Task) -> Any:
    raise RuntimeError(f"task {task.index} reached a Saver worker without its job")


class _Probe:
    """Run in one worker: can it copy the caller's bytes? (None, or why not)."""

    def __init__(self, data: RemoteBytes) -> None:
        self.data = data

    def __call__(self, task: Task) -> str | None:
        return refusal(self.data, _PROBE)


class SaverWorkers:
    """A pool of ``workers`` processes forked from the fork server, owned by the process that
    created it; see the module docstring."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.owner = os.getpid()
        self.refused: str | None = None
        self._charges = ChargeReader()  # knows the workers' code shares from one save to the next
        self._plans = PlanReuse()  # the last layout saved: its listing, partitions and parts
        self._pool: WorkerPool | None = None
        _server.acquire()
        self._released = False
        try:
            self.start_seconds = self._start()
        except BaseException:
            self._released = True
            _server.release()
            raise

    def _start(self) -> float:
        started = time.perf_counter()
        pool = WorkerPool(self.workers, _no_job, initializer=_worker_start, fork_server=_PRELOAD, report_charges=True)
        try:
            probe = bytearray(_PROBE)
            results = list(pool.run([Task(0, (), 0)], handler=_Probe(RemoteBytes.of(probe))))
        except BaseException:
            pool.kill()
            raise
        self.refused = results[0].value
        if self.refused is not None:
            pool.close()
            warnings.warn(
                f"parallel_dcp.Saver: its workers cannot read this process's memory ({self.refused}); "
                "each save forks its own workers, as parallel_dcp.save does",
                RuntimeWarning,
                stacklevel=4,
            )
        else:
            self._pool = pool
        return time.perf_counter() - started

    def save(
        self, state_dict: Any, path: str | os.PathLike[str], options: Options, *, layout_unchanged: bool = False
    ) -> SaveResult | None:
        """The save on these workers; None where the kernel refused their reads of this process
        (warned once): the caller then saves as ``parallel_dcp.save`` does, forking per save.
        ``layout_unchanged``: see ``PlanReuse.job``."""
        with prompt_gil():
            return self._save_here(state_dict, path, options, layout_unchanged)

    def _save_here(
        self, state_dict: Any, path: str | os.PathLike[str], options: Options, layout_unchanged: bool
    ) -> SaveResult | None:
        if os.getpid() != self.owner:
            raise RuntimeError(
                f"this Saver belongs to process {self.owner}, not to its fork {os.getpid()}: "
                "create a new Saver in the forked process"
            )
        if self.refused is not None:
            return None
        start = time.perf_counter()
        if self._pool is not None and self._pool.dead():
            # a worker died between saves (the OOM killer, an admin, its fork server's end): this
            # save gets new workers, not a task sent to the dead one and failed in its name
            died = ", ".join(f"pid {pid} ({describe_exit(code)})" for pid, code in self._pool.dead())
            warnings.warn(
                f"parallel_dcp.Saver: a worker died while idle ({died}); starting new ones",
                RuntimeWarning,
                stacklevel=4,
            )
            self._pool.kill()
            self._pool = None
        restart = 0.0 if self._pool is not None else self._start()
        pool = self._pool
        if pool is None:  # refused after a restart: warned; fork per save from now on
            return self.save(state_dict, path, options, layout_unchanged=layout_unchanged)
        # The layout saved last, by its plan, before it is checked: the check runs while the first
        # tasks do, and a stale plan is dropped for the plain way (jobs/speculation.py).
        speculation = self._plans.speculation(
            state_dict,
            str(path),
            pending_writes=not options.crc32,
            layout_unchanged=layout_unchanged,
            workers=self.workers,
        )
        result, stale = None, False
        if speculation is not None:
            try:
                result = self._run(speculation.job, path, options, pool, start)
            except StalePlan:  # nothing of it is left: run it as any save
                speculation.drop()
                stale = True
            finally:
                speculation.close()
        if result is None:
            try:
                # A layout saved before is listed, planned and parted as it was (jobs/plan_reuse.py).
                with gc_paused():
                    job = self._plans.job(
                        state_dict, str(path), pending_writes=not options.crc32, layout_unchanged=layout_unchanged
                    )
                result = self._run(job, path, options, pool, start)
            finally:
                if stale and speculation is not None:  # the next save of that layout checks first
                    speculation.kept.steady = False
        if restart:
            result.phases["fork"] += restart
        return result

    def _run(
        self, job: Job, path: str | os.PathLike[str], options: Options, pool: WorkerPool, start: float
    ) -> SaveResult:
        target = DcpTarget(path, options.storage_options, compression=options.compression())
        options = prepare_io(target, options)
        governor = self.governor(options.memory_ceiling(), pool)
        target.plans = self._plans
        keep = DEPTH if kept_buffers_fit(governor.limit, self.workers) else 0
        # Kept for the whole job, idle or not: charged, or dropped (unplanned, they stopped a save under 50 MB).
        governor.worker_extra += keep * BUFFER_BYTES
        try:
            return pipeline.run_job(job, target, options, governor, start=start, pool=pool, keep_buffers=keep)
        except BaseException:
            if not pool.pids:  # the pool stops its workers on any failure: new ones next time
                self._pool = None
            raise

    def governor(self, limit: int, pool: WorkerPool) -> MemoryGovernor:
        """The memory governor of one save on ``pool``, its baseline read now."""
        # What the fork server and the idle workers hold is there before the save and stays after
        # it: the baseline (the workers share the server's pages, so all of them are read).
        server = fork_server_pid()
        held = [*([server] if server else []), *pool.pids]
        # What each worker read of itself as the last save ended: its baseline charge then costs
        # this process its counters, not a rollup a worker.
        for pid, report in pool.charge_reports().items():
            self._charges.learn(pid, report)
        return MemoryGovernor(limit, held=held, charges=self._charges, parent=server)

    def baseline_seconds(self) -> float:
        """Seconds a save's baseline reading takes now, between saves (benchmarks: the reading
        every save starts with, of the fork server and each worker held; nothing is saved)."""
        pool = self._pool
        if pool is None:
            return 0.0
        began = time.perf_counter()
        self.governor(2**62, pool)
        return time.perf_counter() - began

    def close(self) -> None:
        """Stop the workers and the fork server (nothing from a fork of the owner)."""
        if os.getpid() != self.owner:
            return
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
        if not self._released:
            self._released = True
            _server.release()
