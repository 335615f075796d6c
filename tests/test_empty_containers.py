"""An empty dict in a torch.save file (an optimizer's ``"state": {}`` before its first step): it
was dropped by every route, even a load of the file and a conversion to another torch.save file,
so ``optimizer.load_state_dict`` of the result failed with ``KeyError: 'state'``. It is now kept
where the output can hold it, and dropped (as stock ``dcp.save`` drops it) where it cannot,
without ``verify --against`` or a diff calling that a difference."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import parallel_dcp


def _same(a: Any, b: Any) -> bool:
    """Equal values and nesting (mapping types aside: unflattened levels are plain dicts)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.Adam(model.parameters())


@pytest.fixture
def training_file(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A torch.save file of a model and its optimizer before the first step, with empty dicts at
    the top level, inside a list and as an OrderedDict."""
    model, optimizer = _model_and_optimizer()
    state = {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "extra": {},
        "listed": [{}, torch.ones(2)],
        "ordered": collections.OrderedDict(),
    }
    assert state["optim"]["state"] == {}
    path = tmp_path / "train.pt"
    torch.save(state, path)
    return path, torch.load(path)


def test_a_load_of_the_file_keeps_its_empty_dicts(training_file: tuple[Path, dict[str, Any]]) -> None:
    path, expected = training_file
    loaded = parallel_dcp.load(path)
    assert _same(loaded, expected)
    assert type(loaded["ordered"]) is collections.OrderedDict
    _, optimizer = _model_and_optimizer()
    optimizer.load_state_dict(loaded["optim"])  # KeyError: 'state' before


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_conversion_to_torch_save_keeps_them(
    training_file: tuple[Path, dict[str, Any]], tmp_path: Path, dtype: torch.dtype | None
) -> None:
    path, expected = training_file
    out = tmp_path / "out.pt"
    parallel_dcp.convert(path, out, dtype=dtype)
    written = torch.load(out)
    assert written["optim"]["state"] == {} and written["extra"] == {} and written["listed"][0] == {}
    if dtype is None:
        assert _same(written, expected)
        assert parallel_dcp.verify(out, against=path).ok


def test_a_selection_keeps_only_the_empty_dicts_it_selects(
    training_file: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    path, _ = training_file
    out = tmp_path / "optim.pt"
    parallel_dcp.convert(path, out, keys=["optim.*"])
    assert set(torch.load(out)) == {"optim"} and torch.load(out)["optim"]["state"] == {}


def test_dcp_drops_them_as_stock_does_and_stock_loads_into_a_template_holding_them(
    training_file: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    path, expected = training_file
    out = tmp_path / "dcp"
    parallel_dcp.convert(path, out)
    keys = set(dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata)
    assert not keys & {"optim.state", "extra", "listed.0", "ordered"}
    model, optimizer = _model_and_optimizer()
    template = {"model": model.state_dict(), "optim": optimizer.state_dict(), "extra": {}}
    dcp.load(template, checkpoint_id=str(out))  # stored, "extra" made this fail
    assert torch.equal(template["model"]["weight"], expected["model"]["weight"])
    assert parallel_dcp.verify(out, against=path).ok
    assert parallel_dcp.verify(path, against=out).ok
    assert parallel_dcp.diff(path, out).same


def test_safetensors_takes_a_file_whose_only_other_values_are_empty_dicts(tmp_path: Path) -> None:
    src = tmp_path / "model.pt"
    torch.save({"model": torch.nn.Linear(4, 3).state_dict(), "buffers": {}}, src)
    out = tmp_path / "model.safetensors"
    parallel_dcp.convert(src, out)  # refused as "other values" if the empty dict were selected
    assert parallel_dcp.verify(out, against=src).ok
