"""``inspect --diff`` / ``parallel_dcp.diff``: added, removed, renamed and changed keys across formats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

import parallel_dcp
from parallel_dcp.cli import main
from parallel_dcp.jobs.diff import tensor_checksum

MiB = 2**20


def pair(tmp_path: Path) -> tuple[Path, Path]:
    """A safetensors file, and a DCP checkpoint of it after a migration that renamed one key,
    changed one tensor, cast one, reshaped one, dropped one and added one."""
    g = torch.Generator().manual_seed(0)
    a = {
        "tok.weight": torch.randn(1024, 1024, generator=g),  # 4 MiB
        "x.weight": torch.randn(64, 32, generator=g),
        "w1": torch.randn(128, 64, generator=g),
        "w2": torch.randn(128, 64, generator=g),
        "w3": torch.randn(16, 8, generator=g),
        "gone": torch.randn(5, generator=g),
        "same.int": torch.arange(10),
    }
    st.save_file(a, tmp_path / "a.safetensors")
    b = {k: v.clone() for k, v in a.items() if k not in ("gone", "x.weight")}
    b["y.weight"] = a["x.weight"].clone()  # renamed
    b["w1"][3, 7] += 1  # content
    b["w2"] = a["w2"].bfloat16()  # dtype
    b["w3"] = a["w3"].reshape(8, 16)  # shape
    b["new"] = torch.randn(7, generator=g)  # added
    parallel_dcp.save(b, tmp_path / "b", workers=2)
    return tmp_path / "a.safetensors", tmp_path / "b"


def test_diff_finds_renamed_changed_dtype_shape_added_removed(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    report = parallel_dcp.diff(a, b, workers=2, memory_limit="64MiB")
    assert not report.same
    assert report.renamed == [("x.weight", "y.weight")]
    assert report.added == ["new"] and report.removed == ["gone"]
    changes = {c["key"]: c for c in report.changed}
    assert set(changes) == {"w1", "w2", "w3"}
    assert changes["w1"]["change"] == "content" and changes["w1"]["a"] != changes["w1"]["b"]
    assert changes["w2"] == {"key": "w2", "change": "dtype", "a": "float32[128, 64]", "b": "bfloat16[128, 64]"}
    assert changes["w3"]["change"] == "shape"
    assert report.unchanged == 2  # tok.weight, same.int
    assert report.format_a == "safetensors" and report.format_b == "dcp"
    # what was hashed: the 2 unchanged and w1 on both sides, and the 4 keys only on one side
    a_bytes = sum(t.nbytes for k, t in st.load_file(a).items() if k in ("tok.weight", "same.int", "w1"))
    assert report.bytes_hashed == 2 * a_bytes + (64 * 32 + 5 + 64 * 32 + 7) * 4


def test_a_conversion_diffs_as_the_same(tmp_path: Path) -> None:
    a, _ = pair(tmp_path)
    parallel_dcp.convert(a, tmp_path / "c", workers=2)
    report = parallel_dcp.diff(a, tmp_path / "c")
    assert report.same and report.unchanged == 7
    renamed = tmp_path / "r.safetensors"
    parallel_dcp.convert(tmp_path / "c", renamed, rename=[(r"(w\d)", r"layer.\1")])
    report = parallel_dcp.diff(tmp_path / "c", renamed)
    assert sorted(report.renamed) == [("w1", "layer.w1"), ("w2", "layer.w2"), ("w3", "layer.w3")]
    assert not report.added and not report.removed and not report.changed


def test_checksum_is_of_the_bytes() -> None:
    t = torch.arange(6, dtype=torch.float32)
    assert tensor_checksum(t) == tensor_checksum(t.reshape(2, 3)) == tensor_checksum(t.reshape(3, 2).t().t())
    assert tensor_checksum(t.reshape(2, 3).t()) != tensor_checksum(t)  # row-major order of the view
    assert tensor_checksum(t.bfloat16()) != tensor_checksum(t)
    assert tensor_checksum(torch.zeros(0)) == tensor_checksum(torch.zeros(0, 3))


def test_cli_inspect_diff(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command's exit codes and output, run in this process (main(argv), as ``python -m
    parallel_dcp`` runs it; tests/test_cli.py runs the program itself)."""
    a, b = pair(tmp_path)

    def inspect(*args: str | Path) -> tuple[int, str]:
        code = main(["inspect", str(a), *map(str, args)])
        return code, capsys.readouterr().out

    code, out = inspect("--diff", b, "--json", "--workers", "2")
    assert code == 1  # they differ
    found = json.loads(out)
    assert found["renamed"] == [["x.weight", "y.weight"]] and found["added"] == ["new"] and found["removed"] == ["gone"]
    _, text = inspect("--diff", b)
    assert "renamed x.weight -> y.weight" in text and "changed w2: dtype float32[128, 64]" in text
    code, same = inspect("--diff", a)
    assert code == 0 and "the same" in same
    code, plain = inspect("--json")  # inspect alone still works
    assert code == 0 and json.loads(plain)["tensors"] == 7
