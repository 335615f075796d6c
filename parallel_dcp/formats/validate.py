"""Checks that run before anything is written, so bad input fails with a clear message."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from parallel_dcp.errors import InvalidStateDictError
from parallel_dcp.formats.key_paths import NonStringKey

__all__ = ["check_tensor", "empty_mapping", "flatten_checked", "flatten_structure", "terminal_list"]


def _check_keys(value: Any, path: str) -> None:
    if isinstance(value, Mapping):
        for key, inner in value.items():
            if not isinstance(key, str):
                raise InvalidStateDictError(
                    f"key {key!r} ({type(key).__name__}) under {path or 'the top level'} is not a string. DCP "
                    f"names it {str(key)!r}, so a load without a template returns the string (stock's "
                    "dcp_to_torch_save too), and an optimizer's load_state_dict then silently drops the state "
                    "kept under it; save string keys (for an optimizer: torch.distributed.checkpoint.state_dict."
                    "get_optimizer_state_dict gives them by parameter name)"
                )
            _check_keys(inner, f"{path}.{key}" if path else key)
    elif isinstance(value, (list, tuple)):
        for i, inner in enumerate(value):
            _check_keys(inner, f"{path}.{i}")


def check_tensor(key: str, tensor: torch.Tensor) -> None:
    """Raise InvalidStateDictError, naming ``key``, for a tensor that cannot be saved faithfully."""
    problem = None
    if tensor.is_nested:
        problem = "is a nested tensor (no single shape); save its unbind() pieces as keys of their own"
    elif tensor.is_meta or tensor.device.type == "meta":
        problem = "is a meta tensor (it has no data)"
    elif tensor.layout != torch.strided:
        problem = f"has layout {tensor.layout}; only dense (strided) tensors can be saved, call .to_dense() first"
    elif tensor.is_quantized:
        problem = "is quantized; dequantize it or save its int_repr() and scales"
    elif tensor.device.type != "cpu":
        problem = f"is on {tensor.device}; move the state dict to the CPU first (parallel_dcp writes from CPU memory)"
    if problem:
        raise InvalidStateDictError(f"tensor {key!r} {problem}")


_SCALARS = frozenset({type(None), bool, int, float, complex, str, bytes})


def empty_mapping(value: Any) -> bool:
    """Whether ``value`` is an empty mapping: a value of its own where a flattening keeps it
    (``keep_empty``), which only torch.save files hold (DCP drops it, safetensors holds tensors)."""
    return isinstance(value, Mapping) and not value


def terminal_list(value: list[Any]) -> bool:
    """DCP's rule for a list: kept whole (one value) unless it holds a tensor, a mapping, or a
    list that is not kept whole itself."""
    if set(map(type, value)) <= _SCALARS:  # plain scalars (25,000 param ids): one C pass
        return True
    for entry in value:
        if isinstance(entry, (Mapping, torch.Tensor)) or (isinstance(entry, list) and not terminal_list(entry)):
            return False
    return True


def flatten_structure(
    state_dict: Mapping[Any, Any], *, tensor_paths: bool = True, any_keys: bool = False
) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """As :func:`flatten_checked`, without the tensor checks (meta tensors that only describe
    where a file's tensors lie); ``tensor_paths=False``: the mapping holds the paths of the
    values that are not tensors alone (a caller that fills its tensors in place, never sets them)."""
    return _flatten(state_dict, tensor_paths, any_keys=any_keys)


def _flatten(
    state_dict: Mapping[Any, Any], tensor_paths: bool = True, keep_empty: bool = False, any_keys: bool = False
) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """DCP's ``flatten_state_dict`` (``_traverse.traverse_state_dict``'s rules: mappings walked,
    lists walked when not kept whole, tuples and everything else kept whole), in one pass with
    the key checks folded in: it runs once per key of a 50,000-key state dict before any worker
    starts. ``tests/test_validate.py`` checks it against DCP's own on many shapes of nesting.

    DCP drops an empty mapping below the top level (an optimizer's ``"state": {}`` before its
    first step). ``keep_empty`` keeps it as a value of its own instead, for a torch.save file
    read as a source: torch.load returns it, so a load or a conversion to torch.save must too.
    (Not in DCP: stored there, it would make stock ``dcp.load`` take a checkpoint for its
    pre-2.4 layout when the template holds the same empty mapping, and fail.)

    ``any_keys``: a mapping key that is not a string (an optimizer's parameter index) is named
    ``str(key)``, as DCP names it, and kept in its path as a :class:`NonStringKey`, for a
    torch.save file read as a source: what each output does with it is the output's to say
    (formats/key_paths.py). A tuple, kept whole, is then not looked into either.

    Raises:
        InvalidStateDictError: a non-string key (unless ``any_keys``), or two keys flattening to one name.
    """
    walk = _Walk(tensor_paths, keep_empty, any_keys)
    walk.walk((), "", state_dict)
    return walk.flat, walk.mapping


class _Walk:
    """One flattening (see _flatten). Methods, not nested functions: nested functions that call
    each other hold each other through their cells, a cycle that keeps ``flat`` and ``mapping``
    (a tuple per key) alive until a garbage collection walks them all."""

    __slots__ = ("any_keys", "flat", "keep_empty", "mapping", "tensor_paths")

    def __init__(self, tensor_paths: bool, keep_empty: bool, any_keys: bool) -> None:
        self.flat: dict[str, Any] = {}
        self.mapping: dict[str, tuple[Any, ...]] = {}
        self.tensor_paths = tensor_paths
        self.keep_empty = keep_empty
        self.any_keys = any_keys

    def leaf(self, path: tuple[Any, ...], name: str, value: Any) -> None:
        if isinstance(value, tuple) and not self.any_keys:
            _check_keys(value, name)  # kept whole, but a mapping inside still needs string keys
        if name in self.flat:
            raise InvalidStateDictError(f"two keys flatten to the same name: duplicated flatten key {name}")
        self.flat[name] = value
        if self.tensor_paths or not isinstance(value, torch.Tensor):
            self.mapping[name] = path

    def walk_list(self, path: tuple[Any, ...], name: str, value: list[Any]) -> None:
        for i, entry in enumerate(value):
            inner, at = (*path, i), f"{name}.{i}"
            if isinstance(entry, Mapping) and (entry or not self.keep_empty):
                self.walk(inner, f"{at}.", entry)
            elif isinstance(entry, list) and not terminal_list(entry):
                self.walk_list(inner, at, entry)
            else:
                self.leaf(inner, at, entry)

    def walk(self, path: tuple[Any, ...], prefix: str, node: Mapping[Any, Any]) -> None:
        flat, mapping, tensor_paths = self.flat, self.mapping, self.tensor_paths
        tensor = torch.Tensor
        for key, value in node.items():  # depth first, in insertion order, as DCP's traversal
            level = key  # (the key in the path)
            if type(key) is not str:
                if self.any_keys and not isinstance(key, str):
                    level = NonStringKey(key)  # named as DCP names it; its path keeps the key itself
                else:
                    _check_keys(node, prefix[:-1])  # raises, naming the key, unless a str subclass
                    level = str(key)  # what DCP's traversal does with it
                key = str(key)
            name = prefix + key
            if isinstance(value, tensor):  # the common leaf, before the slower Mapping check
                if name in flat:
                    raise InvalidStateDictError(f"two keys flatten to the same name: duplicated flatten key {name}")
                flat[name] = value
                if tensor_paths:
                    mapping[name] = (*path, level)
            elif type(value) is dict or isinstance(value, Mapping):  # a plain dict before the ABC check
                if value or not self.keep_empty:
                    self.walk((*path, level), f"{name}.", value)
                else:
                    self.leaf((*path, level), name, value)
            elif isinstance(value, list) and not terminal_list(value):
                self.walk_list((*path, level), name, value)
            else:
                self.leaf((*path, level), name, value)


def flatten_checked(
    state_dict: Any, *, check_tensors: bool = True, keep_empty: bool = False, any_keys: bool = False
) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """Flatten ``state_dict`` the way DCP does, refusing input that cannot be saved faithfully
    (``check_tensors=False``: every check but :func:`check_tensor`, for a caller that runs it in
    its own pass over the keys; ``keep_empty``, ``any_keys``: empty mappings kept as values,
    keys that are not strings kept in the paths, see :func:`_flatten`).

    Returns:
        ``(flat, mapping)``: flattened keys to values, and each key's path in the original
        nesting (what DCP stores as ``planner_data``).

    Raises:
        InvalidStateDictError: not a mapping, a non-string key (unless ``any_keys``), two keys
            that flatten to the same name, or a tensor that is meta, sparse, quantized or not on the CPU.
    """
    if not isinstance(state_dict, Mapping):
        raise InvalidStateDictError(f"a state dict must be a mapping, got {type(state_dict).__name__}")
    flat, mapping = _flatten(state_dict, keep_empty=keep_empty, any_keys=any_keys)
    if not check_tensors:
        return flat, mapping
    strided = torch.strided
    for key, value in flat.items():
        # The common case in three attribute reads; anything else gets the full check and its message.
        plain = isinstance(value, torch.Tensor) and value.is_cpu and value.layout == strided
        if isinstance(value, torch.Tensor) and not (plain and not value.is_quantized):
            check_tensor(key, value)
    return flat, mapping
