"""Guarded access to the torch internals that parallel_dcp relies on.

The seed primitives use private DCP names. Importing them here, once, turns a torch upgrade that
moves or renames one into a clear :class:`IncompatibleTorchError` naming the torch version,
instead of an ``AttributeError`` from deep inside a worker.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from parallel_dcp.errors import IncompatibleTorchError

MIN_TORCH = "2.4"

_F = TypeVar("_F", bound=Callable[..., Any])


def _private(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise IncompatibleTorchError(
            f"parallel_dcp needs {module}.{name}, which torch {torch.__version__} does not have; "
            f"parallel_dcp supports torch >= {MIN_TORCH} (tested on 2.13). "
            "Install a supported torch or report this torch version."
        ) from exc


def storage_prefix(prefix: str) -> Any:
    """Build the ``storage_data`` that tells ``FileSystemWriter`` which file prefix to use."""
    return _private("torch.distributed.checkpoint.filesystem", "_StoragePrefix")(prefix)


def empty_state_dict_load_planner() -> Any:
    """The planner that loads every key of a metadata into an empty dict."""
    return _private("torch.distributed.checkpoint.default_planner", "_EmptyStateDictLoadPlanner")()


def flatten_state_dict(state_dict: Any) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """DCP's own flattening, so that our keys and ``planner_data`` match what DCP readers expect."""
    return _private("torch.distributed.checkpoint._nested_dict", "flatten_state_dict")(state_dict)  # type: ignore[no-any-return]


def unflatten_state_dict(flat: dict[str, Any], mapping: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """Restore nesting from ``planner_data``."""
    return _private("torch.distributed.checkpoint._nested_dict", "unflatten_state_dict")(flat, mapping)  # type: ignore[no-any-return]


def set_element(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """DCP's own setter of a nested element (as ``DefaultLoadPlanner.load_bytes`` uses it)."""
    _private("torch.distributed.checkpoint._traverse", "set_element")(root, path, value)


def dcp_method_logger(**kwargs: Any) -> Callable[[_F], _F]:
    """DCP's event logger where torch has it; logging only, so a plain pass-through otherwise."""
    try:
        from torch.distributed.checkpoint.logger import _dcp_method_logger
    except ImportError:
        return lambda func: func
    return _dcp_method_logger(**kwargs)  # type: ignore[no-any-return,return-value]


def set_crc32(enabled: bool) -> None:
    """Turn the per-record CRC32 of ``torch.save`` on or off for the calling thread.

    DCP writes every tensor as a ``torch.save`` zip record, and the CRC32 of those records costs
    about two thirds of a save's time while no DCP reader ever checks it. Older torch always
    computes it; there this is a no-op.
    """
    setter = getattr(torch.serialization, "set_crc32_options", None)
    if setter is not None:
        setter(enabled)


@functools.cache
def check_torch() -> None:
    """Fail early, in the caller, if any required internal is missing."""
    _private("torch.distributed.checkpoint.filesystem", "_StoragePrefix")
    _private("torch.distributed.checkpoint.default_planner", "_EmptyStateDictLoadPlanner")
    _private("torch.distributed.checkpoint._nested_dict", "flatten_state_dict")
    _private("torch.distributed.checkpoint._nested_dict", "unflatten_state_dict")
