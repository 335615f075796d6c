"""``verify --against`` and ``inspect --diff`` tell an optimizer state keyed by int parameter
indexes from the same state keyed by strings (review s17 F4).

``{"optimizer": opt.state_dict()}`` keys its state 0, 1; the same file with the state keyed "0",
"1" (what stock ``dcp_to_torch_save`` gives back for a DCP saved from it) flattens to the same
names and bytes, and both compared "the same" / OK, while ``Adam.load_state_dict`` fills its
parameters from the one and leaves them fresh from the other. A DCP checkpoint (string keys only)
against the int-keyed file is a difference too, said with what DCP makes of an int key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import parallel_dcp
from parallel_dcp.formats.key_paths import NonStringKey, key_type_difference
from parallel_dcp.jobs.diff import describe_diff
from tests.cli_in_process import run_in_process


def _optimizer_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def _string_keyed(saved: dict[str, Any]) -> dict[str, Any]:
    state = saved["optimizer"]
    return {**saved, "optimizer": {**state, "state": {str(k): v for k, v in state["state"].items()}}}


def _resumes(saved: dict[str, Any]) -> bool:
    """Whether an Adam loading ``saved`` puts the state on its parameters (what a trainer needs)."""
    optimizer = torch.optim.Adam(torch.nn.Linear(3, 2).parameters())
    optimizer.load_state_dict(saved["optimizer"])
    return all(p in optimizer.state for p in optimizer.param_groups[0]["params"])


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    """(int-keyed file, string-keyed file), a client loading the one and not the other."""
    saved = _optimizer_state()
    torch.save(saved, tmp_path / "int.pt")
    torch.save(_string_keyed(saved), tmp_path / "str.pt")
    assert _resumes(torch.load(tmp_path / "int.pt")) and not _resumes(torch.load(tmp_path / "str.pt"))
    return tmp_path / "int.pt", tmp_path / "str.pt"


def test_verify_fails_a_string_keyed_state_against_the_int_keyed_one(
    pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    int_pt, str_pt = pair
    report = parallel_dcp.verify(str_pt, against=int_pt, workers=1)
    assert not report.ok
    assert f"optimizer.state.0.exp_avg: key '0' (str) under optimizer.state here, key 0 (int) in {int_pt}" in (
        report.problems
    )
    assert sum("under optimizer.state here" in p for p in report.problems) == 6  # (step, exp_avg, exp_avg_sq) x 2
    assert "load_state_dict" in report.problems[-1] and "DCP" not in report.problems[-1]
    assert not any(p.startswith("model.") for p in report.problems)  # (string keys alike: not reported)
    out = run_in_process(capsys, "verify", str_pt, "--against", int_pt, check_code=1).stdout
    assert "FAILED" in out and "key '1' (str) under optimizer.state here, key 1 (int) in" in out
    # each file against itself, and the int keys against a copy keeping them: OK
    assert parallel_dcp.verify(int_pt, against=int_pt, workers=1).ok
    assert parallel_dcp.verify(str_pt, against=str_pt, workers=1).ok


def test_diff_names_the_key_type_of_each_key(pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    int_pt, str_pt = pair
    report = parallel_dcp.diff(int_pt, str_pt, workers=1)
    assert not report.same
    change = {"key": "optimizer.state.1.step", "change": "key type"}
    change |= {"a": "key 1 (int) under optimizer.state", "b": "key '1' (str) under optimizer.state"}
    assert change in report.changed
    assert {c["key"] for c in report.changed} == {
        f"optimizer.state.{i}.{name}" for i in (0, 1) for name in ("step", "exp_avg", "exp_avg_sq")
    }
    assert report.unchanged == len(report.changed) + 2 + 6  # the rest: model (2) and param_groups (6)
    out = run_in_process(capsys, "inspect", int_pt, "--diff", str_pt, check_code=1).stdout
    assert "the same" not in out and "6 changed" in out
    assert "changed optimizer.state.0.exp_avg: key type key 0 (int) under optimizer.state -> key '0' (str)" in out
    assert parallel_dcp.diff(int_pt, int_pt, workers=1).same


def test_a_dcp_of_the_int_keyed_state_is_a_difference_said_with_what_dcp_holds(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    int_pt, _ = pair
    dcp.save(torch.load(int_pt), checkpoint_id=tmp_path / "stock", no_dist=True)  # (names the int key 0 '0')
    report = parallel_dcp.verify(tmp_path / "stock", against=int_pt, workers=1)
    assert not report.ok
    assert f"optimizer.state.1.exp_avg_sq: key '1' (str) under optimizer.state here, key 1 (int) in {int_pt}" in (
        report.problems
    )
    assert "DCP names keys by strings only" in report.problems[-1]
    assert "a load into a template that holds the int keys fills them" in report.problems[-1]
    diffed = parallel_dcp.diff(int_pt, tmp_path / "stock", workers=1)
    assert {c["change"] for c in diffed.changed} == {"key type"}
    assert "DCP names keys by strings only" in describe_diff(diffed)


def test_a_torch_save_copy_keeps_the_int_keys_and_verifies(pair: tuple[Path, Path], tmp_path: Path) -> None:
    int_pt, _ = pair
    parallel_dcp.convert(int_pt, tmp_path / "copy.pt", workers=1)
    assert parallel_dcp.verify(tmp_path / "copy.pt", against=int_pt, workers=1).ok
    assert parallel_dcp.diff(tmp_path / "copy.pt", int_pt, workers=1).same


@pytest.mark.parametrize(
    ("name", "mine", "theirs", "said"),
    [
        ("s.0.x", ("s", NonStringKey(0), "x"), ("s", "0", "x"), ("key 0 (int)", "key '0' (str)", "under s")),
        ("s.0", ("s", NonStringKey(0)), ("s", 0), ("key 0 (int)", "list index 0", "under s")),
        ("0", (NonStringKey(0),), ("0",), ("key 0 (int)", "key '0' (str)", "at the top level")),
        (
            "s.0.x",
            ("s.0.x",),
            ("s", NonStringKey(0), "x"),
            ("'0' inside the string key 's.0.x'", "key 0 (int)", "under s"),
        ),
        ("s.1", ("s", NonStringKey(1)), ("s", NonStringKey(1)), None),
        ("s.1.x", ("s", 1, "x"), ("s", "1", "x"), None),  # (string keys and list indexes: not compared)
        ("a.b", ("a", "b"), ("a.b",), None),
    ],
)
def test_key_type_difference(
    name: str, mine: tuple[Any, ...], theirs: tuple[Any, ...], said: tuple[str, str, str] | None
) -> None:
    assert key_type_difference(name, mine, theirs) == said
