"""``inspect PATH --keys [PATTERN ...]`` and ``inspect --json``'s ``key_list`` (issue 25, item 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

import parallel_dcp
from parallel_dcp import cli


@pytest.fixture
def checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    tensors = {
        "model.embed.weight": torch.zeros(8, 4),
        "model.layers.0.q.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
        "model.layers.1.q.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
        "lm_head.weight": torch.zeros(8, 4),
    }
    st.save_file(tensors, tmp_path / "m.safetensors")
    parallel_dcp.save({**tensors, "step": 7}, tmp_path / "dcp", workers=1)
    return tmp_path / "m.safetensors", tmp_path / "dcp"


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_keys_lists_one_line_per_key(checkpoints: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    st_path, dcp = checkpoints
    code, out, _ = _main(capsys, "inspect", str(st_path), "--keys")
    assert code == 0
    rows = [line.split() for line in out.splitlines()]
    assert [r[0] for r in rows] == [
        "lm_head.weight",  # safetensors lists its keys sorted
        "model.embed.weight",
        "model.layers.0.q.weight",
        "model.layers.1.q.weight",
    ]
    by_name = {r[0]: r for r in rows}
    assert by_name["model.layers.0.q.weight"][1:] == ["bfloat16", "[4,", "4]", "32"]
    assert by_name["model.embed.weight"][1] == "float32" and by_name["model.embed.weight"][-1] == "128"

    code, out, _ = _main(capsys, "inspect", str(dcp), "--keys", "model.layers.*", "re:lm_.*")
    names = [line.split()[0] for line in out.splitlines()]
    assert code == 0 and names == ["model.layers.0.q.weight", "model.layers.1.q.weight", "lm_head.weight"]
    code, out, _ = _main(capsys, "inspect", str(dcp), "--keys", "step")
    assert out.split() == ["step", "value", "-", out.split()[-1]] and int(out.split()[-1]) > 0


def test_keys_that_select_nothing_fail_naming_the_keys(
    checkpoints: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _main(capsys, "inspect", str(checkpoints[0]), "--keys", "decoder.*")
    assert code == 1 and out == ""
    assert "select nothing" in err and "lm_head.weight" in err


def test_json_lists_every_key_and_keeps_its_fields(
    checkpoints: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, dcp = checkpoints
    code, out, _ = _main(capsys, "inspect", str(dcp), "--json")
    info = json.loads(out)
    assert code == 0
    for field in ("format", "committed", "keys", "tensors", "total_bytes", "dtypes", "largest", "files", "values"):
        assert field in info  # the fields scripts already read stay
    listed = {e["key"]: e for e in info["key_list"]}
    assert len(listed) == info["keys"] == 5
    assert listed["model.embed.weight"] == {
        "key": "model.embed.weight",
        "kind": "tensor",
        "dtype": "float32",
        "shape": [8, 4],
        "bytes": 128,
    }
    assert listed["step"]["kind"] == "value" and listed["step"]["dtype"] is None
    code, out, _ = _main(capsys, "inspect", str(dcp), "--json", "--keys", "*q.weight")
    assert [e["key"] for e in json.loads(out)["key_list"]] == ["model.layers.0.q.weight", "model.layers.1.q.weight"]


def test_the_python_api_filters_as_convert_does(checkpoints: tuple[Path, Path]) -> None:
    info = parallel_dcp.inspect(checkpoints[0], keys="model.*")
    assert [e["key"] for e in info["key_list"]] == [
        "model.embed.weight",
        "model.layers.0.q.weight",
        "model.layers.1.q.weight",
    ]
    assert len(parallel_dcp.inspect(checkpoints[0])["key_list"]) == 4


def test_keys_does_not_go_with_diff(checkpoints: tuple[Path, Path]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["inspect", str(checkpoints[0]), "--diff", str(checkpoints[1]), "--keys"])
    assert exit_info.value.code == 2
