"""parallel_dcp: write and read PyTorch Distributed Checkpoints with a pool of worker processes.

The output is a stock DCP checkpoint: ``torch.distributed.checkpoint.load`` and every other DCP
reader open it unchanged.

    >>> import parallel_dcp, torch
    >>> result = parallel_dcp.save({"w": torch.ones(4)}, "/tmp/ckpt", overwrite=True)
    >>> parallel_dcp.load("/tmp/ckpt")["w"].sum().item()
    4.0

Longer than 300 lines because every public function's full contract (arguments, results, errors)
lives here, with typed overloads for dry_run; the logic is in jobs/.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

from parallel_dcp._version import __version__ as __version__
from parallel_dcp.errors import (
    CheckpointExistsError,
    CompressionUnavailableError,
    CorruptCheckpointError,
    DestinationBusyError,
    DistributedJobError,
    IncompatibleTorchError,
    InsufficientSpaceError,
    InvalidDestinationError,
    InvalidStateDictError,
    KeyNotFoundError,
    KeyPatternError,
    MemoryLimitExceeded,
    ParallelDCPError,
    QuantizationError,
    RemoteTraceback,
    RenameError,
    RenameWarning,
    ResumeError,
    TaskTimeoutError,
    UnsafeCheckpointError,
    WorkerCrashed,
    WorkerError,
)
from parallel_dcp.options import DEFAULT_SHARD_SIZE, Options

# torch and the jobs are imported on first use, not here: ``parallel-dcp --help`` and usage errors
# then answer without the seconds torch takes to import. The names below are served by
# ``__getattr__``; the public functions import their job modules when called.
if TYPE_CHECKING:
    import torch

    from parallel_dcp.formats.fast_read import ReadStats
    from parallel_dcp.formats.fast_reader import FastReader
    from parallel_dcp.jobs.diff import DiffReport
    from parallel_dcp.jobs.dryrun import DryRunPlan
    from parallel_dcp.jobs.pipeline import SaveResult, WorkerStats
    from parallel_dcp.jobs.rename import RenameRules
    from parallel_dcp.jobs.verify import VerifyReport
    from parallel_dcp.partial import (
        commit,
        extract_metadata,
        load_metadata,
        merge_metadata,
        partial_load,
        partial_save,
    )

_LAZY = {
    "ReadStats": "parallel_dcp.formats.fast_read",
    "FastReader": "parallel_dcp.formats.fast_reader",
    "DiffReport": "parallel_dcp.jobs.diff",
    "DryRunPlan": "parallel_dcp.jobs.dryrun",
    "SaveResult": "parallel_dcp.jobs.pipeline",
    "WorkerStats": "parallel_dcp.jobs.pipeline",
    "RenameRules": "parallel_dcp.jobs.rename",
    "VerifyReport": "parallel_dcp.jobs.verify",
    **dict.fromkeys(
        ("commit", "extract_metadata", "load_metadata", "merge_metadata", "partial_load", "partial_save"),
        "parallel_dcp.partial",
    ),
}


def _check_torch() -> None:
    """A torch or fsspec without a private name we use fails here, naming it (once, on first use)."""
    from parallel_dcp import _compat

    _compat.check_torch()


def __getattr__(name: str) -> Any:
    """The exported classes and seed functions, imported (with torch) the first time one is asked for."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'parallel_dcp' has no attribute {name!r}")
    _check_torch()
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CheckpointExistsError",
    "CompressionUnavailableError",
    "CorruptCheckpointError",
    "DestinationBusyError",
    "DiffReport",
    "DistributedJobError",
    "DryRunPlan",
    "FastReader",
    "IncompatibleTorchError",
    "InsufficientSpaceError",
    "InvalidDestinationError",
    "InvalidStateDictError",
    "KeyNotFoundError",
    "KeyPatternError",
    "MemoryLimitExceeded",
    "Options",
    "ParallelDCPError",
    "QuantizationError",
    "ReadStats",
    "RemoteTraceback",
    "RenameError",
    "RenameWarning",
    "ResumeError",
    "SaveResult",
    "TaskTimeoutError",
    "UnsafeCheckpointError",
    "VerifyReport",
    "WorkerCrashed",
    "WorkerError",
    "WorkerStats",
    "commit",
    "convert",
    "diff",
    "extract_metadata",
    "inspect",
    "load",
    "load_metadata",
    "merge_metadata",
    "partial_load",
    "partial_save",
    "save",
    "verify",
]


def _given_or(given: Options | None, from_keywords: Options) -> Options:
    """``options=`` when it was passed (the keywords then stay at their defaults), else the keywords'."""
    if given is None:
        return from_keywords
    if from_keywords != Options():
        raise TypeError("pass the options either as options=Options(...) or as keyword arguments, not both")
    return given


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


def load(
    path: str | os.PathLike[str],
    *,
    keys: Iterable[str] | None = None,
    workers: int | None = None,
    progress: bool = False,
    memory_limit: int | str | None = None,
    retries: int = 0,
    task_timeout: float | None = None,
    storage_options: dict[str, Any] | None = None,
    io: str = "auto",
    options: Options | None = None,
    into: dict[str, Any] | None = None,
    trust_pickle: bool = False,
    stats: ReadStats | None = None,
) -> dict[str, Any]:
    """Load a DCP checkpoint (all keys, or the flattened ``keys`` given), fast.

    Each tensor's bytes are read straight from its shard into the tensor's memory (``preadv``
    by ``workers`` threads, reads sorted by offset and merged where adjacent), after its
    ``torch.save`` record was checked against ``.metadata``; compressed (zstd) records are
    decompressed by the same threads, bounded by what ``.metadata`` says they hold; records that
    do not fit that path (non-contiguous) go through DCP's own reader (``stats`` counts each).
    ``.metadata`` is read with an allow-list unpickler, never plain pickle; every shard it names
    must be a plain file name inside ``path``.

    Args:
        path: a committed DCP checkpoint directory (written by any DCP writer), or its URL.
        keys: flattened names (``"model.layer.weight"``) or patterns to load, as ``convert``'s
            ``keys`` (``"model.layers.0.*"``, ``"re:lm_head\\..*"``; a name that is a key selects
            itself); None loads everything (with ``into``: every key of ``into``; patterns then
            select among ``into``'s keys).
        workers: reading threads (worker processes with ``retries``/``task_timeout``); None uses
            every usable core.
        progress: show a progress bar on stderr.
        memory_limit: as for :func:`save`. Without ``into`` the loaded tensors count against it,
            beside bounded read buffers (about 8 MiB per thread); with ``into``, only the buffers.
        retries, task_timeout: as for :func:`save`; they make the load run on killable worker
            processes (without ``into``).
        storage_options: as for :func:`save`.
        io: as for :func:`save`: shards of at least 16 MiB are read with O_DIRECT (aligned
            reads, two in flight per thread, then copied into the tensors) where the file
            system takes it; ``"buffered"`` reads through the page cache.
        into: a state dict (nested as it was saved) of preallocated CPU tensors, filled in place,
            and returned; non-tensor values in it are replaced by the loaded ones. Every tensor
            must have the stored dtype and shape: a mismatch raises before any read, load never
            casts. A shard found damaged while reading raises and may leave ``into`` partly filled.
        trust_pickle: unpickle non-tensor values without ``weights_only`` (runs their pickle
            code: only for checkpoints you trust).
        stats: a :class:`ReadStats` to add the counts of this load to (fast path, fallback).

    Returns:
        A new dict with the checkpoint's original nesting, or ``into`` itself.

    Raises:
        FileNotFoundError: ``path`` holds no committed checkpoint.
        KeyNotFoundError: a requested key is not in the checkpoint (or not in ``into``), an
            ``into`` key the checkpoint lacks, or a pattern that selects nothing (also a
            ``KeyError``; every name is listed).
        KeyPatternError: a ``re:`` pattern that is not a regular expression.
        InvalidStateDictError: an ``into`` tensor's dtype or shape differs (names the key, both
            dtypes or shapes), or it is not a plain tensor.
        UnsafeCheckpointError / CorruptCheckpointError: ``.metadata`` or a value is malicious,
            or a shard is damaged, truncated or named outside ``path``.
        MemoryLimitExceeded: the selected keys do not fit under ``memory_limit``.
        WorkerError / WorkerCrashed / TaskTimeoutError: a worker failed; no partial result is returned.
    """
    options = _given_or(
        options,
        Options(
            workers=workers,
            progress=progress,
            memory_limit=memory_limit,
            retries=retries,
            task_timeout=task_timeout,
            storage_options=storage_options,
            io=io,
        ),
    )
    from parallel_dcp.jobs import load as _loader

    _check_torch()
    return _loader.load(path, keys, options, into=into, trust_pickle=trust_pickle, stats=stats)


@overload
def convert(
    src: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    dst: str | os.PathLike[str],
    *,
    to: str | None = None,
    workers: int | None = None,
    memory_limit: int | str | None = None,
    dtype: str | torch.dtype | None = None,
    keys: str | Sequence[str] | None = None,
    overwrite: bool = False,
    progress: bool = False,
    shard_size: int | str = DEFAULT_SHARD_SIZE,
    trust_pickle: bool = False,
    sync_files: bool = True,
    retries: int = 0,
    task_timeout: float | None = None,
    checksums: bool = True,
    chunk_size: int | str | None = None,
    distributed: bool = False,
    dist_timeout: float = 1800.0,
    storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    rename: RenameRules | None = None,
    compress: str | None = None,
    dry_run: Literal[False] = False,
    resume: bool = False,
    copy_files: bool = True,
    copy_files_from: str | os.PathLike[str] | None = None,
    dequantize: bool = False,
    quantize: str | None = None,
    quantize_keys: str | Sequence[str] | None = None,
    block_size: int | None = None,
    io: str = "auto",
) -> SaveResult | list[SaveResult]: ...


@overload
def convert(
    src: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    dst: str | os.PathLike[str],
    *,
    to: str | None = None,
    workers: int | None = None,
    memory_limit: int | str | None = None,
    dtype: str | torch.dtype | None = None,
    keys: str | Sequence[str] | None = None,
    overwrite: bool = False,
    progress: bool = False,
    shard_size: int | str = DEFAULT_SHARD_SIZE,
    trust_pickle: bool = False,
    sync_files: bool = True,
    retries: int = 0,
    task_timeout: float | None = None,
    checksums: bool = True,
    chunk_size: int | str | None = None,
    distributed: bool = False,
    dist_timeout: float = 1800.0,
    storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    rename: RenameRules | None = None,
    compress: str | None = None,
    dry_run: Literal[True],
    resume: bool = False,
    copy_files: bool = True,
    copy_files_from: str | os.PathLike[str] | None = None,
    dequantize: bool = False,
    quantize: str | None = None,
    quantize_keys: str | Sequence[str] | None = None,
    block_size: int | None = None,
    io: str = "auto",
) -> DryRunPlan | list[DryRunPlan]: ...


def convert(
    src: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    dst: str | os.PathLike[str],
    *,
    to: str | None = None,
    workers: int | None = None,
    memory_limit: int | str | None = None,
    dtype: str | torch.dtype | None = None,
    keys: str | Sequence[str] | None = None,
    overwrite: bool = False,
    progress: bool = False,
    shard_size: int | str = DEFAULT_SHARD_SIZE,
    trust_pickle: bool = False,
    sync_files: bool = True,
    retries: int = 0,
    task_timeout: float | None = None,
    checksums: bool = True,
    chunk_size: int | str | None = None,
    distributed: bool = False,
    dist_timeout: float = 1800.0,
    storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    rename: RenameRules | None = None,
    compress: str | None = None,
    dry_run: bool = False,
    resume: bool = False,
    copy_files: bool = True,
    copy_files_from: str | os.PathLike[str] | None = None,
    dequantize: bool = False,
    quantize: str | None = None,
    quantize_keys: str | Sequence[str] | None = None,
    block_size: int | None = None,
    io: str = "auto",
) -> SaveResult | list[SaveResult] | DryRunPlan | list[DryRunPlan]:
    """Convert between DCP, safetensors and torch.save, with a pool of processes, under a memory limit.

    The source format is detected: a DCP directory (``.metadata``), a ``.safetensors`` file or a
    Hugging Face directory of them, a torch.save file (``.pt``/``.pth``/``.bin``) or a directory
    with ``pytorch_model.bin.index.json``. Sources are read lazily (mmap, partial reads): the
    memory used is about the tasks in flight, not the model.

    Args:
        src: one source, or several (each converts into ``dst/<source name>``).
        dst: the output. ``to=None`` goes by its name: ``*.safetensors`` one safetensors file,
            ``*.pt``/``*.pth``/``*.bin`` one torch.save file, anything else a DCP directory.
        to: ``"dcp"``, ``"safetensors"`` or ``"torch"``; with the last two and a ``dst`` without
            those suffixes, a sharded Hugging Face directory (shards plus index JSON).
        workers, memory_limit, overwrite, progress, sync_files, retries, task_timeout, checksums,
            chunk_size, distributed, dist_timeout, storage_options: as for :func:`save`. Sources and
            destinations may be URLs (``s3://...``): safetensors and DCP sources are read by byte
            ranges, torch.save sources through a local temporary copy.
        compress: for a DCP output, as for :func:`save` (any other output refuses it).
        io: as for :func:`save`, for the shards written (DCP outputs) and the DCP shards read.
        dtype: cast floating tensors to this dtype on the way (``"bfloat16"``, ``torch.float16``).
        keys: select keys: globs on flattened names (``"model.layers.*"``), or ``"re:<regex>"``
            matched against the whole name; several patterns select the union.
        shard_size: the largest shard of a sharded output (bytes or "2GB"; default 5 GB); shards
            are also kept under what each worker may use under ``memory_limit``.
        trust_pickle: allow torch.save files that need ``weights_only=False`` (runs their pickle
            code: only for files you trust).
        rename: rename keys after ``keys`` selects them: ``[(regex, template), ...]`` (Python
            ``re``; each regex must match the whole flattened name; ``\\1`` / ``\\g<name>`` in
            the template; the first matching rule wins; unmatched names are kept), or a callable
            ``name -> new name or None``. The output's nesting follows the new names (see
            :mod:`parallel_dcp.jobs.rename`). Renaming never changes tensor data.
        dry_run: plan the conversion as a real one would (output files with their keys and
            bytes, tasks per worker, chunks, workers the limit allows, predicted peak memory next
            to the limit, space needed next to space free) and return it; nothing is written.
        resume: continue a conversion to ``dst`` that died (SIGKILL, power loss, out of space,
            interrupted) and was started with the same arguments: every task whose files are
            complete and hash as its durable record says is kept, the rest is redone, and the
            output is committed as usual (``bytes_kept`` / ``bytes_rewritten`` in the result).
            Workers and memory limit may differ. With nothing to resume, a fresh run. Local
            destinations only. Without ``resume``, a dead conversion's files are removed (with a
            warning) and the conversion starts over. See :mod:`parallel_dcp.jobs.resume`.
        copy_files: a Hugging Face directory converted to a sharded safetensors or torch
            directory gets the source's other files too (``config.json``,
            ``generation_config.json``, tokenizer files, ...: plain files at its top level that
            are neither weights, nor indexes, nor hidden), so ``from_pretrained`` loads the
            output. They are committed with the shards (written new under this save's temporary
            names, renamed into place with the index, in the manifest, removed if the save
            fails). False copies nothing. See :mod:`parallel_dcp.jobs.copy_files`.
        copy_files_from: copy the files of this directory instead (any source, such as a DCP
            checkpoint from training beside the model's original folder); needs a sharded
            directory output.
        dequantize: dequantize FP8 block-scaled pairs (``X.weight`` float8_e4m3fn +
            ``X.weight_scale_inv``) and MXFP4 pairs (``X_blocks`` + ``X_scales``, output ``X``) to
            ``dtype`` (default bfloat16; float16 and float32 allowed); scales are dropped, other
            tensors kept (cast only when ``dtype`` is given). Values equal stock
            ``QuantizedHuggingFaceStorageReader``'s bit for bit. ``keys`` then names output tensors.
        quantize: ``"fp8-block"`` or ``"fp8-block:BLOCK"``: write the weights ``quantize_keys``
            selects (same patterns as ``keys``; default: 2-D floating ``*.weight`` tensors except
            embeddings, norms, the output head and MoE routers) as float8_e4m3fn plus a float32
            ``X.weight_scale_inv`` per block (DeepSeek layout); a Hugging Face output always gets
            its index and the ``quantization_config`` in the copied ``config.json``.
        block_size: the FP8 block of ``dequantize`` (default: ``config.json``'s
            ``weight_block_size``, else 128) or of ``quantize="fp8-block"``.

    Returns:
        A :class:`SaveResult` (a list of them for several sources) with ``format``, ``keys``,
        bytes, files, seconds, GiB/s and the measured peak memory; with ``dry_run``, a
        :class:`DryRunPlan` (or a list of them).

    Raises:
        ValueError: a bad ``to``, ``dtype`` or ``keys``, or non-tensor values bound for safetensors.
        RenameError: bad rename rules, several keys renamed to one name, an empty name, or
            clashing nesting (all listed; nothing is written).
        UnsafeCheckpointError: a torch.save file that needs ``trust_pickle``.
        QuantizationError: ``dequantize`` of a source with a weight without its scale (or the
            reverse), a scale not shaped as the weight's blocks, a non-FP8 weight beside a
            ``weight_scale_inv``, an E8M0 exponent 255; a bad ``quantize`` spec or a rule that
            selects nothing (all before anything is written; ``.keys`` names the tensors).
        ResumeError: ``resume`` found a dead conversion to ``dst`` made with other arguments
            (sources, keys, rename, dtype, format, shard or chunk size) or from a source that
            changed since; its files are left as they were. Also for object storage and
            ``distributed``.
        Otherwise as :func:`save`; on failure each destination is as it was before the call,
            except that a failed conversion leaves its finished tasks (and their records) for
            ``resume``.
    """
    from parallel_dcp.engine.memory import parse_size
    from parallel_dcp.jobs import convert as _convert
    from parallel_dcp.jobs import rename as _rename
    from parallel_dcp.jobs.dryrun import DryRunPlan
    from parallel_dcp.jobs.pipeline import SaveResult
    from parallel_dcp.storage.location import is_url

    _check_torch()
    options = _given_or(
        options,
        Options(
            workers=workers,
            overwrite=overwrite,
            progress=progress,
            sync_files=sync_files,
            memory_limit=memory_limit,
            retries=retries,
            task_timeout=task_timeout,
            checksums=checksums,
            chunk_size=chunk_size,
            distributed=distributed,
            dist_timeout=dist_timeout,
            storage_options=storage_options,
            resume=resume,
            compress=compress,
            io=io,
        ),
    )
    cast = _convert.parse_dtype(dtype)
    quantization = _quantization(cast, dequantize, quantize, quantize_keys, block_size)
    shard_bytes = parse_size(shard_size, "shard_size")
    sources = [src] if isinstance(src, (str, os.PathLike)) else list(src)
    if not sources:
        raise ValueError("convert needs at least one source")
    outputs = _convert.destinations(sources, dst)
    if len(sources) > 1 and not is_url(dst) and not dry_run:
        os.makedirs(dst, exist_ok=True)
    if rename is not None:
        _rename.compile_rules(rename)  # bad rules fail before any source is opened
    results = [
        _convert.convert_one(
            one,
            out,
            options,
            to=to,
            dtype=cast,
            keys=keys,
            shard_size=shard_bytes,
            trust_pickle=trust_pickle,
            rename=rename,
            dry_run=dry_run,
            copy_files=copy_files,
            copy_files_from=copy_files_from,
            quantization=quantization,
        )
        for one, out in zip(sources, outputs, strict=True)
    ]
    if isinstance(src, (str, os.PathLike)):
        return results[0]
    if dry_run:
        return [r for r in results if isinstance(r, DryRunPlan)]
    return [r for r in results if isinstance(r, SaveResult)]


def _quantization(
    cast: torch.dtype | None,
    dequantize: bool,
    quantize: str | None,
    quantize_keys: str | Sequence[str] | None,
    block_size: int | None,
) -> Any:
    """The conversion's :class:`~parallel_dcp.jobs.quantization.Quantization` (None: none asked for)."""
    if not dequantize and quantize is None and quantize_keys is None and block_size is None:
        return None
    import torch

    from parallel_dcp.jobs.quantization import Quantization

    target = cast or torch.bfloat16
    if dequantize and target not in (torch.bfloat16, torch.float16, torch.float32):
        raise QuantizationError(f"dequantize writes bfloat16, float16 or float32, not {target}")
    return Quantization(
        dequantize=dequantize,
        dequantize_dtype=target,
        quantize=quantize,
        quantize_keys=quantize_keys,
        block_size=block_size,
    )


def verify(
    path: str | os.PathLike[str],
    *,
    against: str | os.PathLike[str] | None = None,
    workers: int | None = None,
    memory_limit: int | str | None = None,
    dtype: str | torch.dtype | None = None,
    storage_options: dict[str, Any] | None = None,
    io: str = "auto",
    options: Options | None = None,
    trust_pickle: bool = False,
    deep: bool = True,
    dequantize: bool = False,
    block_size: int | None = None,
) -> VerifyReport:
    """Check a checkpoint: manifest sizes and checksums, every key read back, and bit-for-bit
    equality with ``against`` (any supported format) when given.

    Finds what stock DCP loads silently: a flipped byte, a truncated shard. Problems are
    collected in the report (``report.ok`` is False, ``report.problems`` sorted), not raised.
    Tensors too large to compare whole under ``memory_limit`` are compared in row ranges, so
    ``verify`` works under any limit that :func:`convert` works under. ``path`` and ``against``
    may be URLs (``storage_options`` as for :func:`save`).

    Args:
        dtype: compare against ``against`` cast the way ``convert(..., dtype=dtype)`` casts it
            (floating tensors only), exactly; for checking a conversion that changed the dtype.
        deep: read every tensor back (the default; compressed records are decompressed and each
            checked against ``.metadata``). False checks the manifest only (sizes and checksums of
            the stored bytes: compressed records are not decompressed) and the shards' lengths;
            ``against`` always reads both sides.
        dequantize, block_size: compare with ``against`` dequantized as ``convert(...,
            dequantize=True, dtype=dtype, block_size=block_size)`` writes it, exactly.

    Raises:
        FileNotFoundError / ValueError: ``path`` or ``against`` is missing or of no known format;
            ``dtype`` without ``against``, or not a floating dtype.
        CorruptCheckpointError / UnsafeCheckpointError: a damaged or malicious ``.metadata``.
    """
    options = _given_or(
        options, Options(workers=workers, memory_limit=memory_limit, storage_options=storage_options, io=io)
    )
    from parallel_dcp.jobs import convert as _convert
    from parallel_dcp.jobs import verify as _verify

    _check_torch()
    return _verify.verify(
        path,
        against,
        options,
        _convert.parse_dtype(dtype),
        trust_pickle=trust_pickle,
        deep=deep,
        dequantize=dequantize,
        block_size=block_size,
    )


def inspect(
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    trust_pickle: bool = False,
    keys: str | Sequence[str] | None = None,
) -> dict[str, Any]:
    """Describe a checkpoint from its headers only: ``format``, ``committed``, ``keys``,
    ``tensors``, ``total_bytes``, ``dtypes``, ``largest`` tensors, ``files``, ``manifest``,
    ``values`` (non-tensor values by key and stored size, never unpickled), ``key_list`` (every
    key with its ``kind``, ``dtype``, ``shape`` and ``bytes``; ``keys``: only those these
    patterns select, as for :func:`convert`), ``damaged`` (why it is not loadable, or None) and
    ``leftovers`` (files of saves that did not finish).
    ``path`` may be a URL (``storage_options`` as for :func:`save`); ``trust_pickle`` lets a
    torch.save file that needs ``weights_only=False`` be listed (it runs its pickle code)."""
    from parallel_dcp.jobs import inspect as _inspection

    _check_torch()
    return _inspection.inspect_checkpoint(path, storage_options, trust_pickle=trust_pickle, keys=keys)


def diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    workers: int | None = None,
    memory_limit: int | str | None = None,
    storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    trust_pickle: bool = False,
) -> DiffReport:
    """Compare two checkpoints of any formats: keys, dtypes, shapes and content checksums.

    Tensors are hashed (xxh3-64 of their bytes) by a pool of workers under ``memory_limit``, one
    key at a time, nothing kept beyond the tensor being hashed; only tensors a comparison needs
    are read. The report lists keys ``added`` in ``b``, ``removed`` from ``a``, ``renamed``
    (a tensor only in ``a`` and one only in ``b`` with the same dtype, shape and bytes), and
    ``changed`` (dtype, shape, content, or a non-tensor value). ``report.same`` when nothing
    differs. ``a`` and ``b`` may be URLs (``storage_options`` as for :func:`save`). Non-tensor
    values are unpickled with ``weights_only=True`` unless ``trust_pickle`` (as for :func:`load`).

    Raises:
        FileNotFoundError / ValueError: ``a`` or ``b`` is missing or of no known format.
        MemoryLimitExceeded: one tensor cannot be read under ``memory_limit``.
    """
    options = _given_or(options, Options(workers=workers, memory_limit=memory_limit, storage_options=storage_options))
    from parallel_dcp.jobs import diff as _diff

    _check_torch()
    return _diff.diff(a, b, options, trust_pickle=trust_pickle)
