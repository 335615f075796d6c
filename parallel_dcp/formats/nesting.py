"""A state dict's nesting as DCP flattens it, kept to flatten the next state dict of that nesting fast.

DCP's rules (formats/validate.py, ``_flatten``): mappings are walked, a list is walked unless it is
kept whole (``terminal_list``), everything else is a leaf. :func:`skeleton` records which containers
a state dict walks (their types and keys, in order); :func:`leaves` walks a later state dict along
it and returns its leaves in DCP's order, or None where anything differs (a key, a container's type
or length, a leaf that would now be walked). Where nothing differs, DCP would flatten the later one
to the same names and paths, so the caller keeps those and takes only the leaves.

Cheaper than flattening because a container holding only leaves (an optimizer's per-parameter
state, a flat model state dict) is taken in one C call, not one Python step per key: 50,000 keys of
optimizer state, 0.8-1.4 us a key flattened, a fraction of that here. A mapping whose entries are
all such containers of one type and keys (an optimizer's ``state``: one ``{"exp_avg", "exp_avg_sq"}``
per parameter) is walked in a few C passes over all its entries at once (``uniform``), not one
Python step per entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain
from operator import countOf, itemgetter, methodcaller
from typing import Any

import torch

from parallel_dcp.formats.validate import terminal_list

__all__ = ["Skeleton", "leaves", "skeleton"]


@dataclass(frozen=True, slots=True)
class Skeleton:
    """One walked container: its exact type, its keys (a list: its length), and per entry its own
    skeleton (None: a leaf); ``flat``: every entry a leaf."""

    kind: type
    keys: tuple[str, ...] | int
    children: tuple[Skeleton | None, ...]
    flat: bool
    # Every entry the same flat mapping skeleton (at least two of them): that skeleton.
    uniform: Skeleton | None = None


def skeleton(state_dict: Any) -> Skeleton | None:
    """The containers DCP walks in ``state_dict``, which flattened without error; None where a key
    is not a plain string or a leaf is a tuple (DCP checks inside it): the next one is flattened."""
    if not isinstance(state_dict, Mapping):
        return None
    return _mapping(state_dict)


def _mapping(node: Mapping[Any, Any]) -> Skeleton | None:
    keys = tuple(node)
    if set(map(type, keys)) - {str}:
        return None
    return _node(type(node), keys, node.values())


def _node(kind: type, keys: tuple[str, ...] | int, values: Any) -> Skeleton | None:
    children: list[Skeleton | None] = []
    for value in values:
        child: Skeleton | None = None
        if isinstance(value, Mapping):
            child = _mapping(value)
        elif isinstance(value, list) and not terminal_list(value):
            child = _node(list, len(value), value)
        elif isinstance(value, tuple):
            return None
        else:
            children.append(None)
            continue
        if child is None:
            return None
        children.append(child)
    first = children[0] if len(children) > 1 else None
    uniform = None
    if first is not None and first.flat and first.kind is not list and children.count(first) == len(children):
        uniform = first
    return Skeleton(kind, keys, tuple(children), all(child is None for child in children), uniform)


def leaves(shape: Skeleton, state_dict: Any) -> list[Any] | None:
    """``state_dict``'s leaves in DCP's order, where it nests as ``shape`` says; else None."""
    found: list[Any] = []
    return found if _walk(shape, state_dict, found) else None


def _walk(shape: Skeleton, container: Any, found: list[Any]) -> bool:
    if type(container) is not shape.kind:
        return False
    node: Any = container  # (a type check above narrows it to object)
    if shape.kind is list:
        if len(node) != shape.keys:
            return False
        values = node
    else:
        if tuple(node) != shape.keys:
            return False
        values = node.values()
    if shape.flat:
        start = len(found)
        found.extend(values)
        taken = found[start:]
        return set(map(type, taken)) <= _LEAF_TYPES or all(map(_leaf, taken))
    if shape.uniform is not None:
        return _walk_uniform(shape.uniform, list(values), found)
    for child, value in zip(shape.children, values, strict=True):
        if child is None:
            if not _leaf(value):
                return False
            found.append(value)
        elif not _walk(child, value, found):
            return False
    return True


def _walk_uniform(entry: Skeleton, containers: list[Any], found: list[Any]) -> bool:
    """``containers``, each of ``entry``'s exact type and keys in order, holding only leaves: their
    leaves in order (what walking each would give), in a few C passes over all of them."""
    if set(map(type, containers)) != {entry.kind} or countOf(map(tuple, containers), entry.keys) != len(containers):
        return False
    keys = entry.keys
    assert isinstance(keys, tuple)  # (uniform: mappings only)
    if entry.kind is dict and len(keys) > 1:
        # Each holds exactly these keys in this order (above): taken by key in one C call per
        # container, which costs less than a values view made and iterated per container.
        taken = list(chain.from_iterable(map(itemgetter(*keys), containers)))
    else:
        taken = list(chain.from_iterable(map(_values, containers)))
    found += taken
    return set(map(type, taken)) <= _LEAF_TYPES or all(map(_leaf, taken))


def _leaf(value: Any) -> bool:
    """Whether DCP keeps ``value`` whole without looking inside (else it is not the same nesting)."""
    return not (isinstance(value, (Mapping, tuple)) or (isinstance(value, list) and not terminal_list(value)))


_values = methodcaller("values")
# Leaves of these types need no further look (one C pass over a container's types).
_LEAF_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, type(None), bool, int, float, complex, str, bytes})
