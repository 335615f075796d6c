"""``parallel_dcp.load``: its contract, and the keywords gathered into :class:`Options` for the job
(:mod:`parallel_dcp.jobs.load`)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from parallel_dcp.api import _check_torch, _given_or
from parallel_dcp.errors import QuantizationError
from parallel_dcp.options import Options

if TYPE_CHECKING:
    import torch

    from parallel_dcp.formats.fast_read import ReadStats

__all__ = ["load"]


def load(
    path: str | os.PathLike[str],
    *,
    keys: str | Iterable[str] | None = None,
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
    dtype: str | torch.dtype | None = None,
    dequantize: bool = False,
    block_size: int | None = None,
) -> dict[str, Any]:
    """Load a checkpoint of any format ``convert`` reads (all keys, or the flattened ``keys`` given), fast.

    Besides DCP: a ``.safetensors`` file, a Hugging Face folder of them (with or without
    ``model.safetensors.index.json``), a torch.save file or folder (``weights_only=True`` unless
    ``trust_pickle``), and quantized releases with ``dequantize=True``. Their tensors are read by
    the same pool of threads straight from the files into the tensors' memory (``preadv``, or
    O_DIRECT as ``io`` says); shards are opened by the same rule (no symlink out of the folder,
    regular files only) and every size is checked against the file before any read. The result
    equals ``safetensors.torch.load_file`` (flat names) or ``torch.load(weights_only=True)``
    (its nesting).

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
        dtype: cast floating tensors to this dtype on the way (``"bfloat16"``, ``torch.float16``);
            ``into`` tensors must then have it. Other tensors are kept as stored.
        dequantize: as for :func:`convert`: FP8 block-scaled and MXFP4 pairs are returned
            dequantized (to ``dtype``, default bfloat16), equal to what ``convert`` writes.
        block_size: the FP8 block of ``dequantize`` (default: ``config.json``, else 128).

    Returns:
        A new dict with the checkpoint's original nesting, or ``into`` itself.

    Raises:
        FileNotFoundError: ``path`` holds no committed checkpoint nor any other format.
        QuantizationError: ``dequantize`` of a source whose pairs do not match.
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
    from parallel_dcp.jobs.convert import parse_dtype
    from parallel_dcp.jobs.load_files import load_any

    _check_torch()
    cast = parse_dtype(dtype)
    if dequantize and cast is not None and str(cast) not in _DEQUANTIZED:
        raise QuantizationError(f"dequantize gives bfloat16, float16 or float32, not {cast}")
    return load_any(
        path,
        keys,
        options,
        into=into,
        trust_pickle=trust_pickle,
        stats=stats,
        dtype=cast,
        dequantize=dequantize,
        block_size=block_size,
    )


_DEQUANTIZED = ("torch.bfloat16", "torch.float16", "torch.float32")
