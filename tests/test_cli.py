"""The parallel-dcp command end to end, as a user runs it: exit codes, JSON, messages, verify.

The commands run in this process (``main(argv)``, as ``python -m parallel_dcp`` runs it, a usage
error's SystemExit included): a fresh interpreter importing torch costs 3-6 s a command on this VM,
and what these tests check is the commands' output, codes and files. The program itself, as a
process, is run by test_usage_errors_exit_2_and_failures_exit_1 (a usage error and a failure, each
with its exit code and no traceback) and by tests/test_cli_startup.py.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
import torch.distributed.checkpoint as dcp

import parallel_dcp
from tests.cli_in_process import run_in_process
from tests.conftest import assert_same


def program(*args: str | Path, check_code: int | None = 0) -> subprocess.CompletedProcess[str]:
    """``python -m parallel_dcp ARGS`` in a fresh interpreter, its exit code checked."""
    done = subprocess.run(
        [sys.executable, "-m", "parallel_dcp", *map(str, args)], capture_output=True, text=True, timeout=300
    )
    if check_code is not None:
        assert done.returncode == check_code, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    """A command run in this process as the program runs it (``sys.exit(main(argv))``), its exit
    code checked against ``check_code`` (None: not checked)."""

    return functools.partial(run_in_process, capsys)


Cli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def model(tmp_path: Path) -> dict[str, torch.Tensor]:
    tensors = {f"layers.{i}.weight": torch.randn(64, 32) for i in range(6)} | {"embed": torch.randn(300, 32).half()}
    st.save_file(tensors, tmp_path / "model.safetensors")
    return tensors


def test_convert_inspect_verify_as_a_user_runs_them(tmp_path: Path, model: dict[str, torch.Tensor], cli: Cli) -> None:
    out = cli("convert", tmp_path / "model.safetensors", tmp_path / "dcp", "--workers", "2", "--json").stdout
    summary = json.loads(out)
    assert summary[0]["format"] == "dcp" and summary[0]["keys"] == len(model) and summary[0]["bytes"] > 0
    phases = summary[0]["phases"]
    assert set(phases) == {"plan", "fork", "write", "merge", "commit"} and min(phases.values()) >= 0
    assert phases["write"] > 0 and sum(phases.values()) <= summary[0]["seconds"] + 0.01

    info = json.loads(cli("inspect", tmp_path / "dcp", "--json").stdout)
    assert info["format"] == "dcp" and info["committed"] and info["manifest"]
    assert info["tensors"] == len(model) and info["total_bytes"] == sum(t.nbytes for t in model.values())
    assert info["largest"][0]["key"] == "embed" and info["dtypes"]["float16"]["tensors"] == 1
    assert "committed" in cli("inspect", tmp_path / "dcp").stdout

    ok = cli("verify", tmp_path / "dcp", "--against", tmp_path / "model.safetensors", "--workers", "2")
    assert "OK" in ok.stdout

    cli("convert", tmp_path / "dcp", tmp_path / "back", "--to", "safetensors", "-q")
    assert_same(st.load_file(tmp_path / "back" / "model.safetensors"), model)


def flip_one_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_verify_finds_a_flipped_byte_that_stock_dcp_loads_silently(
    tmp_path: Path, model: dict[str, torch.Tensor], cli: Cli
) -> None:
    parallel_dcp.convert(tmp_path / "model.safetensors", tmp_path / "dcp", workers=1)
    metadata = parallel_dcp.load_metadata(dcp.FileSystemReader(str(tmp_path / "dcp")))
    info = next(i for idx, i in metadata.storage_data.items() if idx.fqn == "embed")
    shard = tmp_path / "dcp" / info.relative_path
    at = shard.read_bytes().find(model["embed"].numpy().tobytes()[:256])
    assert at > 0
    flip_one_byte(shard, at + 10)  # inside embed's tensor bytes

    target = {k: torch.empty_like(v) for k, v in model.items()}
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)  # stock DCP: no complaint
    assert not torch.equal(target["embed"], model["embed"])

    failed = cli("verify", tmp_path / "dcp", "--json", check_code=1)
    report = json.loads(failed.stdout)
    assert not report["ok"] and any(shard.name in p and "checksum" in p for p in report["problems"])
    against = cli("verify", tmp_path / "dcp", "--against", tmp_path / "model.safetensors", check_code=1).stdout
    assert "FAILED" in against and "embed: data differs" in against


def test_verify_finds_a_truncated_shard(tmp_path: Path, model: dict[str, torch.Tensor], cli: Cli) -> None:
    parallel_dcp.convert(tmp_path / "model.safetensors", tmp_path / "dcp", workers=2)
    shard = next((tmp_path / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    out = cli("verify", tmp_path / "dcp", check_code=1).stdout
    assert f"file {shard.name}:" in out and "truncated" in out


def test_usage_errors_exit_2_and_failures_exit_1(tmp_path: Path, model: dict[str, torch.Tensor], cli: Cli) -> None:
    assert "usage" in program(check_code=2).stderr  # the program itself: exit 2, usage on stderr
    assert "at least one SRC and a DST" in cli("convert", tmp_path / "model.safetensors", check_code=2).stderr
    assert "invalid choice" in cli("convert", "a", "b", "--to", "onnx", check_code=2).stderr
    missing = program("convert", tmp_path / "nope.pt", tmp_path / "out", check_code=1)  # exit 1, no traceback
    assert "parallel-dcp: error: no such file" in missing.stderr and "Traceback" not in missing.stderr
    cli("convert", tmp_path / "model.safetensors", tmp_path / "dcp", "-q")
    exists = cli("convert", tmp_path / "model.safetensors", tmp_path / "dcp", check_code=1)
    assert "already holds a checkpoint" in exists.stderr and "--overwrite" in exists.stderr
    limit = cli("convert", tmp_path / "model.safetensors", tmp_path / "x", "--memory-limit", "lots", check_code=2)
    assert "not a size" in limit.stderr  # a bad value is a usage error (exit 2), caught before any work


def test_batch_conversion_from_the_command_line(tmp_path: Path, model: dict[str, torch.Tensor], cli: Cli) -> None:
    torch.save({"w": torch.ones(3)}, tmp_path / "other.pt")
    out = cli("convert", tmp_path / "model.safetensors", tmp_path / "other.pt", tmp_path / "all", "--dtype", "bf16")
    assert out.stdout.count(" -> ") == 2
    loaded = parallel_dcp.load(tmp_path / "all" / "model")
    assert loaded["embed"].dtype == torch.bfloat16
    assert_same(parallel_dcp.load(tmp_path / "all" / "other"), {"w": torch.ones(3, dtype=torch.bfloat16)})


def test_without_checksums_verify_still_finds_truncation(
    tmp_path: Path, model: dict[str, torch.Tensor], cli: Cli
) -> None:
    cli("convert", tmp_path / "model.safetensors", tmp_path / "dcp", "--no-checksums", "-q")
    manifest = json.loads((tmp_path / "dcp" / ".parallel_dcp.json").read_text())
    assert all(set(entry) == {"size"} for entry in manifest["files"].values())
    assert "OK" in cli("verify", tmp_path / "dcp").stdout
    shard = next((tmp_path / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    assert "truncated" in cli("verify", tmp_path / "dcp", check_code=1).stdout
