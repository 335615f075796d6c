"""``parallel_dcp.verify``: its contract, and the keywords gathered into :class:`Options` for the job
(:mod:`parallel_dcp.jobs.verify`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from parallel_dcp.api import _check_torch, _given_or
from parallel_dcp.options import Options

if TYPE_CHECKING:
    import torch

    from parallel_dcp.jobs.verify import VerifyReport

__all__ = ["verify"]


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
    may be URLs (``storage_options`` as for :func:`save`). A key whose path passes a mapping key
    that is not a string (an optimizer's state keyed by int parameter index, as a torch.save file
    keeps it) where ``against`` holds another key (the string ``'0'``, as DCP names it) is a
    problem, named with both: an optimizer's ``load_state_dict`` fills its parameters from the one only.

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
