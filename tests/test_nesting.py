"""A state dict walked along the nesting of an earlier one (formats/nesting.py) gives the leaves
DCP's flattening gives, or None wherever the nesting differs."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch

from parallel_dcp.formats.nesting import Skeleton, leaves, skeleton
from parallel_dcp.formats.validate import flatten_checked
from tests.test_validate import nestings


def _renewed(sd: Any) -> Any:
    """The same nesting, every container and tensor new (a training loop's next state_dict())."""
    return copy.deepcopy(sd)


@pytest.mark.parametrize("name", list(nestings()))
def test_leaves_are_what_flattening_gives_in_its_order(name: str) -> None:
    sd = nestings()[name]
    shape = skeleton(sd)
    if shape is None:  # a tuple leaf or a key that is not a plain string: flattened each time
        assert name in ("tuples", "str_subclass")
        return
    again = _renewed(sd)
    found = leaves(shape, again)
    assert found is not None
    want = list(flatten_checked(again)[0].values())
    assert len(found) == len(want) and all(a is b for a, b in zip(found, want, strict=True))


def _base() -> dict[str, Any]:
    t = torch.ones(2)
    return {
        "model": {"w": t, "b": torch.zeros(3)},
        "optim": {"state": {"0": {"m": t, "v": t}}, "groups": [{"lr": 0.1, "params": [0, 1]}]},
        "step": 3,
    }


def _rename(sd: dict[str, Any]) -> None:
    sd["model"]["w2"] = sd["model"].pop("w")


def _reorder(sd: dict[str, Any]) -> None:
    sd["model"] = {"b": sd["model"]["b"], "w": sd["model"]["w"]}


def _ordered(sd: dict[str, Any]) -> None:
    sd["model"] = OrderedDict(sd["model"])


def _longer_list(sd: dict[str, Any]) -> None:
    sd["optim"]["groups"].append({"lr": 0.2, "params": [2]})


def _walked_list(sd: dict[str, Any]) -> None:  # a list kept whole now holds a tensor: walked
    sd["optim"]["groups"][0]["params"].append(torch.ones(1))


def _leaf_to_mapping(sd: dict[str, Any]) -> None:
    sd["step"] = {"n": 3}


def _leaf_to_tuple(sd: dict[str, Any]) -> None:
    sd["model"]["w"] = (torch.ones(2),)


def _mapping_to_leaf(sd: dict[str, Any]) -> None:
    sd["optim"]["state"] = 0


@pytest.mark.parametrize(
    "change",
    [_rename, _reorder, _ordered, _longer_list, _walked_list, _leaf_to_mapping, _leaf_to_tuple, _mapping_to_leaf],
)
def test_another_nesting_is_refused(change: Callable[[dict[str, Any]], None]) -> None:
    shape = skeleton(_base())
    assert shape is not None
    changed = _base()
    assert leaves(shape, changed) is not None  # the same nesting: walked
    change(changed)
    assert leaves(shape, changed) is None


def test_new_values_in_the_same_nesting_are_walked() -> None:
    shape = skeleton(_base())
    assert shape is not None
    changed = _base()
    changed["step"], changed["model"]["w"] = 4, torch.full((5,), 2.0)  # a value, a tensor (any shape)
    found = leaves(shape, changed)
    assert found is not None and found[0] is changed["model"]["w"] and found[-1] == 4


def _optimizer() -> dict[str, Any]:
    return {
        "state": {str(i): {"step": torch.tensor(1.0), "exp_avg": torch.ones(i + 1)} for i in range(6)},
        "param_groups": [{"lr": 0.1, "params": list(range(6))}],
    }


def _entry_renamed(sd: dict[str, Any]) -> None:
    sd["state"]["3"] = {"step": torch.tensor(1.0), "exp_avg2": torch.ones(4)}


def _entry_reordered(sd: dict[str, Any]) -> None:
    sd["state"]["3"] = {"exp_avg": torch.ones(4), "step": torch.tensor(1.0)}


def _entry_ordered(sd: dict[str, Any]) -> None:
    sd["state"]["3"] = OrderedDict(sd["state"]["3"])


def _entry_nests(sd: dict[str, Any]) -> None:
    sd["state"]["5"]["exp_avg"] = {"inner": torch.ones(1)}


def _entry_tuple(sd: dict[str, Any]) -> None:
    sd["state"]["0"]["step"] = (torch.ones(1),)


def _entry_walked_list(sd: dict[str, Any]) -> None:
    sd["state"]["2"]["step"] = [torch.ones(1)]


def _entry_not_a_mapping(sd: dict[str, Any]) -> None:
    sd["state"]["4"] = torch.ones(1)


@pytest.mark.parametrize(
    "change",
    [
        _entry_renamed,
        _entry_reordered,
        _entry_ordered,
        _entry_nests,
        _entry_tuple,
        _entry_walked_list,
        _entry_not_a_mapping,
    ],
)
def test_a_mapping_of_like_entries_is_walked_at_once_and_any_entry_that_differs_is_refused(
    change: Callable[[dict[str, Any]], None],
) -> None:
    shape, again = _walked_at_once(_optimizer)
    change(again)
    assert leaves(shape, again) is None


def _walked_at_once(state: Callable[[], dict[str, Any]]) -> tuple[Skeleton, dict[str, Any]]:
    """``state()``'s skeleton, whose first child is walked at once (like entries), and a second
    ``state()`` whose leaves it gives as flattening would, the same objects in the same order."""
    shape = skeleton(state())
    assert shape is not None and shape.children[0] is not None and shape.children[0].uniform is not None
    again = state()
    found = leaves(shape, again)
    want = list(flatten_checked(again)[0].values())
    assert found is not None and len(found) == len(want) and all(a is b for a, b in zip(found, want, strict=True))
    return shape, again


@pytest.mark.parametrize(
    ("kind", "names"),
    [(dict, ("m",)), (dict, ("m", "v", "step")), (OrderedDict, ("m", "v")), (dict, ("m", "v"))],
    ids=["dict-one-key", "dict-three-keys", "ordered-dict", "dict-two-keys"],
)
def test_like_entries_give_their_leaves_in_their_order_whatever_their_type_and_keys(
    kind: type, names: tuple[str, ...]
) -> None:
    def state() -> dict[str, Any]:
        return {
            "state": {str(i): kind((n, torch.full((i + 1,), float(j))) for j, n in enumerate(names)) for i in range(5)}
        }

    shape, again = _walked_at_once(state)
    again["state"]["2"] = kind((n, torch.ones(1)) for n in reversed(names))  # the same keys, reordered
    assert (leaves(shape, again) is None) == (len(names) > 1)
    again = state()
    again["state"]["4"] = kind((n, torch.ones(1)) for n in names[:-1])  # a key fewer
    assert leaves(shape, again) is None
