"""``parallel_dcp.Saver``: one pool of workers for many saves (a training loop's checkpoints)."""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

from parallel_dcp.api import _check_torch
from parallel_dcp.options import Options

if TYPE_CHECKING:
    from parallel_dcp.jobs.pipeline import SaveResult
    from parallel_dcp.jobs.saver import SaverWorkers

__all__ = ["Saver"]


class Saver:
    """Worker processes started once and reused by every :meth:`save`.

    >>> with parallel_dcp.Saver(workers=8, memory_limit="16GiB") as saver:  # doctest: +SKIP
    ...     for step in range(steps):
    ...         train(model)
    ...         saver.save(model.state_dict(), f"ckpt/step{step}")

    Each :meth:`save` gives what :func:`parallel_dcp.save` gives (the same files, bit for bit; the
    same guarantees: nothing committed on failure, the memory ceiling, overwrite rules) without
    starting workers: ``SaveResult.phases["fork"]`` is what the save spent getting its workers
    ready (milliseconds), ``start_seconds`` what starting them cost once.

    How the workers get the bytes: they are forked from multiprocessing's fork server (a fresh
    process that has imported torch), so they hold none of the caller's memory, however large, and
    starting them does not grow with it; each save's tensors are copied straight out of the caller
    with ``process_vm_readv`` (one copy, outside the caller's interpreter: a busy Python thread in
    the caller does not slow it). Each worker's copy is charged to the memory limit. Where the
    kernel refuses that (Yama ``kernel.yama.ptrace_scope`` >= 1), a RuntimeWarning says so at
    creation and each save forks its workers as :func:`parallel_dcp.save` does.

    A save of a state dict laid out as the previous save's (the same keys in the same order and
    nesting; each tensor's type, dtype, shape and strides; each other value's size) is not listed
    and planned again: the previous save's listing and partition are reused (decided again only
    where the memory limit binds), and so is each task's description for the workers where the
    tensors lie where they lay. What changed in the values (the tensors' bytes, a step counter) is
    what is written, bit for bit as a fresh save writes it; any other change is planned afresh.
    The Saver keeps no tensor or value of a past save. A save of the layout saved last sends each
    worker its first task before that check and checks while they work; where the check finds a
    change, what they wrote is discarded and the save runs as a save of a new layout
    (jobs/speculation.py).

    Lifetime rules:

    - Use it as a context manager, or call :meth:`close`: the workers exit and are reaped and the
      fork server stops; a Saver dropped unclosed (or alive at interpreter exit) does the same
      when it is collected. Workers also die with the caller (SIGKILL on its death).
    - The state dict must not change while :meth:`save` runs (the caller is inside it; another
      thread must not update the tensors in place meanwhile).
    - Saves run one at a time: a save from another thread meanwhile waits for the one running
      (a save from inside a save, a callback's, raises RuntimeError).
    - A failed save (a worker crash, the memory limit, a timeout, Ctrl-C) stops the workers as
      :func:`parallel_dcp.save` does, and nothing is committed; the next save starts new ones.
    - After ``os.fork()`` the child's copy of a Saver is not usable (``save`` raises
      RuntimeError; ``close`` does nothing there): the workers belong to the parent.
    - The fork server itself (torch imported, ~0.2 GiB) is outside the memory limit, as the
      caller's own memory is.

    Args:
        workers: worker processes; None uses every usable core.
        memory_limit: the ceiling of every save (see :func:`parallel_dcp.save`); None: half the
            memory available when each save starts.
    """

    def __init__(self, workers: int | None = None, memory_limit: int | str | None = None) -> None:
        self._options = Options(workers=workers, memory_limit=memory_limit, executor="processes")
        _check_torch()
        from parallel_dcp.jobs.saver import SaverWorkers

        self._workers: SaverWorkers | None = SaverWorkers(self._options.worker_count(2**31))
        # A Saver dropped without close() (or alive at exit) still stops its workers.
        self._finalizer = weakref.finalize(self, self._workers.close)
        # One save at a time: two threads' saves on one pool took each other's replies (a
        # checkpoint committed without the other's shards). The thread saving now, to refuse a
        # save from inside it (a callback) instead of waiting on itself for ever.
        # (A fork's copy never waits on it: its parent may have held it at the fork; its save raises.)
        self._saving = threading.Lock()
        self._saving_thread: int | None = None
        self._owner = os.getpid()

    @property
    def start_seconds(self) -> float:
        """Seconds it took to start the workers (the fork server, its imports, every fork)."""
        return self._live().start_seconds

    def save(
        self,
        state_dict: Any,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        progress: bool = False,
        sync_files: bool = True,
        crc32: bool = False,
        retries: int = 0,
        task_timeout: float | None = None,
        checksums: bool = True,
        chunk_size: int | str | None = None,
        storage_options: dict[str, Any] | None = None,
        compress: str | None = None,
        io: str = "auto",
        layout_unchanged: bool = False,
    ) -> SaveResult:
        """Save ``state_dict`` as :func:`parallel_dcp.save` does (same keywords, same result and
        errors), on this Saver's workers.

        ``layout_unchanged=True`` is a promise, for a training loop that only updates values
        (optimizer steps, ``copy_``): since this Saver's last save of these keys, no tensor was
        reshaped, retyped or restrided in place over the same bytes (``resize_`` within its
        storage, ``t_``, ``as_strided_``, ``.data =`` a view of the same bytes), nor replaced by
        another tensor whose first byte lies where its own did (a view: ``sd[k] = sd[k].t()``,
        ``.conj()``, ``.view(dtype)``; or a new tensor of another dtype, shape or strides that the
        allocator placed in the old one's freed memory), nor had its ``requires_grad`` switched
        (``.metadata`` records it). The save then does not compare each tensor's dtype, shape,
        strides and ``requires_grad`` with the last save's (about 1 us a key at 50,000 keys) unless
        its bytes moved. Still checked every save: the keys, their order and nesting, each
        tensor's type, where each tensor's bytes lie (a tensor replaced by one elsewhere in memory,
        ``set_`` or ``.data =`` to other memory, a ``resize_`` that reallocated: compared in full,
        as without the promise), and the non-tensor values' sizes. A
        broken promise writes a wrong checkpoint: the tensor with the dtype, shape, strides and
        ``requires_grad`` (and as many bytes) as at the save before. Default False: everything is compared.

        Raises:
            RuntimeError: the Saver is closed, or this is a fork of the process that created it.
        """
        options = Options(
            workers=self._options.workers,
            memory_limit=self._options.memory_limit,
            executor="processes",
            overwrite=overwrite,
            progress=progress,
            sync_files=sync_files,
            crc32=crc32,
            retries=retries,
            task_timeout=task_timeout,
            checksums=checksums,
            chunk_size=chunk_size,
            storage_options=storage_options,
            compress=compress,
            io=io,
        )
        if self._saving_thread == threading.get_ident():
            raise RuntimeError("Saver.save was called from inside a save of the same Saver (a callback?)")
        with self._saving if os.getpid() == self._owner else contextlib.nullcontext():  # (see __init__)
            self._saving_thread = threading.get_ident()
            try:
                result = self._live().save(state_dict, path, options, layout_unchanged=layout_unchanged)
            finally:
                self._saving_thread = None
        if result is None:  # its workers cannot read this process (warned): fork per save
            from parallel_dcp.jobs.save import save as fork_per_save

            return fork_per_save(state_dict, path, options)
        return result

    def close(self) -> None:
        """Stop the workers (safe to call more than once)."""
        self._workers = None
        self._finalizer()  # SaverWorkers.close, once

    def _live(self) -> SaverWorkers:
        if self._workers is None:
            raise RuntimeError("this Saver is closed")
        return self._workers

    def __enter__(self) -> Saver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
