"""The newcomer's frictions of issue 31 (items 4 and 7), each reproduced as it was met."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import parallel_dcp
from parallel_dcp import cli


def _truncated_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    ckpt = tmp_path / "ckpt"
    parallel_dcp.save({"w": torch.randn(256, 64), "v": torch.ones(3)}, ckpt, workers=1)
    shard = next(p for p in ckpt.iterdir() if p.suffix == ".distcp")
    with open(shard, "r+b") as f:
        f.truncate(100)
    return ckpt, shard


def test_inspect_of_a_committed_checkpoint_with_a_truncated_shard_says_damaged_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 31 item 4: it printed "NOT committed" and "DAMAGED" and exited 0."""
    ckpt, shard = _truncated_checkpoint(tmp_path)
    info = parallel_dcp.inspect(ckpt)
    assert info["committed"] is True and shard.name in info["damaged"]
    assert cli.main(["inspect", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert "committed, DAMAGED: " in out and "NOT committed" not in out
    assert shard.name in out
    assert cli.main(["inspect", str(ckpt), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["damaged"]


def test_inspect_of_a_committed_checkpoint_with_a_missing_shard_says_damaged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, shard = _truncated_checkpoint(tmp_path)
    shard.unlink()
    info = parallel_dcp.inspect(ckpt)
    assert info["committed"] is True and shard.name in info["damaged"]
    assert cli.main(["inspect", str(ckpt)]) == 1
    assert "committed, DAMAGED: " in capsys.readouterr().out


def test_inspect_of_a_sound_checkpoint_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parallel_dcp.save({"w": torch.randn(8, 8)}, tmp_path / "ckpt", workers=1)
    assert cli.main(["inspect", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert ": dcp, committed\n" in out and "DAMAGED" not in out
