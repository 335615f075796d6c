"""Keys of two checkpoints that name a level alike but hold it as keys of other types, for
``verify --against`` and ``inspect --diff``.

An optimizer's ``state_dict()`` keys its state by parameter index (ints); a torch.save file keeps
them, and its source keeps them in its paths (formats/key_paths.py). The same state keyed ``"0"``
(what stock ``dcp_to_torch_save`` gives back for a DCP saved from it) flattens to the same names
and the same tensors, but ``Adam.load_state_dict`` fills its parameters from the one and not the
other: a comparison by names and bytes alone calls them the same.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from parallel_dcp.formats.base import Source
from parallel_dcp.formats.key_paths import NonStringKey, first_non_string, key_type_difference

__all__ = ["key_type_changes", "why_key_types_matter"]


def key_type_changes(a: Source, b: Source, keys: Iterable[str]) -> dict[str, tuple[str, str, str]]:
    """Each of ``keys`` (in both) whose path passes a key that is not a string in one of ``a`` and
    ``b`` and not the same key in the other: (how ``a`` holds that level, how ``b`` does, where
    it lies), ``("key 0 (int)", "key '0' (str)", "under optimizer.state")``."""
    keys = list(keys)
    if first_non_string(a.mapping, keys) is None and first_non_string(b.mapping, keys) is None:
        return {}  # (the common case, checked in C: no level of either is such a key)
    changes = {}
    for key in keys:
        mine, theirs = a.mapping.get(key, (key,)), b.mapping.get(key, (key,))
        if mine == theirs and list(map(type, mine)) == list(map(type, theirs)) and _same_key_types(mine, theirs):
            continue  # (the same path: a torch.save copy of a torch.save file)
        if (found := key_type_difference(key, mine, theirs)) is not None:
            changes[key] = found
    return changes


def _same_key_types(mine: tuple[Any, ...], theirs: tuple[Any, ...]) -> bool:
    """Whether equal paths hold keys of the same types too (``1 == True``)."""
    return all(type(x.key) is type(y.key) for x, y in zip(mine, theirs) if type(x) is NonStringKey)


def why_key_types_matter(kinds: Iterable[str]) -> str:
    """Why a key's type is a difference, for checkpoints of the formats ``kinds``."""
    said = (
        "torch.load gives each key as the file holds it, and an optimizer's load_state_dict finds a "
        "parameter's state under its int index only: state keyed '0' is kept apart, and the parameter "
        "resumes with fresh state"
    )
    if "dcp" in set(kinds):
        said += (
            "; DCP names keys by strings only (stock torch.distributed.checkpoint.save stores the int key 0 "
            "as '0'): a load without a template, dcp_to_torch_save too, gives the string, and only a load "
            "into a template that holds the int keys fills them"
        )
    return said
