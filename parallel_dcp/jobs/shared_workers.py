"""The workers ``parallel_dcp.save`` keeps between calls for large in-memory state dicts.

With ``executor="auto"`` (the default), an in-memory state dict holding at least ``MIN_BYTES`` of
tensors, saved while another Python thread of the caller is busy (it kept a quarter of a core busy over
its life: ``other_threads``), or while the kept workers run (``warm``: started by such a save), is
saved as a ``parallel_dcp.Saver`` saves it: by workers forked from a fork server (torch imported,
none of the caller's memory) that copy the tensors straight out of the caller with
``process_vm_readv``, into their write buffers. The bytes never pass through the caller's
interpreter, so a busy Python thread in the caller (a data loader, a heartbeat) does not slow the
save down by taking the GIL back at every buffer, and starting the workers does not grow with what
the caller holds. Alone with no kept workers running, the save runs on writer threads as before:
a one-off save does not pay the fork server's start.

Lifetime (one pool per process):

- started by the first eligible save (a constant cost, about the caller's own torch import: the
  fork server imports torch once, then each worker is a fork of it), reused by the next ones with
  the same worker count (another count replaces it);
- stopped once idle for ``IDLE_SECONDS`` (a daemon timer), at interpreter exit, or by :func:`stop`;
  while idle it holds the fork server and the workers (torch's pages shared among them, a few MiB
  each of their own), outside any memory limit, as the caller's own memory is;
- a fork of the caller never uses its parent's pool: it starts its own;
- used by one save at a time: a save from another thread meanwhile runs as before (threads or
  forked processes), and so does every save where the kernel refuses ``process_vm_readv``;
- a failed save stops the workers (as every failed save does); the next one starts new ones.

Small state dicts never start it: they would pay the fork server's torch import (about a second)
for a save that takes milliseconds.
"""

from __future__ import annotations

import atexit
import collections
import os
import threading
import warnings
from typing import Any

import torch

from parallel_dcp.jobs.pipeline import SaveResult
from parallel_dcp.jobs.saver import SaverWorkers
from parallel_dcp.options import Options

__all__ = ["IDLE_SECONDS", "MIN_BYTES", "eligible", "save", "stop", "warm"]

MIN_BYTES = 256 * 2**20
IDLE_SECONDS = 60.0
BUSY_SHARE = 0.25
_MIN_AGE_S = 0.05
# The size check walks at most this many values: a state dict of many small tensors that has not
# reached MIN_BYTES by then is saved as before (its cost is the coordinator's, not the bytes').
_WALK_LIMIT = 4096

_lock = threading.Lock()
_workers: SaverWorkers | None = None
_timer: threading.Timer | None = None


def eligible(state_dict: Any, options: Options) -> bool:
    """Whether ``save`` runs on the kept workers: the default executor, one process (not a
    distributed rank, not a resume), at least MIN_BYTES of tensors among the first values, and
    either another thread of this process busy (the GIL convoy they avoid) or the kept workers
    already running with this worker count (warm: they copy the tensors once, straight into their
    write buffers, as fast as writer threads alone on disk and within ~15% on /dev/shm; see
    docs/performance.md). Alone and cold, writer threads run it: starting the fork server costs
    more than the save (1-3 s, once) and gains nothing there."""
    if options.executor != "auto" or options.distributed or options.resume:
        return False
    if not other_threads() and not warm(options.worker_count(2**31)):
        return False
    return _tensor_bytes_reach(state_dict, MIN_BYTES)


def warm(workers: int) -> bool:
    """Whether this process's kept workers are running, ``workers`` of them, and usable."""
    kept = _workers
    return (
        kept is not None
        and kept.owner == os.getpid()
        and kept.workers == workers
        and kept.refused is None
        and kept._pool is not None
    )


def other_threads() -> bool:
    """Whether another Python thread of this process has wanted at least BUSY_SHARE of a core over
    its life (a data loader, a busy logger): the GIL convoy the kept workers avoid. Threads that
    mostly sleep (a timer, a sampler waking now and then) do not count, nor threads younger than
    _MIN_AGE_S (too young to judge). Wanted is run plus waited for a core (schedstat's first two
    fields): on a loaded node a spinning thread runs for a third of its life or less, yet it takes
    the GIL whenever it runs."""
    me = threading.get_native_id()
    # Python threads only: they are what takes the GIL back. torch's own (OpenMP, intra-op) threads
    # run native code without it, and after a matmul they have kept cores busy over their life.
    tids = [t.native_id for t in threading.enumerate() if t.native_id is not None]
    try:
        with open("/proc/uptime", "rb") as uptime:
            now = float(uptime.read().split()[0])
    except (OSError, ValueError):
        return threading.active_count() > 1 + (_timer is not None and _timer.is_alive())
    ticks = os.sysconf("SC_CLK_TCK")
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as stat:
                started = int(stat.read().rpartition(b")")[2].split()[19]) / ticks
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as schedstat:
                ran, waited = (int(field) for field in schedstat.read().split()[:2])
            wanted = (ran + waited) / 1e9
        except (OSError, ValueError, IndexError):
            continue
        age = now - started
        if age >= _MIN_AGE_S and wanted >= BUSY_SHARE * age:
            return True
    return False


def _tensor_bytes_reach(state_dict: Any, goal: int) -> bool:
    total = seen = 0
    stack = collections.deque([state_dict])
    while stack and seen < _WALK_LIMIT:
        value = stack.popleft()
        seen += 1
        if isinstance(value, torch.Tensor):
            total += value.untyped_storage().nbytes() if value.is_contiguous() else value.nbytes
            if total >= goal:
                return True
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)
    return False


def save(state_dict: Any, path: str | os.PathLike[str], options: Options) -> SaveResult | None:
    """Save on the kept workers; None where they cannot be used now (busy in another thread, or
    the kernel refuses to let them read this process): the caller saves as before."""
    if not _lock.acquire(blocking=False):
        return None
    try:
        kept = _workers
        workers = _workers_for(options.worker_count(2**31))
        if workers is None:
            return None
        result = workers.save(state_dict, path, options)
        if result is None:
            return None
        if workers is not kept:  # started for this save: its start is this save's
            result.phases["fork"] += workers.start_seconds
        return result
    finally:
        _schedule_stop()
        _lock.release()


def _workers_for(count: int) -> SaverWorkers | None:
    global _workers
    if _workers is not None and _workers.owner != os.getpid():
        _workers = None  # the parent's, inherited by this fork: not ours to use or stop
    if _workers is not None and (_workers.workers != count or _workers.refused is not None):
        if _workers.refused is not None:
            return None
        _workers.close()
        _workers = None
    if _workers is None:
        with warnings.catch_warnings():  # refused: save() runs as before, nothing to warn about
            warnings.simplefilter("ignore", RuntimeWarning)
            _workers = SaverWorkers(count)
        if _workers.refused is not None:
            return None
    return _workers


def _schedule_stop() -> None:
    global _timer
    if _timer is not None:
        _timer.cancel()
    if _workers is None or _workers.owner != os.getpid():
        return
    _timer = threading.Timer(IDLE_SECONDS, _stop_if_idle)
    _timer.daemon = True
    _timer.start()


def _stop_if_idle() -> None:
    if _lock.acquire(blocking=False):  # a save running now reschedules the stop itself
        try:
            _close()
        finally:
            _lock.release()


def stop() -> None:
    """Stop the kept workers now (the next eligible save starts new ones)."""
    global _timer
    with _lock:
        if _timer is not None:
            _timer.cancel()
            _timer = None
        _close()


def _close() -> None:
    global _workers
    workers, _workers = _workers, None
    if workers is not None and workers.owner == os.getpid():
        workers.close()


atexit.register(stop)
