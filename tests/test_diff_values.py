"""``inspect --diff`` round two: large tensors hashed in row ranges under the memory limit (issue 25,
item 7), values holding tensors and NaNs compared without raising (issue 24, item 13), and names
with control characters escaped in its text output (issue 24, item 14)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

import parallel_dcp
from parallel_dcp.cli import main
from parallel_dcp.jobs.diff import values_equal
from tests.fresh_interpreter import run_fresh

MiB = 2**20


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The command run in this process (main(argv), what ``python -m parallel_dcp`` runs): its
    exit code, stdout and stderr. An exception main lets out (a traceback) fails the test."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def diffs_under_a_tight_limit(where: str) -> list[str]:
    """24 MiB tensors under a 32 MiB limit: a task may read about 14 MiB, so whole reads (which
    were refused: "needs 48.0 MiB") give way to row ranges; a change in one row is still found.
    The DCP side is stored in 4 MiB chunks (as a conversion under a low limit writes it), so a
    range of it is read alone. Every check's failure, none when all hold."""
    tmp_path = Path(where)
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1536, 4096, generator=g)  # 24 MiB
    parallel_dcp.save({"big": big, "small": torch.ones(3)}, tmp_path / "a", workers=2, chunk_size="4MiB")
    st.save_file({"big": big, "small": torch.ones(3)}, tmp_path / "b.safetensors")
    changed = big.clone()
    changed[1500, 7] += 1
    st.save_file({"big": changed, "small": torch.ones(3)}, tmp_path / "c.safetensors")
    st.save_file({"huge": big, "small": torch.ones(3)}, tmp_path / "d.safetensors")
    failed = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            failed.append(what)

    same = parallel_dcp.diff(tmp_path / "a", tmp_path / "b.safetensors", workers=1, memory_limit="32MiB")
    check(same.same and same.unchanged == 2, f"same: {same}")
    check(same.bytes_hashed == 2 * (big.nbytes + 12), f"bytes hashed: {same.bytes_hashed}")
    differs = parallel_dcp.diff(tmp_path / "a", tmp_path / "c.safetensors", workers=1, memory_limit="32MiB")
    check([(c["key"], c["change"]) for c in differs.changed] == [("big", "content")], f"differs: {differs.changed}")
    moved = parallel_dcp.diff(tmp_path / "b.safetensors", tmp_path / "d.safetensors", workers=1, memory_limit="32MiB")
    check(moved.renamed == [("big", "huge")], f"moved: {moved.renamed}")  # both sides cut the same way

    # the same verdicts with room to read it whole (another digest scheme, the same answers)
    roomy = parallel_dcp.diff(tmp_path / "a", tmp_path / "c.safetensors", workers=1, memory_limit="512MiB")
    check([(c["key"], c["change"]) for c in roomy.changed] == [("big", "content")], f"roomy: {roomy.changed}")
    return failed


def test_a_tensor_larger_than_a_task_may_read_is_hashed_in_row_ranges(tmp_path: Path) -> None:
    # In a fresh interpreter: its plan fills the limit, and in this long-lived one inherited malloc
    # arenas add ~1 MiB to the worker (tests/fresh_interpreter.py).
    assert run_fresh("tests.test_diff_values", "diffs_under_a_tight_limit", str(tmp_path)) == []


def test_a_memory_error_names_the_key_without_internal_prefixes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parallel_dcp.save({"model.embed_tokens.weight": torch.zeros(1024, 1024)}, tmp_path / "a", workers=1)
    parallel_dcp.save({"model.embed_tokens.weight": torch.ones(1024, 1024)}, tmp_path / "b", workers=1)
    with pytest.raises(parallel_dcp.MemoryLimitExceeded) as caught:
        parallel_dcp.diff(tmp_path / "a", tmp_path / "b", workers=1, memory_limit="12MiB")
    message = str(caught.value)
    assert "model.embed_tokens.weight" in message
    assert "\\x00" not in message and "\x00" not in message and "b\\x00" not in message
    code, _, err = _cli(
        capsys, "inspect", str(tmp_path / "a"), "--diff", str(tmp_path / "b"), "--memory-limit", "12MiB"
    )
    assert code == 1 and "model.embed_tokens.weight" in err
    assert "\\x00" not in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        ((torch.ones(3), 1), (torch.ones(3), 1), True),
        ((torch.ones(3), 1), (torch.zeros(3), 1), False),
        ([torch.ones(2, 2)], [torch.ones(2, 2)], True),
        ([torch.ones(2, 2)], [torch.ones(4)], False),
        ([torch.ones(2)], [torch.ones(2, dtype=torch.float64)], False),
        ({"m": (torch.arange(3), [torch.ones(1)])}, {"m": (torch.arange(3), [torch.ones(1)])}, True),
        ((torch.ones(3),), [torch.ones(3)], False),  # a tuple is not a list
        (math.nan, float("nan"), True),
        (math.nan, -math.nan, False),  # other NaN bits (the sign)
        (torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0]), True),
        (1.0, 1.0, True),
        (0.0, -0.0, False),  # bits, as tensors compare
        ("x", "y", False),
    ],
)
def test_values_compare_element_wise_and_nan_by_bits(a: object, b: object, equal: bool) -> None:
    assert values_equal(a, b) is equal
    assert values_equal(b, a) is equal


def test_diff_of_values_holding_tensors_and_nans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The reviewer's case: a tuple value holding a tensor raised a raw RuntimeError; a NaN value
    was "changed" between identical checkpoints."""
    state = {
        "w": torch.ones(4),
        "step": (torch.tensor([1.0, 2.0]), 3),
        "best": math.nan,
        "history": [torch.zeros(2), torch.full((2,), math.nan)],
    }
    torch.save(state, tmp_path / "a.pt")
    torch.save(state, tmp_path / "b.pt")
    other = dict(state, step=(torch.tensor([1.0, 2.5]), 3))
    torch.save(other, tmp_path / "c.pt")
    report = parallel_dcp.diff(tmp_path / "a.pt", tmp_path / "b.pt", workers=1)
    assert report.same, report.changed
    report = parallel_dcp.diff(tmp_path / "a.pt", tmp_path / "c.pt", workers=1)
    assert [(c["key"], c["change"]) for c in report.changed] == [("step", "value")]
    code, out, err = _cli(capsys, "inspect", str(tmp_path / "a.pt"), "--diff", str(tmp_path / "c.pt"))
    assert code == 1 and "Traceback" not in err and "changed step: value" in out


def test_control_characters_in_names_are_escaped_in_the_text_but_exact_in_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    evil = "x\x1b[2J\x07\nchanged forged: content"
    st.save_file({evil: torch.ones(2), "keep": torch.ones(1)}, tmp_path / "a.safetensors")
    st.save_file({evil + "2": torch.ones(2), "keep": torch.zeros(1)}, tmp_path / "b.safetensors")
    code, text, _ = _cli(capsys, "inspect", str(tmp_path / "a.safetensors"), "--diff", str(tmp_path / "b.safetensors"))
    assert code == 1
    assert "\x1b" not in text and "\x07" not in text
    assert "x\\x1b[2J\\x07\\nchanged forged: content" in text
    assert not any(line.startswith("changed forged") for line in text.splitlines())
    _, data, _ = _cli(
        capsys, "inspect", str(tmp_path / "a.safetensors"), "--diff", str(tmp_path / "b.safetensors"), "--json"
    )
    out = json.loads(data)
    assert out["renamed"] == [[evil, evil + "2"]]
