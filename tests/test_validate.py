"""The one-pass flattening (formats/validate.py) gives exactly what DCP's flatten_state_dict gives."""

from __future__ import annotations

import gc
from collections import OrderedDict
from typing import Any

import pytest
import torch

from parallel_dcp import _compat
from parallel_dcp.errors import InvalidStateDictError
from parallel_dcp.formats.validate import flatten_checked, flatten_structure
from tests.test_roundtrip import nested_state, odd_shapes


class Key(str):
    def __str__(self) -> str:
        return "renamed"


def nestings() -> dict[str, Any]:
    t = torch.ones(2)
    return {
        "nested": nested_state(),
        "odd": odd_shapes(),
        "empty": {},
        "empty_inner": {"a": {}, "b": {"c": {}}, "d": 1},
        "order": {"z": {"y": 1, "x": {"w": t}}, "a": 2, "m": {"n": t}},
        "plain_lists": {"ints": [1, 2, 3], "nested_ints": [[1, 2], [3]], "empty": [], "strs": ["a", "b"]},
        "tensor_lists": {"l": [t, 1, "x", None], "deep": [[t], [1, 2]], "mixed": [[1], [[t]]]},
        "mapping_in_list": {"groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.2, "params": [2]}]},
        "tuples": {"tup": (t, 1), "tup_of_dict": ({"a": t},), "list_of_tuples": [(1, 2), (t,)]},
        "ordered": OrderedDict([("b", t), ("a", OrderedDict([("c", 3)]))]),
        "str_subclass": {Key("k"): t},
        "dotted": {"a.b": 1, "c": {"d.e": t}},
        "none_and_objects": {"n": None, "s": "text", "f": 1.5, "b": b"bytes", "set": {1, 2}},
        "list_top": {"x": [{"a": t}, [t, [t]]]},
    }


@pytest.mark.parametrize("name", list(nestings()))
def test_flatten_equals_dcp(name: str) -> None:
    sd = nestings()[name]
    flat, mapping = flatten_checked(sd)
    want_flat, want_mapping = _compat.flatten_state_dict(sd)
    assert list(flat) == list(want_flat)  # same keys, same order
    assert all(flat[k] is want_flat[k] for k in flat)
    assert mapping == want_mapping
    assert all(type(p) is type(q) for k in mapping for p, q in zip(mapping[k], want_mapping[k], strict=True))


@pytest.mark.parametrize(
    "sd",
    [
        {"a": {1: torch.ones(1)}},
        {"a": [{"b": {2: 1}}]},
        {"t": ({3: 1},)},
        {"a": [[{(1, 2): 3}]]},
    ],
)
def test_non_string_keys_anywhere_are_refused(sd: dict[str, Any]) -> None:
    with pytest.raises(InvalidStateDictError, match="is not a string"):
        flatten_checked(sd)


@pytest.mark.parametrize("sd", [{"a.b": 1, "a": {"b": 2}}, {"a": {"b": 2}, "a.b": 1}, {"x": [1, {"y": 2}], "x.1.y": 3}])
def test_two_keys_flattening_to_one_name_are_refused(sd: dict[str, Any]) -> None:
    with pytest.raises(InvalidStateDictError, match="flatten to the same name"):
        flatten_checked(sd)
    with pytest.raises(ValueError, match="duplicated flatten key"):
        _compat.flatten_state_dict(sd)  # DCP refuses them too


@pytest.mark.parametrize("name", list(nestings()))
def test_flatten_without_tensor_paths_keeps_the_paths_of_the_other_values(name: str) -> None:
    """For a caller that fills its tensors in place (load into=): the same flat dict, and the
    paths of the values that are not tensors alone."""
    sd = nestings()[name]
    want_flat, want_mapping = _compat.flatten_state_dict(sd)
    flat, mapping = flatten_structure(sd, tensor_paths=False)
    assert list(flat) == list(want_flat) and all(flat[k] is want_flat[k] for k in flat)
    assert mapping == {k: p for k, p in want_mapping.items() if not isinstance(want_flat[k], torch.Tensor)}


def test_flatten_leaves_no_garbage_in_cycles() -> None:
    """Flattening 2,000 keys makes nothing only a garbage collection frees (nested functions calling
    each other held both dicts, a tuple a key, until one walked them: within a load, with the
    collector paused, one collection over all of them after it)."""
    sd = {"state": {str(i): {"exp_avg": torch.ones(1), "exp_avg_sq": torch.ones(1), "step": i} for i in range(1000)}}
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        for tensor_paths in (True, False):
            flat, mapping = flatten_structure(sd, tensor_paths=tensor_paths)
            assert len(flat) == 3000
            del flat, mapping
            assert gc.collect() == 0
    finally:
        if enabled:
            gc.enable()
