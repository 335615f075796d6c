"""Messages that help (issue 25): rename rules that rename nothing (item 4), verify's hint after a
cast (item 5), chunk names in words (item 6)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

import parallel_dcp
from parallel_dcp import cli
from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.errors import describe_keys, describe_unit


@pytest.fixture
def model(tmp_path: Path) -> Path:
    st.save_file(
        {
            "embeddings.word_embeddings.weight": torch.randn(64, 8),
            "encoder.layer.0.attention.weight": torch.randn(8, 8),
            "encoder.layer.1.attention.weight": torch.randn(8, 8),
            "position_ids": torch.arange(8),
        },
        tmp_path / "m.safetensors",
    )
    return tmp_path / "m.safetensors"


LLAMA_RULES = [
    (r"model\.embed_tokens\.weight", "tok_embeddings.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", r"layers.\1.attention.wq.weight"),
]


def test_rename_rules_that_match_nothing_warn_by_name(model: Path, tmp_path: Path) -> None:
    assert issubclass(parallel_dcp.RenameWarning, UserWarning) and "RenameWarning" in parallel_dcp.__all__
    with pytest.warns(parallel_dcp.RenameWarning) as caught:
        parallel_dcp.convert(model, tmp_path / "out", rename=LLAMA_RULES, workers=1)
    messages = [str(w.message) for w in caught if str(w.message).startswith("rename rule")]
    assert len(messages) == 2
    # and the keys no rule renamed, by name (issue 29: the rules alone left them unnoticed)
    leftover = [str(w.message) for w in caught if "matched no rename rule" in str(w.message)]
    assert len(leftover) == 1 and "4 keys" in leftover[0] and "'position_ids'" in leftover[0]
    assert "rename rule 0 ('model\\\\.embed_tokens\\\\.weight' -> 'tok_embeddings.weight')" in messages[0]
    assert "it matches no key" in messages[0] and "0 keys renamed by 0 of 2 rules" in messages[0]


def test_a_shadowed_rule_warns_and_the_summary_counts(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rules = [(r"encoder\.layer\.(\d+)\.(.*)", r"layers.\1.\2"), (r"encoder\.(.*)", r"enc.\1"), ("nothing", "x")]
    with caplog.at_level(logging.INFO, logger="parallel_dcp"), pytest.warns(parallel_dcp.RenameWarning) as caught:
        parallel_dcp.convert(model, tmp_path / "out", rename=rules, workers=1)
    messages = sorted(str(w.message) for w in caught if str(w.message).startswith("rename rule"))
    assert "rename rule 1" in messages[0] and "taken by an earlier rule" in messages[0]
    assert "rename rule 2" in messages[1] and "matches no key" in messages[1]
    assert any("2 keys renamed by 1 of 3 rules" in r.getMessage() for r in caplog.records)


def test_rules_that_all_match_and_cover_every_key_do_not_warn(model: Path, tmp_path: Path) -> None:
    rules = [(r"encoder\.(.*)", r"enc.\1"), (r"(embeddings\..*|position_ids)", r"\1")]  # the last keeps names
    with warnings.catch_warnings():
        warnings.simplefilter("error", parallel_dcp.RenameWarning)
        parallel_dcp.convert(model, tmp_path / "out", rename=rules, workers=1)
    assert parallel_dcp.inspect(tmp_path / "out", keys="enc.*")["key_list"]


def test_cli_prints_one_warning_line_per_rule_and_the_summary(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(
        [
            *["convert", str(model), str(tmp_path / "out"), "--workers", "1"],
            *["--rename", "encoder\\.(.*)=enc.\\1", "--rename", "model\\.norm\\.weight=norm.weight"],
        ]
    )
    err = capsys.readouterr().err
    assert code == 0
    lines = err.splitlines()
    warned = [line for line in lines if line.startswith("parallel-dcp: warning: rename rule")]
    assert len(warned) == 1 and "rename rule 1 ('model\\\\.norm\\\\.weight' -> 'norm.weight')" in warned[0]
    assert not any(".py:" in line or "warnings.warn" in line for line in lines)  # no source path, no code
    assert any(line.endswith("2 keys renamed by 1 of 2 rules") for line in lines)
    assert any(line.startswith("parallel-dcp: warning: 2 keys of") and "'position_ids'" in line for line in lines)


def test_verify_after_a_cast_suggests_the_dtype(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parallel_dcp.convert(model, tmp_path / "bf16", dtype="bf16", workers=1)
    report = parallel_dcp.verify(tmp_path / "bf16", against=model, workers=1)
    assert not report.ok and len(report.problems) == 3  # the int64 position_ids are not cast
    assert report.suggested_dtype == "bfloat16" and report.as_dict()["suggested_dtype"] == "bfloat16"
    assert cli.main(["verify", str(tmp_path / "bf16"), "--against", str(model), "--workers", "1"]) == 1
    out = capsys.readouterr().out
    assert "hint:" in out and "--dtype bfloat16" in out
    assert parallel_dcp.verify(tmp_path / "bf16", against=model, dtype="bfloat16", workers=1).ok

    # another difference beside the casts: no suggestion (a cast would not explain it)
    parallel_dcp.convert(model, tmp_path / "some", dtype="bf16", workers=1, keys="encoder.*")
    other = parallel_dcp.verify(tmp_path / "some", against=model, workers=1)
    assert not other.ok and other.suggested_dtype is None
    same = parallel_dcp.verify(tmp_path / "bf16", workers=1)
    assert same.ok and same.suggested_dtype is None


def test_chunk_names_are_said_in_words() -> None:
    assert describe_unit("embeddings.word_embeddings.weight[0:26161:30522]") == (
        "'embeddings.word_embeddings.weight' (one chunk: rows 26161 to 30521 along dimension 0)"
    )
    assert describe_unit("w[1:0:512]'") == "'w' (one chunk: rows 0 to 511 along dimension 1)"
    assert describe_unit("plain.key") == "'plain.key'"
    assert describe_unit("x[0:1:2]", quote=False) == "x (one chunk: rows 1 to 1 along dimension 0)"
    assert "[0:14921:15600]" not in describe_keys(["emb[0:14921:15600]", "b"])
    governor = MemoryGovernor(64 * 2**20)
    with pytest.raises(parallel_dcp.MemoryLimitExceeded, match=r"'emb' \(one chunk: rows 14921 to 15599 along"):
        governor.check_item("emb[0:14921:15600]", 2**30)


def test_dry_run_and_memory_errors_explain_chunks(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(
        ["convert", str(model), str(tmp_path / "out"), "--dry-run", "--chunk-size", "1KiB", "--workers", "2"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "embeddings.word_embeddings.weight (one chunk: rows 0 to 31 along dimension 0)" in out
    assert "a chunk is a range of rows of one tensor" in out
    assert "[0:0:32]" not in out
    plan = parallel_dcp.convert(model, tmp_path / "out", dry_run=True, chunk_size="1KiB", workers=2)
    assert any("[0:0:32]" in key for f in plan.as_dict()["files"] for key in f["keys"])  # JSON keeps the names
