"""A torch.save file whose top level is not a mapping (review s17 F6).

``torch.save(({"a": t},))`` converted to ``out.pt`` wrote ``{"": ({"a": t},)}``, not the tuple
``torch.load`` of the source gives; a list or a tensor was refused only inside a worker, after the
job had started, naming keys such as ``'.0.a'``. Now every conversion refuses such a file in the
coordinator, before any task (a dry run too), naming what it holds, for every output kind and
for each of several sources before the first is converted. ``load``, ``inspect`` and ``verify``
still read it, under the key ``""``, which messages show as ``''``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import parallel_dcp
from parallel_dcp.errors import InvalidStateDictError
from tests.cli_in_process import run_in_process

T = torch.arange(4.0)

SHAPES: dict[str, tuple[Callable[[], object], str]] = {
    "list": (lambda: [{"a": T}, {"b": T + 1}], "holds a list at its top level, not a state dict"),
    "tuple": (lambda: ({"a": T},), "holds a tuple at its top level, not a state dict"),
    "tensor": (lambda: T, "holds a tensor at its top level, not a state dict"),
    "int": (lambda: 3, "holds an int at its top level, not a state dict"),
}


@pytest.mark.parametrize("output", ["out.pt", "out.safetensors", "dcp", "hf"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_conversion_refuses_it_before_any_task(tmp_path: Path, shape: str, output: str) -> None:
    made, said = SHAPES[shape]
    torch.save(made(), tmp_path / "src.pt")
    out = tmp_path / output
    to = "safetensors" if output == "hf" else None
    for dry_run in (True, False):  # (a dry run starts no worker: refused by the coordinator's checks)
        with pytest.raises(InvalidStateDictError) as caught:
            parallel_dcp.convert(tmp_path / "src.pt", out, to=to, workers=1, dry_run=dry_run)
        message = str(caught.value)
        assert f"{tmp_path / 'src.pt'} {said}" in message
        assert "Nothing was written" in message and "worker" not in message
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.pt"]


def test_the_cli_says_it_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save([{"a": T}], tmp_path / "toplist.pt")
    err = run_in_process(capsys, "convert", tmp_path / "toplist.pt", tmp_path / "out.pt", check_code=1).stderr
    assert "holds a list at its top level, not a state dict" in err
    assert "torch.save(obj[0], PATH)" in " ".join(err.split())
    assert "'.0.a'" not in err and "worker" not in err
    assert not (tmp_path / "out.pt").exists()


def test_a_later_source_is_refused_before_the_first_is_converted(tmp_path: Path) -> None:
    torch.save({"a": T}, tmp_path / "good.pt")
    torch.save([{"a": T}], tmp_path / "toplist.pt")
    with pytest.raises(InvalidStateDictError, match=r"toplist\.pt holds a list at its top level"):
        parallel_dcp.convert([tmp_path / "good.pt", tmp_path / "toplist.pt"], tmp_path / "out", workers=1)
    assert not (tmp_path / "out" / "good").exists()  # (the first source's output: not written)


def test_a_pickled_module_at_the_top_level_is_refused_for_every_output(tmp_path: Path) -> None:
    torch.save(torch.nn.Linear(4, 3), tmp_path / "model.pt")
    for output in ("out.pt", "dcp"):
        with pytest.warns(UserWarning, match="trust"), pytest.raises(InvalidStateDictError) as caught:
            parallel_dcp.convert(tmp_path / "model.pt", tmp_path / output, trust_pickle=True, workers=1)
        assert "the file holds a pickled torch.nn.Linear module, not tensors" in str(caught.value)
        assert "model.state_dict()" in str(caught.value)
        assert not (tmp_path / output).exists()


@pytest.mark.parametrize("shape", ["list", "tensor"])
def test_load_inspect_and_verify_still_read_it_under_the_empty_key(
    tmp_path: Path, shape: str, capsys: pytest.CaptureFixture[str]
) -> None:
    made = SHAPES[shape][0]
    torch.save(made(), tmp_path / "src.pt")
    loaded = parallel_dcp.load(tmp_path / "src.pt")
    assert list(loaded) == [""]
    report = parallel_dcp.verify(tmp_path / "src.pt", against=tmp_path / "src.pt", workers=1)
    assert report.ok, report.problems  # (the workers' reads failed: "a state dict must be a mapping, got list")
    assert report.keys_checked == (2 if shape == "list" else 1)
    run_in_process(capsys, "inspect", tmp_path / "src.pt")


def test_the_empty_key_is_shown_as_quotes(tmp_path: Path) -> None:
    torch.save({"": 3, "w": T}, tmp_path / "src.pt")  # (a mapping: converts, with "" one of its keys)
    with pytest.raises(ValueError, match=r"selects 1 other values \(''\)"):
        parallel_dcp.convert(tmp_path / "src.pt", tmp_path / "out.safetensors", workers=1)
