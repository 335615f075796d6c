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


def _layers(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = {f"model.layers.{i}.{p}": torch.full((4, 4), float(i)) for i in range(3) for p in ("q.weight", "k.weight")}
    sd["model.layers.0.mlp[0].weight"] = torch.ones(2)  # glob characters in a real key name
    parallel_dcp.save(sd, tmp_path / "ckpt", workers=1)
    return tmp_path / "ckpt", sd


@pytest.mark.parametrize("retries", [0, 1])
def test_load_keys_take_the_patterns_of_dash_dash_keys(tmp_path: Path, retries: int) -> None:
    """Friction 8: load(keys=["model.layers.0.*"]) took no globs (convert and inspect do)."""
    ckpt, sd = _layers(tmp_path)
    got = parallel_dcp.load(ckpt, keys=["model.layers.0.*"], workers=1, retries=retries)
    assert sorted(got) == sorted(k for k in sd if k.startswith("model.layers.0."))
    got = parallel_dcp.load(ckpt, keys=[r"re:model\.layers\.[12]\.q\.weight"], workers=1, retries=retries)
    assert sorted(got) == ["model.layers.1.q.weight", "model.layers.2.q.weight"]
    got = parallel_dcp.load(ckpt, keys="model.layers.0.mlp[0].weight", workers=1, retries=retries)
    assert list(got) == ["model.layers.0.mlp[0].weight"]  # an exact name is itself, glob characters and all


@pytest.mark.parametrize("retries", [0, 1])
def test_load_of_a_missing_key_is_a_parallel_dcp_error_and_a_key_error(tmp_path: Path, retries: int) -> None:
    ckpt, _ = _layers(tmp_path)
    with pytest.raises(parallel_dcp.KeyNotFoundError, match=r"model\.layers\.9\.q\.weight") as caught:
        parallel_dcp.load(ckpt, keys=["model.layers.0.q.weight", "model.layers.9.q.weight"], workers=1, retries=retries)
    assert isinstance(caught.value, parallel_dcp.ParallelDCPError) and isinstance(caught.value, KeyError)
    assert "model.layers.9.q.weight" in str(caught.value) and not str(caught.value).startswith(("'", '"'))
    with pytest.raises(parallel_dcp.KeyNotFoundError, match="select nothing"):
        parallel_dcp.load(ckpt, keys=["model.layers.7.*"], workers=1, retries=retries)
    with pytest.raises(parallel_dcp.ParallelDCPError, match="regular expression"):
        parallel_dcp.load(ckpt, keys=["re:(["], workers=1, retries=retries)


def test_load_into_with_a_key_the_checkpoint_lacks_is_a_parallel_dcp_error(tmp_path: Path) -> None:
    ckpt, sd = _layers(tmp_path)
    into = {k: torch.empty_like(v) for k, v in sd.items()} | {"extra.bias": torch.empty(3)}
    with pytest.raises(parallel_dcp.KeyNotFoundError, match=r"extra\.bias") as caught:
        parallel_dcp.load(ckpt, into=into, workers=1)
    assert isinstance(caught.value, KeyError)
    into = {k: torch.empty_like(v) for k, v in sd.items()}
    with pytest.raises(parallel_dcp.KeyNotFoundError, match=r"not in into"):
        parallel_dcp.load(ckpt, keys=["model.layers.1.q.weight", "nope"], into=into, workers=1)
    got = parallel_dcp.load(ckpt, keys=["model.layers.1.*"], into=into, workers=1)
    assert got is into and torch.equal(into["model.layers.1.q.weight"], sd["model.layers.1.q.weight"])


def test_dtypes_are_spelled_as_the_cli_spells_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Friction 9: verify printed ``torch.bfloat16`` where inspect --diff prints ``bfloat16``."""
    parallel_dcp.save({"w": torch.randn(8, 8).bfloat16(), "n": torch.arange(4)}, tmp_path / "a", workers=1)
    parallel_dcp.save({"w": torch.randn(8, 8), "n": torch.arange(4)}, tmp_path / "b", workers=1)
    report = parallel_dcp.verify(tmp_path / "a", against=tmp_path / "b", workers=1)
    assert report.problems == ["w: dtype bfloat16 != float32"], report.problems
    report = parallel_dcp.verify(tmp_path / "a", against=tmp_path / "b", workers=1, dtype="float16")
    assert report.problems == ["w: dtype bfloat16 != float16 (float32 cast to float16)"], report.problems
    with pytest.raises(parallel_dcp.InvalidStateDictError, match="has dtype float32 but the checkpoint holds bfloat16"):
        parallel_dcp.load(tmp_path / "a", into={"w": torch.empty(8, 8), "n": torch.empty(4, dtype=torch.int64)})
    assert cli.main(["inspect", str(tmp_path / "a"), "--diff", str(tmp_path / "b"), "--workers", "1"]) == 1
    out = capsys.readouterr().out
    assert "torch." not in out and "bfloat16" in out


def test_a_truncated_safetensors_file_is_called_truncated_in_our_words(tmp_path: Path) -> None:
    """Friction 10: the library's "incomplete metadata, file not fully covered"."""
    from safetensors.torch import save_file

    whole = tmp_path / "whole.safetensors"
    save_file({"a": torch.randn(100, 100)}, whole)
    data = whole.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:5000])
    needed = len(data)
    for call in (parallel_dcp.inspect, lambda p: parallel_dcp.verify(p, workers=1)):
        with pytest.raises(parallel_dcp.CorruptCheckpointError) as caught:
            call(cut)
        message = str(caught.value)
        assert f"truncated: its header says {needed} bytes, the file has 5000" in message, message
        assert "not fully covered" not in message
    longer = tmp_path / "longer.safetensors"
    longer.write_bytes(data + b"\0" * 24)
    with pytest.raises(parallel_dcp.CorruptCheckpointError, match=f"24 bytes after the {needed} its header covers"):
        parallel_dcp.inspect(longer)


def test_an_empty_directory_is_called_empty(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for call in (
        parallel_dcp.inspect,
        lambda p: parallel_dcp.load(p, workers=1),
        lambda p: parallel_dcp.convert(p, tmp_path / "out.pt", workers=1),
        lambda p: parallel_dcp.verify(p, workers=1),
    ):
        with pytest.raises((ValueError, FileNotFoundError), match="the directory is empty"):
            call(tmp_path / "empty")


@pytest.mark.parametrize(
    ("record", "said"),
    [
        (lambda host: {"host": host, "pid": None, "start": None, "stopped": True}, "stopped on {host}"),
        (lambda host: "not json", "owner unknown: its record cannot be read"),
        (lambda host: {"host": host, "pid": 2**22 + 17}, "pid 4194321 on {host}"),
    ],
)
def test_leftover_messages_say_what_is_known_of_the_owner(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], record: object, said: str
) -> None:
    """Friction 4: leftover messages said ``pid None on vm``."""
    import socket
    import warnings

    from parallel_dcp.storage.ownership import owner_name

    host = socket.gethostname()
    out = tmp_path / "ckpt"
    out.mkdir()
    save_id = "0123456789ab"
    (out / f"__0_{save_id}_0.distcp").write_bytes(b"half a shard")
    content = record(host)  # type: ignore[operator]
    (out / owner_name(save_id)).write_text(content if isinstance(content, str) else json.dumps(content))
    expected = said.format(host=host)
    assert cli.main(["inspect", str(out)]) == 0
    listed = capsys.readouterr().out
    assert expected in listed and "None" not in listed, listed
    if isinstance(content, str):
        return  # an unreadable record is never taken for a dead save: its files stay
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallel_dcp.save({"w": torch.ones(2)}, out, workers=1)
    removed = [str(w.message) for w in caught if "leftover" in str(w.message)]
    assert removed and expected in removed[0] and "None" not in removed[0], removed


@pytest.mark.parametrize(("out", "extra"), [("dcp", []), ("st", ["--to", "safetensors", "--shard-size", "3000"])])
def test_the_dry_run_counts_the_files_the_run_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], out: str, extra: list[str]
) -> None:
    """Friction 6: the dry run counted one file fewer than the run (``.metadata``, the index)."""
    parallel_dcp.save({f"w{i}": torch.randn(32, 32) for i in range(4)}, tmp_path / "src", workers=1)
    args = ["convert", str(tmp_path / "src"), str(tmp_path / out), "--workers", "2", *extra]
    assert cli.main([*args, "--dry-run"]) == 0
    planned = capsys.readouterr().out
    plan = parallel_dcp.convert(tmp_path / "src", tmp_path / out, workers=2, dry_run=True, **_kwargs(extra))
    result = parallel_dcp.convert(tmp_path / "src", tmp_path / out, workers=2, **_kwargs(extra))
    assert plan.file_count == result.files
    assert f"in {result.files} files" in planned


def _kwargs(extra: list[str]) -> dict[str, object]:
    return {"to": "safetensors", "shard_size": 3000} if extra else {}


def test_the_dry_run_says_one_process_not_1_processes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parallel_dcp.save({"w": torch.randn(8, 8)}, tmp_path / "src", workers=1)
    args = ["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--workers", "1", "--dry-run"]
    assert cli.main(args) == 0
    planned = capsys.readouterr().out
    assert "1 processes" not in planned and "1 threads" not in planned, planned


def test_the_summary_of_a_small_job_has_a_rate_and_a_normalised_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Friction 6: ``0.00 GiB/s`` on small jobs; ``.../model/../copy.safetensors`` in the summary."""
    parallel_dcp.save({"w": torch.randn(8, 8)}, tmp_path / "model", workers=1)
    assert cli.main(["convert", str(tmp_path / "model"), str(tmp_path / "model" / ".." / "copy.safetensors")]) == 0
    summary = capsys.readouterr().out
    assert "0.00 GiB/s" not in summary and "/s," in summary, summary
    assert f"-> {tmp_path / 'copy.safetensors'} " in summary and "/../" not in summary.split("->")[1], summary


def test_inspect_prints_no_stored_ratio_for_an_uncompressed_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parallel_dcp.save({"w": torch.randn(8, 8)}, tmp_path / "ckpt", workers=1)
    assert cli.main(["inspect", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "stored/logical" not in out and "stored " not in out, out


def test_no_document_opens_a_code_block_with_two_backticks() -> None:
    """Friction 11: docs/architecture.md's data-flow diagram opened and closed with ``."""
    root = Path(__file__).resolve().parent.parent
    broken = [
        f"{doc.relative_to(root)}:{number}"
        for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
        if line.strip() == "``"
    ]
    assert not broken, broken


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["convert", "SRC", "DST", "--rename", "abc"], "argument --rename: a rename rule is REGEX=TEMPLATE, got 'abc'"),
        (["convert", "SRC", "DST", "--rename", "(=x"], "argument --rename: bad regular expression '('"),
        (["convert", "SRC", "DST", "--keys", "re:(["], "argument --keys: bad regular expression in 're:(['"),
        (["convert", "SRC", "DST", "--quantize-keys", "re:(["], "argument --quantize-keys: bad regular expression"),
        (["inspect", "SRC", "--keys", "re:(["], "argument --keys: bad regular expression in 're:(['"),
        (
            ["convert", "SRC", "DST", "--rename-file", "/nonexistent/rules.json"],
            "argument --rename-file: cannot read /nonexistent/rules.json: no such file or directory",
        ),
        (["convert", "SRC", "DST", "--dtype", "int4"], "argument --dtype: unknown dtype 'int4'"),
    ],
)
def test_bad_flag_values_exit_2_and_name_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    """Friction 1: they exited 1 without naming the flag (or printed a raw ``[Errno 2] ...``)."""
    parallel_dcp.save({"w": torch.ones(2)}, tmp_path / "src", workers=1)
    argv = [str(tmp_path / "src") if a == "SRC" else str(tmp_path / "dst") if a == "DST" else a for a in argv]
    with pytest.raises(SystemExit) as caught:
        cli.main(argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert said in err, err
    assert "Errno" not in err and not (tmp_path / "dst").exists()


def test_a_rules_file_that_is_not_rules_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rules = tmp_path / "rules.json"
    rules.write_text('{"a": "b"}')
    with pytest.raises(SystemExit) as caught:
        cli.main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--rename-file", str(rules)])
    assert caught.value.code == 2
    assert "argument --rename-file: " in capsys.readouterr().err


def test_a_rename_collision_lists_ten_names_and_a_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Friction 2: a collision printed all 96 names on one ~5,000-character line."""
    parallel_dcp.save({f"model.layers.{i}.weight": torch.ones(1) for i in range(96)}, tmp_path / "src", workers=1)
    code = cli.main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--rename", r".*=x", "-q"])
    err = capsys.readouterr().err
    assert code == 1
    assert "... and 86 more" in err, err
    assert max(len(line) for line in err.splitlines()) < 500, err
    with pytest.raises(parallel_dcp.RenameError) as caught:
        parallel_dcp.convert(tmp_path / "src", tmp_path / "dst", rename=[(r".*", "x")], workers=1)
    assert len(caught.value.collisions["x"]) == 96  # the error object keeps them all


def test_the_cli_knows_the_dtype_names_the_library_takes() -> None:
    """Friction 5: --dtype is checked without importing torch, against the same names."""
    from parallel_dcp.cli.flags import DTYPE_NAMES
    from parallel_dcp.jobs.convert import _DTYPES

    assert sorted(DTYPE_NAMES) == sorted(_DTYPES)
