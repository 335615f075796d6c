"""``parallel_dcp.save``: its contract, and the keywords gathered into :class:`Options` for the job
(:mod:`parallel_dcp.jobs.save`, or a dry run in :mod:`parallel_dcp.jobs.dryrun`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal, overload

from parallel_dcp.api import _check_torch, _given_or
from parallel_dcp.options import Options

if TYPE_CHECKING:
    from parallel_dcp.jobs.dryrun import DryRunPlan
    from parallel_dcp.jobs.pipeline import SaveResult

__all__ = ["save"]


@overload
def save(
    state_dict: Any,
    path: str | os.PathLike[str],
    *,
    workers: int | None = None,
    overwrite: bool = False,
    progress: bool = False,
    sync_files: bool = True,
    crc32: bool = False,
    memory_limit: int | str | None = None,
    retries: int = 0,
    task_timeout: float | None = None,
    checksums: bool = True,
    chunk_size: int | str | None = None,
    executor: str = "auto",
    distributed: bool = False,
    dist_timeout: float = 1800.0,
    storage_options: dict[str, Any] | None = None,
    compress: str | None = None,
    io: str = "auto",
    options: Options | None = None,
    dry_run: Literal[False] = False,
) -> SaveResult: ...


@overload
def save(
    state_dict: Any,
    path: str | os.PathLike[str],
    *,
    workers: int | None = None,
    overwrite: bool = False,
    progress: bool = False,
    sync_files: bool = True,
    crc32: bool = False,
    memory_limit: int | str | None = None,
    retries: int = 0,
    task_timeout: float | None = None,
    checksums: bool = True,
    chunk_size: int | str | None = None,
    executor: str = "auto",
    distributed: bool = False,
    dist_timeout: float = 1800.0,
    storage_options: dict[str, Any] | None = None,
    compress: str | None = None,
    io: str = "auto",
    options: Options | None = None,
    dry_run: Literal[True],
) -> DryRunPlan: ...


def save(
    state_dict: Any,
    path: str | os.PathLike[str],
    *,
    workers: int | None = None,
    overwrite: bool = False,
    progress: bool = False,
    sync_files: bool = True,
    crc32: bool = False,
    memory_limit: int | str | None = None,
    retries: int = 0,
    task_timeout: float | None = None,
    checksums: bool = True,
    chunk_size: int | str | None = None,
    executor: str = "auto",
    distributed: bool = False,
    dist_timeout: float = 1800.0,
    storage_options: dict[str, Any] | None = None,
    compress: str | None = None,
    io: str = "auto",
    options: Options | None = None,
    dry_run: bool = False,
) -> SaveResult | DryRunPlan:
    """Save ``state_dict`` as a stock DCP checkpoint at ``path``, with a pool of processes.

    The state dict may be nested (``{"model": ..., "optimizer": ...}``) and hold ints, floats,
    strings and lists beside CPU tensors; ``torch.distributed.checkpoint.load`` and
    ``dcp_to_torch_save`` give back the same structure.

    Args:
        state_dict: what to save. Workers are forked after it exists and read it copy-on-write.
        path: the checkpoint directory, or a URL on object storage (``s3://bucket/prefix``, any
            fsspec URL). It must not exist, be empty, or (with ``overwrite``) hold a checkpoint.
        workers: worker processes; None uses every usable core.
        overwrite: replace an existing checkpoint: the new shards are written beside the old
            ones under new names, ``.metadata`` is replaced by one atomic rename (one upload on
            object storage), then the old checkpoint's own files are removed; every other file in
            the directory is kept. If the save fails, the old one stays as it was. Without it,
            nothing is ever replaced, even a checkpoint that appears while the save runs. See
            :mod:`parallel_dcp.storage.staging`.
        progress: show a progress bar on stderr.
        sync_files: fsync every file before the commit (as stock DCP does).
        crc32: compute ``torch.save``'s per-record CRC32 (off by default: no DCP reader checks it).
        memory_limit: ceiling on the memory the job adds to its process tree (bytes, or "512MiB",
            "32GiB", "16GB"); None means half the memory available when the job starts. What is
            counted: see ``parallel_dcp.engine.memory``.
        retries: how often a task whose worker died is run again (same part index).
        task_timeout: seconds one task may run before its worker is killed (None: no limit).
        checksums: record every file's xxh3 checksum in the manifest (``.parallel_dcp.json``) as
            it is written, so :func:`verify` finds flipped bytes; False records sizes only.
        chunk_size: tensors larger than this (bytes or "1GiB") are split into row ranges that
            different workers write as DCP chunks; None derives it from the balanced share per
            worker and the memory limit.
        executor: ``"processes"``, ``"threads"`` or ``"auto"`` (threads for large tensors and
            plain values without ``retries``/``task_timeout``; processes otherwise). Threads write
            with the GIL released and skip the fork; processes isolate crashes, can be killed by
            the memory watchdog and run Python-heavy work (many small tensors) in parallel.
        distributed: run as one rank of a torchrun/srun job (every rank passes the same state
            dict and path, on a shared file system); each rank writes its share with its own
            pool and rank 0 commits once. See :mod:`parallel_dcp.jobs.distributed`.
        dist_timeout: with ``distributed``, seconds a rank waits for the others at each step
            before the job fails (default 30 minutes), so a dead rank cannot hang the others.
        storage_options: fsspec options for URLs (``{"endpoint_url": ...}``); credentials come
            from the standard AWS environment and config. On object storage ``.metadata`` is
            uploaded last, after every shard (see :mod:`parallel_dcp.storage.staging`).
        io: ``"auto"`` (default), ``"direct"`` or ``"buffered"``: how shards reach local files
            (O_DIRECT through aligned buffers, or the page cache); auto uses O_DIRECT on block
            file systems that accept it, for shards of at least 16 MiB, and buffered I/O on
            tmpfs, FUSE, network file systems and object storage. ``SaveResult.io`` says which
            was used. ``"direct"`` where O_DIRECT cannot be used raises InvalidDestinationError.
        compress: ``None``, ``"zstd"`` or ``"zstd:LEVEL"`` (1..22, default 3): each record is
            compressed by the worker that writes it, as one zstd frame exactly as stock DCP's
            ``ZStandard`` extension writes it (stock ``dcp.load`` reads it with ``zstandard``
            installed); needs ``pip install '.[zstd]'`` in a checkout. See docs/compression.md.
        options: all of the above as one :class:`Options` (what the CLI builds); the keyword
            arguments then stay at their defaults. The other functions take it too.
        dry_run: plan the save as a real one would (files, tasks, chunks, workers, predicted
            peak memory, space) and return the plan; nothing is written.

    Returns:
        A :class:`SaveResult` with bytes, files, tasks, seconds, GiB/s and per-worker figures;
        with ``dry_run``, a :class:`DryRunPlan`.

    Raises:
        InvalidStateDictError: the state dict cannot be saved (checked before any write).
        CheckpointExistsError: ``path`` holds a checkpoint and ``overwrite`` is False.
        DestinationBusyError: another save is writing ``path`` (its host and pid are named).
        InvalidDestinationError: ``path`` is a file, a foreign directory or has no parent.
        InsufficientSpaceError: the file system has less free space than the checkpoint needs.
        WorkerError: a task raised in a worker (its traceback is the ``__cause__``).
        WorkerCrashed: a worker died (exit code or signal, and the keys it held, are named).
        MemoryLimitExceeded: an item cannot fit (before any write) or a worker crossed the limit.
        TaskTimeoutError: a task ran past ``task_timeout``.
        On any failure nothing is committed: ``path`` is as it was before the call.
    """
    options = _given_or(
        options,
        Options(
            workers=workers,
            overwrite=overwrite,
            progress=progress,
            sync_files=sync_files,
            crc32=crc32,
            memory_limit=memory_limit,
            retries=retries,
            task_timeout=task_timeout,
            checksums=checksums,
            chunk_size=chunk_size,
            executor=executor,
            distributed=distributed,
            dist_timeout=dist_timeout,
            storage_options=storage_options,
            compress=compress,
            io=io,
        ),
    )
    if dry_run:
        from parallel_dcp.jobs.dryrun import dry_run_save

        _check_torch()
        return dry_run_save(state_dict, path, options)
    from parallel_dcp.jobs.save import save as _save

    _check_torch()
    return _save(state_dict, path, options)
