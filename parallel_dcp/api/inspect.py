"""``parallel_dcp.inspect`` and ``parallel_dcp.diff``: what a checkpoint holds, and what changed between
two (:mod:`parallel_dcp.jobs.inspect`, :mod:`parallel_dcp.jobs.diff`); neither writes anything."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from parallel_dcp.api import _check_torch, _given_or
from parallel_dcp.options import Options

if TYPE_CHECKING:
    from parallel_dcp.jobs.diff import DiffReport

__all__ = ["diff", "inspect"]


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
    ``changed`` (dtype, shape, content, a non-tensor value, or a key type: a level of the key held
    as an int key, an optimizer's parameter index, in one and as another key in the other, the
    string ``'0'`` as DCP names it). ``report.same`` when nothing differs. ``a`` and ``b`` may be
    URLs (``storage_options`` as for :func:`save`). Non-tensor values are unpickled with
    ``weights_only=True`` unless ``trust_pickle`` (as for :func:`load`).

    Raises:
        FileNotFoundError / ValueError: ``a`` or ``b`` is missing or of no known format.
        MemoryLimitExceeded: one tensor cannot be read under ``memory_limit``.
    """
    options = _given_or(options, Options(workers=workers, memory_limit=memory_limit, storage_options=storage_options))
    from parallel_dcp.jobs import diff as _diff

    _check_torch()
    return _diff.diff(a, b, options, trust_pickle=trust_pickle)
