"""load(into=) of many small records plans them in one pass over the metadata's columns
(jobs/load.py ``_small_targets``): every target that is not a plain dense CPU tensor of the stored
dtype and shape takes the general path, with the same checks and messages as before; the bytes
are stock dcp.load's; the progress bar counts every tensor; nothing is left for the garbage
collector."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

import parallel_dcp
from parallel_dcp import InvalidStateDictError, KeyNotFoundError
from parallel_dcp.engine import progress
from tests.conftest import assert_same, empty_like_state
from tests.test_small_records import COUNT, optimizer_like, stock_load, write


@pytest.fixture(params=["stock", "pdcp"])
def written(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    sd = optimizer_like()
    write(request.param, sd, tmp_path / "ckpt")
    return tmp_path / "ckpt", sd, stock_load(sd, tmp_path / "ckpt")


def test_targets_of_every_kind_are_filled_with_stocks_bytes(written: tuple[Path, dict[str, Any], Any]) -> None:
    path, sd, expected = written
    into = empty_like_state(sd)
    state = into["optimizer"]["state"]
    # a Parameter (not a plain tensor), a non-contiguous (4, 8), a view that is plain and dense
    state["0"]["exp_avg"] = torch.nn.Parameter(torch.empty(16, dtype=torch.bfloat16), requires_grad=False)
    state["1"]["exp_avg"] = torch.empty(8, 4).t()
    state["2"]["exp_avg"] = torch.empty(33)[:33]
    stats = parallel_dcp.ReadStats()
    assert parallel_dcp.load(path, into=into, workers=2, stats=stats) is into
    assert_same(into, expected)
    assert isinstance(state["0"]["exp_avg"], torch.nn.Parameter)
    assert stats.fast == 2 * COUNT and stats.fallback == 0


def test_a_subset_of_into_by_pattern_fills_those_keys_alone(written: tuple[Path, dict[str, Any], Any]) -> None:
    path, sd, expected = written
    into = {
        "optimizer": {
            "state": {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in sd["optimizer"]["state"].items()}
        }
    }
    parallel_dcp.load(path, into=into, keys="optimizer.state.1*.exp_avg", workers=2)
    for key, value in into["optimizer"]["state"].items():
        for name, tensor in value.items():
            if key.startswith("1") and name == "exp_avg":
                assert_same(tensor, expected["optimizer"]["state"][key][name])
            else:
                assert not tensor.any()  # left as it was


def test_a_missing_key_then_each_mismatch_is_refused_before_any_read(
    written: tuple[Path, dict[str, Any], Any],
) -> None:
    path, sd, _ = written
    into = {
        "optimizer": {
            "state": {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in sd["optimizer"]["state"].items()}
        }
    }
    state = into["optimizer"]["state"]
    state["5"]["exp_avg"] = torch.zeros(3)
    state["9999"] = {"exp_avg": torch.zeros(16)}
    with pytest.raises(KeyNotFoundError, match=r"optimizer\.state\.9999\.exp_avg"):
        parallel_dcp.load(path, into=into, workers=2)
    del state["9999"]
    with pytest.raises(InvalidStateDictError, match=r"into\['optimizer\.state\.5\.exp_avg'\] has shape \[3\]"):
        parallel_dcp.load(path, into=into, workers=2)
    state["5"]["exp_avg"] = torch.zeros(4, 8, dtype=torch.float64)
    with pytest.raises(InvalidStateDictError, match=r"state\.5\.exp_avg'\] has dtype float64"):
        parallel_dcp.load(path, into=into, workers=2)
    state["5"]["exp_avg"] = torch.empty(4, 8, device="meta")
    with pytest.raises(InvalidStateDictError, match="meta device"):
        parallel_dcp.load(path, into=into, workers=2)
    state["5"]["exp_avg"] = torch.zeros(1).expand(4, 8)
    with pytest.raises(InvalidStateDictError, match="share memory"):
        parallel_dcp.load(path, into=into, workers=2)
    state["5"]["exp_avg"] = [1.0]
    with pytest.raises(InvalidStateDictError, match="is a list"):
        parallel_dcp.load(path, into=into, workers=2)
    assert not any(t.any() for v in state.values() for t in v.values() if isinstance(t, torch.Tensor))


def test_the_progress_bar_counts_the_small_records_bytes(
    written: tuple[Path, dict[str, Any], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, sd, expected = written
    totals = []
    real = progress.Progress

    def counted(*args: Any, **kwargs: Any) -> Any:
        totals.append(kwargs["total"])
        return real(*args, **kwargs)

    monkeypatch.setattr(progress, "Progress", counted)
    into = empty_like_state(sd)
    parallel_dcp.load(path, into=into, workers=2, progress=True)
    assert_same(into, expected)
    assert totals == [sum(t.nbytes for v in sd["optimizer"]["state"].values() for t in v.values())]


def test_a_load_into_leaves_no_garbage_in_cycles(written: tuple[Path, dict[str, Any], Any]) -> None:
    """Nothing the load made is left for a garbage collection (the flattening of ``into`` left a
    tuple a key in a cycle: one collection over all of them, right after the load)."""
    path, sd, expected = written
    into = empty_like_state(sd)
    parallel_dcp.load(path, into=into, workers=2)  # imports, caches: once
    enabled = gc.isenabled()
    gc.disable()
    found = []
    try:
        # the fewest of three loads: an earlier test's threads (s3fs's event loop letting go of its
        # botocore clients: ~35,000 objects) may leave garbage meanwhile; the load's own is in each
        for _ in range(3):
            gc.collect()
            parallel_dcp.load(path, into=into, workers=2)
            found.append(gc.collect())
        assert min(found) < 20, found  # (was 2 * COUNT and more)
    finally:
        if enabled:
            gc.enable()
    assert_same(into, expected)


def test_a_tensor_of_into_that_the_checkpoint_holds_as_a_value_is_replaced_by_it(tmp_path: Path) -> None:
    """(into's paths are kept for its values alone: a tensor in a value's place still finds its path)"""
    sd = {"m": {"w": torch.arange(6.0), "step": 7, "names": ["a"]}}
    parallel_dcp.save(sd, tmp_path / "ckpt", workers=2)
    into = {"m": {"w": torch.zeros(6), "step": torch.zeros(()), "names": None}}
    assert parallel_dcp.load(tmp_path / "ckpt", into=into, workers=2) is into
    assert into["m"]["step"] == 7 and type(into["m"]["step"]) is int and into["m"]["names"] == ["a"]
    assert torch.equal(into["m"]["w"], sd["m"]["w"])
