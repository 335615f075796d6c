"""A dry run refuses the destinations a real run refuses before writing (docs/conversion.md): a
Hugging Face cache snapshot, a non-empty folder that holds no checkpoint; and writes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch as st
import torch

import parallel_dcp
from parallel_dcp.errors import InvalidDestinationError
from tests.cli_in_process import run_in_process


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    st.save_file({"w": torch.arange(64, dtype=torch.float32)}, str(path), metadata={"format": "pt"})
    return path


def _destinations(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Each refused destination, and the words of the real run's refusal."""
    snapshot = tmp_path / "hub" / "models--org--m" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    return {
        "snapshot": (snapshot / "new", "Hugging Face cache"),
        "foreign": (foreign, "non-empty directory"),
    }


@pytest.mark.parametrize("which", ["snapshot", "foreign"])
def test_convert_dry_run_refuses_as_the_real_run(tmp_path: Path, source: Path, which: str) -> None:
    dest, words = _destinations(tmp_path)[which]
    before = _tree(tmp_path)
    with pytest.raises(InvalidDestinationError, match=words):
        parallel_dcp.convert(source, dest, workers=1)  # the real run
    with pytest.raises(InvalidDestinationError, match=words):
        parallel_dcp.convert(source, dest, dry_run=True, workers=1)
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("which", ["snapshot", "foreign"])
def test_save_dry_run_refuses_as_the_real_run(tmp_path: Path, which: str) -> None:
    dest, words = _destinations(tmp_path)[which]
    before = _tree(tmp_path)
    state = {"w": torch.zeros(8)}
    with pytest.raises(InvalidDestinationError, match=words):
        parallel_dcp.save(state, dest, workers=1)
    with pytest.raises(InvalidDestinationError, match=words):
        parallel_dcp.save(state, dest, dry_run=True, workers=1)
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("which", ["snapshot", "foreign"])
def test_cli_dry_run_refuses_as_the_real_run(
    tmp_path: Path, source: Path, which: str, capsys: pytest.CaptureFixture[str]
) -> None:
    dest, words = _destinations(tmp_path)[which]
    before = _tree(tmp_path)
    real = run_in_process(capsys, "convert", source, dest, check_code=None)
    dry = run_in_process(capsys, "convert", source, dest, "--dry-run", check_code=None)
    assert real.returncode != 0 and words in real.stderr
    assert dry.returncode == real.returncode, dry.stdout + dry.stderr
    assert words in dry.stderr and "nothing was written" not in dry.stdout
    assert _tree(tmp_path) == before


def test_dry_run_into_an_empty_or_new_folder_still_plans(tmp_path: Path, source: Path) -> None:
    (tmp_path / "empty").mkdir()
    for dest in (tmp_path / "empty", tmp_path / "new"):
        plan = parallel_dcp.convert(source, dest, dry_run=True, workers=1)
        assert plan.keys == 1
    assert not (tmp_path / "new").exists() and not any((tmp_path / "empty").iterdir())
