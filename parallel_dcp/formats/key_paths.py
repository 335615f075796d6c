"""A torch.save source's mapping keys that are not strings (an optimizer's ``state`` keyed by
parameter index), carried in the paths of its flattened keys so a torch.save output gets them back.

A flattened key's path is DCP's ``planner_data``: a string for a mapping key, an int for a list
index. DCP names every mapping key ``str(key)``, and its ``set_element`` builds a list for an int
level, so the int key 0 of a dict can be neither a plain ``0`` (a list index) nor ``"0"`` (another
key) there. Such a level is a :class:`NonStringKey`; its flattened name is still ``str(key)``, as
DCP's. :func:`nest` rebuilds the nesting with the original keys; a format that names keys by
strings only (DCP, safetensors) refuses a path holding one (jobs/target_keys.py), and
:func:`key_type_difference` tells two paths of one flattened name apart where one holds such a key
and the other does not (``verify --against``, ``inspect --diff``: jobs/key_types.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import chain, pairwise, repeat
from typing import Any

from parallel_dcp import _compat

__all__ = ["NonStringKey", "describe_level", "first_non_string", "key_type_difference", "nest"]


@dataclass(frozen=True, slots=True)
class NonStringKey:
    """A mapping key that is not a string, as the torch.save file holds it; named ``str(key)``."""

    key: Any

    def __str__(self) -> str:
        return str(self.key)


def first_non_string(mapping: Mapping[str, tuple[Any, ...]], keys: Iterable[str]) -> tuple[str, int] | None:
    """The first of ``keys`` whose path passes a :class:`NonStringKey`, and that level's place in
    the path; None where every path is DCP's (strings and list indexes)."""
    keys = list(keys)
    # every level's type in C passes (50,000 keys: a few ms, not a Python step a level)
    if NonStringKey not in set(map(type, chain.from_iterable(map(mapping.get, keys, repeat(()))))):
        return None
    for key in keys:
        for level, part in enumerate(mapping.get(key, ())):
            if type(part) is NonStringKey:
                return key, level
    return None


def describe_level(path: tuple[Any, ...], level: int) -> str:
    """``key 0 (int) under optimizer.state``: the non-string key at ``path[level]``, for a message."""
    key = path[level].key
    holder = ".".join(map(str, path[:level])) or "the top level"
    return f"key {key!r} ({type(key).__name__}) under {holder}"


def key_type_difference(name: str, mine: tuple[Any, ...], theirs: tuple[Any, ...]) -> tuple[str, str, str] | None:
    """How two paths of the flattened ``name`` hold its first level that is a :class:`NonStringKey`
    in one and not the same key of the same type in the other, and where that level lies:
    ``("key 0 (int)", "key '0' (str)", "under optimizer.state")``; None where they agree.

    Levels of strings and list indexes alone are not compared: a format of flat names
    (safetensors) holds ``optimizer.state.0`` as one string, which DCP splits in levels."""
    spans_mine, spans_theirs = _spans(name, mine), _spans(name, theirs)
    differing = [
        (start, end)
        for spans, other in ((spans_mine, spans_theirs), (spans_theirs, spans_mine))
        for start, end, part in spans
        if type(part) is NonStringKey and not _same_key(part, _level_at(other, start, end))
    ]
    if not differing:
        return None
    start, end = min(differing)
    holder = f"under {name[: start - 1]}" if start else "at the top level"
    return _held(name, spans_mine, start, end), _held(name, spans_theirs, start, end), holder


def _spans(name: str, path: tuple[Any, ...]) -> list[tuple[int, int, Any]]:
    """Each level of ``path`` with the characters of ``name`` it names (a path that does not
    spell ``name``, as no source gives one: the name as one string)."""
    if ".".join(map(str, path)) != name:
        path = (name,)
    spans, at = [], 0
    for part in path:
        spans.append((at, at + len(str(part)), part))
        at += len(str(part)) + 1
    return spans


def _level_at(spans: list[tuple[int, int, Any]], start: int, end: int) -> Any:
    return next((part for s, e, part in spans if (s, e) == (start, end)), None)


def _same_key(key: NonStringKey, other: Any) -> bool:
    return type(other) is NonStringKey and type(other.key) is type(key.key) and other.key == key.key


def _held(name: str, spans: list[tuple[int, int, Any]], start: int, end: int) -> str:
    """What a path holds at characters ``start:end`` of ``name``, in words."""
    part = _level_at(spans, start, end)
    if type(part) is NonStringKey:
        return f"key {part.key!r} ({type(part.key).__name__})"
    if type(part) is int:
        return f"list index {part}"
    if part is not None:
        return f"key {str(part)!r} (str)"
    within = next((str(p) for s, e, p in spans if start < e), name)  # (the level it falls in)
    return f"{name[start:end]!r} inside the string key {within!r}"


def nest(flat: dict[str, Any], mapping: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """``flat`` nested again by ``mapping``, each :class:`NonStringKey` level by its own key (as
    torch.load gave it); DCP's ``unflatten_state_dict`` where no path holds one."""
    if first_non_string(mapping, flat) is None:
        return _compat.unflatten_state_dict(flat, mapping)
    root: dict[Any, Any] = {}
    for name, value in flat.items():
        _set(root, mapping[name], value)
    return root


def _set(root: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    """DCP's ``set_element`` (an int level is a list index; anything else a mapping key), with a
    :class:`NonStringKey` level set by its key."""
    node: Any = root
    for level, following in pairwise(path):
        fresh: Any = [] if type(following) is int else {}
        if isinstance(node, list):
            node.extend([None] * (level + 1 - len(node)))
            if node[level] is None:
                node[level] = fresh
            node = node[level]
        else:
            node = node.setdefault(_key(level), fresh)
    last = path[-1]
    if type(last) is int:
        node.extend([None] * (last + 1 - len(node)))
    node[_key(last)] = value


def _key(level: Any) -> Any:
    return level.key if type(level) is NonStringKey else level
