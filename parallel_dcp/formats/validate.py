"""Checks that run before anything is written, so bad input fails with a clear message."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from parallel_dcp import _compat
from parallel_dcp.errors import InvalidStateDictError

__all__ = ["flatten_checked"]


def _check_keys(value: Any, path: str) -> None:
    if isinstance(value, Mapping):
        for key, inner in value.items():
            if not isinstance(key, str):
                raise InvalidStateDictError(
                    f"key {key!r} ({type(key).__name__}) under {path or 'the top level'} is not a string; "
                    "DCP stores string keys only"
                )
            _check_keys(inner, f"{path}.{key}" if path else key)
    elif isinstance(value, (list, tuple)):
        for i, inner in enumerate(value):
            _check_keys(inner, f"{path}.{i}")


def _check_tensor(key: str, tensor: torch.Tensor) -> None:
    problem = None
    if tensor.is_meta or tensor.device.type == "meta":
        problem = "is a meta tensor (it has no data)"
    elif tensor.layout != torch.strided:
        problem = f"has layout {tensor.layout}; only dense (strided) tensors can be saved, call .to_dense() first"
    elif tensor.is_quantized:
        problem = "is quantized; dequantize it or save its int_repr() and scales"
    elif tensor.device.type != "cpu":
        problem = f"is on {tensor.device}; move the state dict to the CPU first (parallel_dcp writes from CPU memory)"
    if problem:
        raise InvalidStateDictError(f"tensor {key!r} {problem}")


def flatten_checked(state_dict: Any) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """Flatten ``state_dict`` the way DCP does, refusing input that cannot be saved faithfully.

    Returns:
        ``(flat, mapping)``: flattened keys to values, and each key's path in the original
        nesting (what DCP stores as ``planner_data``).

    Raises:
        InvalidStateDictError: not a mapping, a non-string key, two keys that flatten to the
            same name, or a tensor that is meta, sparse, quantized or not on the CPU.
    """
    if not isinstance(state_dict, Mapping):
        raise InvalidStateDictError(f"a state dict must be a mapping, got {type(state_dict).__name__}")
    _check_keys(state_dict, "")
    try:
        flat, mapping = _compat.flatten_state_dict(state_dict)
    except ValueError as exc:
        raise InvalidStateDictError(f"two keys flatten to the same name: {exc}") from exc
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            _check_tensor(key, value)
    return flat, mapping
