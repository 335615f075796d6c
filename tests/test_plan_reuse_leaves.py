"""A later save's layout check takes the tensors and values from the leaves by place and makes the
flat dict only where something looks a key up (jobs/plan_reuse.py, RemoteMemorySource.reopened)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

from parallel_dcp.formats.remote_memory_source import RemoteMemorySource
from parallel_dcp.jobs import plan_reuse
from parallel_dcp.jobs.plan_reuse import PlanReuse


@pytest.mark.parametrize(
    "places", [[], [0], [3], [1, 2, 3], [0, 2, 5], [4, 5], list(range(6))], ids=lambda p: "-".join(map(str, p))
)
def test_the_picker_takes_the_items_at_its_places_as_a_list(places: list[int]) -> None:
    items = [object() for _ in range(6)]
    taken = plan_reuse._picker(places)(items)
    assert type(taken) is list and len(taken) == len(places)
    assert all(a is items[i] for a, i in zip(taken, places, strict=True))


def _mixed() -> dict[str, Any]:
    """Tensors and values interleaved, so that the tensors do not lie together among the leaves."""
    return {
        "a": torch.ones(3),
        "lr": 0.1,
        "inner": {"b": torch.zeros(2, 2), "name": "x", "c": torch.arange(4)},
        "d": torch.ones(1),
    }


@pytest.mark.parametrize("state", [_mixed, lambda: {"only": torch.ones(2)}, lambda: {"v": 1, "t": torch.ones(2)}])
def test_a_kept_layout_reopened_gives_this_saves_tensors_and_values_by_key(state: Any) -> None:
    memo = PlanReuse()
    memo.job(state(), "/unused", pending_writes=False)
    later = state()
    job = memo.job(later, "/unused", pending_writes=False)
    assert memo.reused == 1
    source = job.source
    assert isinstance(source, RemoteMemorySource)
    flat = dict(source._flat)
    assert list(flat) == list(job.keys)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    assert set(tensors) == set(source.entries)
    assert set(flat) - set(tensors) == set(source.values)
    for key, value in flat.items():  # this save's objects, each under its own key
        assert value is _at(later, key)
        if key in source.values:
            assert source.values[key] is value


def _at(sd: dict[str, Any], key: str) -> Any:
    node: Any = sd
    for part in key.split("."):
        node = node[part]
    return node


def test_the_flat_dict_is_made_at_its_first_use_and_never_sent() -> None:
    memo = PlanReuse()
    sd = _mixed()
    memo.job(sd, "/unused", pending_writes=False)
    source = memo.job(sd, "/unused", pending_writes=False).source
    assert isinstance(source, RemoteMemorySource)
    assert "_flat" not in vars(source) and "_leaves" in vars(source)
    shell = source.shell()
    assert "_leaves" not in vars(shell) and shell._flat == {}
    state = source.__getstate__()  # what a pickle carries: no leaf
    assert "_leaves" not in state and state["_flat"] == {}
    assert "_leaves" not in vars(pickle.loads(pickle.dumps(source)))
    assert source._flat["a"] is sd["a"] and source._flat["inner.b"] is sd["inner"]["b"]
    assert "_leaves" not in vars(source) and type(vars(source)["_flat"]) is dict
    with pytest.raises(AttributeError, match="no_such"):
        source.no_such  # noqa: B018 (only the flat dict is made on demand)


def test_a_speculation_confirmed_gives_its_source_this_saves_flat_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_reuse.speculative, "SPECULATE", True)
    memo = PlanReuse()
    sd = _mixed()
    memo.job(sd, "/unused", pending_writes=False)
    memo.job(sd, "/unused", pending_writes=False)
    later = _mixed()
    later["a"] = sd["a"]  # where the kept layout's tensors lay: the check passes (steady)
    later["inner"]["b"], later["inner"]["c"], later["d"] = sd["inner"]["b"], sd["inner"]["c"], sd["d"]
    speculation = memo.speculation(later, "/unused", pending_writes=False, layout_unchanged=False, workers=1)
    assert speculation is not None
    speculation.confirm()
    flat = speculation.source._flat
    assert type(flat) is dict and flat["lr"] is later["lr"] and flat["inner.name"] is later["inner"]["name"]
    assert speculation.source.values["inner.name"] is later["inner"]["name"]
