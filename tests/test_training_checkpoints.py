"""The usual torch.save training checkpoint, ``{"model": sd, "optimizer": opt.state_dict(),
"epoch": 3}``, whose optimizer state is keyed by int parameter indexes.

Every conversion of one was refused with a DCP-worded message, whatever the target and whatever
``--keys`` selected (the whole file was checked for DCP's string keys as it was opened). Now
``--keys`` and ``--rename`` select first; one torch.save file keeps the int keys as torch.load gives
them; DCP, safetensors and a sharded torch.save directory refuse them, before any write, naming
the file's own keys and the selection that leaves them out. Outputs are read back with
``torch.load``, ``safetensors.torch.load_file`` and stock ``dcp_to_torch_save``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import parallel_dcp
from parallel_dcp.errors import InvalidStateDictError
from tests.cli_in_process import run_in_process
from tests.conftest import assert_same


def _training_checkpoint(path: Path) -> dict[str, Any]:
    """A Linear layer and its AdamW state after one step, saved as trainers save them; what
    torch.load gives back."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3}, path)
    loaded: dict[str, Any] = torch.load(path)
    return loaded


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt.pt"
    _training_checkpoint(path)
    return path


def _same_order(actual: Any, expected: Any) -> None:
    """Every mapping's keys in the same order and of the same types (assert_same compares key sets)."""
    if isinstance(expected, dict):
        assert [(type(k), k) for k in actual] == [(type(k), k) for k in expected]
        for k in expected:
            _same_order(actual[k], expected[k])


def test_cli_torch_save_to_torch_save_keeps_the_int_keys(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_in_process(capsys, "convert", ckpt, tmp_path / "out.pt", "--workers", "1", "-q")
    source, out = torch.load(ckpt), torch.load(tmp_path / "out.pt")
    assert_same(out, source)
    _same_order(out, source)
    assert list(out["optimizer"]["state"]) == [0, 1]
    # the state goes back onto its parameters (string keys would be kept apart, silently)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.load_state_dict(out["optimizer"])
    assert all(p in optimizer.state for p in model.parameters())
    assert torch.equal(optimizer.state[model.weight]["exp_avg"], source["optimizer"]["state"][0]["exp_avg"])


def test_cli_keys_model_to_safetensors(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model.safetensors"
    run_in_process(capsys, "convert", ckpt, out, "--keys", "model.*", "--workers", "1", "-q")
    model = torch.load(ckpt)["model"]
    assert_same(load_file(out), {f"model.{k}": v for k, v in model.items()})


def test_cli_keys_model_to_torch_save(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model_only.pt"
    run_in_process(capsys, "convert", ckpt, out, "--keys", "model.*", "--workers", "1", "-q")
    assert_same(torch.load(out), {"model": torch.load(ckpt)["model"]})


def test_cli_to_dcp_is_refused_naming_the_file_and_the_selection_that_converts(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run_in_process(capsys, "convert", ckpt, tmp_path / "dcp", "--workers", "1", check_code=1)
    message = " ".join(result.stderr.split())
    assert f"{ckpt} holds key 0 (int) under optimizer.state" in message
    assert "dcp_to_torch_save too) gives back the string '0'" in message  # what stock DCP does with it
    assert "--keys 'model.*' --keys 'epoch'" in message and "one torch.save file (.pt)" in message
    assert "get_optimizer_state_dict" not in message  # (advice to re-save: the user converts a file)
    assert not (tmp_path / "dcp").exists()
    # the selection it names converts, and stock DCP reads it back
    run_in_process(capsys, "convert", ckpt, tmp_path / "dcp", "--keys", "model.*", "--keys", "epoch", "-q")
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "back.pt")
    source = torch.load(ckpt)
    assert_same(torch.load(tmp_path / "back.pt"), {"model": source["model"], "epoch": 3})


@pytest.mark.parametrize(
    ("dst", "options", "said"),
    [
        pytest.param("all.safetensors", {}, "keys='model.*'", id="safetensors-everything"),
        pytest.param("opt.safetensors", {"keys": "optimizer.state.*"}, "Rename those levels", id="safetensors-state"),
        pytest.param("sharded", {"to": "torch"}, "A sharded torch.save directory", id="sharded-torch"),
        pytest.param("dcp", {"keys": ["optimizer.*"]}, "Rename those levels", id="dcp-optimizer"),
    ],
)
def test_api_outputs_of_string_names_refuse_the_int_keys_before_writing(
    ckpt: Path, tmp_path: Path, dst: str, options: dict[str, Any], said: str
) -> None:
    with pytest.raises(InvalidStateDictError, match=r"holds key 0 \(int\) under optimizer\.state") as caught:
        parallel_dcp.convert(ckpt, tmp_path / dst, workers=1, **options)
    assert said in str(caught.value)
    assert not (tmp_path / dst).exists()


def test_api_converts_what_the_selection_or_the_target_can_hold(ckpt: Path, tmp_path: Path) -> None:
    source = torch.load(ckpt)
    parallel_dcp.convert(ckpt, tmp_path / "out.pt", workers=1)
    assert_same(torch.load(tmp_path / "out.pt"), source)
    parallel_dcp.convert(ckpt, tmp_path / "opt.pt", keys="optimizer.*", workers=1)
    out = torch.load(tmp_path / "opt.pt")
    assert_same(out, {"optimizer": source["optimizer"]})
    _same_order(out, {"optimizer": source["optimizer"]})
    parallel_dcp.convert(ckpt, tmp_path / "model.safetensors", keys="model.*", workers=1)
    assert_same(load_file(tmp_path / "model.safetensors"), {f"model.{k}": v for k, v in source["model"].items()})
    # renamed to names of strings only (flat: a rename keeps only the levels the new name starts
    # with), the state is DCP's to hold, and stock dcp_to_torch_save reads it back
    parallel_dcp.convert(
        ckpt, tmp_path / "dcp", keys="optimizer.state.*", rename=[(r"optimizer\.state\.(\d+)\.(.*)", r"state.p\1.\2")]
    )
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt")
    expected = {f"state.p{i}.{k}": v for i, state in source["optimizer"]["state"].items() for k, v in state.items()}
    assert_same(back, expected)


def test_a_rename_keeping_the_int_level_keeps_it_in_torch_save(ckpt: Path, tmp_path: Path) -> None:
    rename = [(r"optimizer\.state\.(\d+)\.exp_avg", r"optimizer.state.\1.m")]
    with pytest.warns(UserWarning, match="matched no rename rule"):  # (step and exp_avg_sq keep their names)
        parallel_dcp.convert(ckpt, tmp_path / "out.pt", keys="optimizer.state.*", rename=rename, workers=1)
    out, source = torch.load(tmp_path / "out.pt"), torch.load(ckpt)
    assert [(type(k), k) for k in out["optimizer"]["state"]] == [(int, 0), (int, 1)]
    for i, state in source["optimizer"]["state"].items():
        assert_same(
            out["optimizer"]["state"][i],
            {"step": state["step"], "m": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]},
        )


def test_keys_that_flatten_to_one_name_are_still_refused(tmp_path: Path) -> None:
    """0 and "0" side by side would be one name in every output (and in the flat key list)."""
    src = tmp_path / "both.pt"
    torch.save({"state": {0: torch.ones(1), "0": torch.zeros(1)}}, src)
    with pytest.raises(InvalidStateDictError, match="flatten to the same name"):
        parallel_dcp.convert(src, tmp_path / "out.pt", workers=1)
    assert not (tmp_path / "out.pt").exists()


def test_dry_run_inspect_and_verify_describe_the_file(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = run_in_process(capsys, "convert", ckpt, tmp_path / "out.pt", "--dry-run").stdout
    assert "21 keys" in plan and "optimizer.state.0.step" in plan
    refused = run_in_process(capsys, "convert", ckpt, tmp_path / "dcp", "--dry-run", check_code=1).stderr
    assert "holds key 0 (int) under optimizer.state" in " ".join(refused.split())
    listed = run_in_process(capsys, "inspect", ckpt, "--keys").stdout
    assert "optimizer.state.1.exp_avg_sq" in listed and "model.weight" in listed
    run_in_process(capsys, "convert", ckpt, tmp_path / "out.pt", "-q")
    checked = run_in_process(capsys, "verify", tmp_path / "out.pt", "--against", ckpt).stdout
    assert "OK" in checked and "compared with" in checked


def test_load_with_keys_gives_the_int_keys_back(ckpt: Path) -> None:
    source = torch.load(ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = parallel_dcp.load(ckpt, keys="optimizer.*")
    assert_same(loaded, {"optimizer": source["optimizer"]})
    _same_order(loaded, {"optimizer": source["optimizer"]})
    with pytest.raises(InvalidStateDictError, match=r"key 0 \(int\) under optimizer\.state, which into="):
        parallel_dcp.load(ckpt, into=torch.load(ckpt))  # (into= is filled by DCP's string names)
