"""What a newcomer meets first: verify under the limit convert ran under, counts that agree, shard
sizes, file modes, usage errors, the progress bar, the help text, and CI running the README."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

import parallel_dcp
from parallel_dcp import cli
from parallel_dcp.engine import progress
from tests.cli_in_process import run_in_process
from tests.memory_probe import PeakSampler

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    """A command run in this process, as ``python -m parallel_dcp`` runs it (``sys.exit(main())``,
    a usage error's SystemExit included), its exit code checked against ``check_code`` (None: not
    checked). These tests check the commands' output; tests/test_cli.py and test_cli_startup.py
    run the program itself."""

    return functools.partial(run_in_process, capsys)


def test_verify_works_under_the_limit_the_conversion_ran_under(tmp_path: Path) -> None:
    """The embedding is larger than the limit: convert splits it; verify must compare it in row
    ranges on both sides rather than refuse (the demo failed exactly here)."""
    tensors = {"embed": torch.randn(24 * 1024, 1024)} | {f"layer{i}": torch.randn(256, 256) for i in range(4)}
    st.save_file(tensors, tmp_path / "model.safetensors")
    limit = 64 * MiB  # the embedding alone is 96 MiB
    parallel_dcp.convert(tmp_path / "model.safetensors", tmp_path / "dcp", workers=2, memory_limit=limit)
    with PeakSampler() as sampler:
        report = parallel_dcp.verify(tmp_path / "dcp", against=tmp_path / "model.safetensors", memory_limit=limit)
    assert report.ok, report.problems
    assert report.bytes_checked == sum(t.nbytes for t in tensors.values())
    assert sampler.peak < limit, f"verify added {sampler.peak / MiB:.1f} MiB under a {limit / MiB:.0f} MiB limit"

    # A difference deep inside the split tensor is still found, at its place in the whole tensor.
    changed = dict(tensors)
    changed["embed"] = tensors["embed"].clone()
    changed["embed"][20000, 7] += 1.0
    st.save_file(changed, tmp_path / "changed.safetensors")
    report = parallel_dcp.verify(tmp_path / "dcp", against=tmp_path / "changed.safetensors", memory_limit=limit)
    assert report.problems == [f"embed: data differs (first at element {20000 * 1024 + 7})"]


def test_keys_and_files_are_counted_the_same_by_convert_and_inspect(
    tmp_path: Path, run_cli: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    tensors = {f"layer{i}": torch.randn(512, 256) for i in range(9)} | {"embed": torch.randn(4096, 256)}
    st.save_file(tensors, tmp_path / "model.safetensors")
    result = parallel_dcp.convert(tmp_path / "model.safetensors", tmp_path / "dcp", workers=2, chunk_size="1MiB")
    assert isinstance(result, parallel_dcp.SaveResult)
    info = parallel_dcp.inspect(tmp_path / "dcp")
    assert result.keys == info["keys"] == len(tensors), "keys, not the chunks the embedding was split into"
    assert result.files == len(info["files"]) == len(list((tmp_path / "dcp").glob("*.distcp"))) + 1

    sharded = parallel_dcp.convert(tmp_path / "dcp", tmp_path / "hf", to="safetensors", shard_size="2MB")
    assert isinstance(sharded, parallel_dcp.SaveResult)
    info = parallel_dcp.inspect(tmp_path / "hf")
    assert sharded.keys == info["keys"] == len(tensors)
    assert sharded.files == len(info["files"]) == len(list((tmp_path / "hf").glob("*.safetensors"))) + 1  # + index

    printed = run_cli("convert", tmp_path / "model.safetensors", tmp_path / "cli-dcp", "--chunk-size", "1MiB").stdout
    described = run_cli("inspect", tmp_path / "cli-dcp").stdout
    converted = re.search(r"(\d+) keys, .* in (\d+) files", printed)
    inspected = re.search(r"(\d+) keys \(.*\), .*, (\d+) files", described)
    assert converted and inspected, (printed, described)
    assert converted.groups() == inspected.groups() == (str(len(tensors)), str(result.files))


def test_shards_are_filled_up_to_the_size_asked_for(tmp_path: Path) -> None:
    """In key order, as Hugging Face shards: a shard takes the next tensor while it stays under the
    size; a tensor larger than the size gets a shard of its own."""
    sizes = [3, 2, 2, 1, 6, 1, 1, 2, 3, 1, 1, 2]  # in units of 256 KiB rows of floats
    tensors = {f"t{i:02d}": torch.randn(n * 64, 1024) for i, n in enumerate(sizes)}
    st.save_file(tensors, tmp_path / "model.safetensors")
    shard_size = 5 * 256 * 1024
    parallel_dcp.convert(tmp_path / "model.safetensors", tmp_path / "hf", to="safetensors", shard_size=shard_size)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards: dict[str, list[str]] = {}
    for key, name in index["weight_map"].items():
        shards.setdefault(name, []).append(key)
    expected, size = [[]], 0  # what Hugging Face's greedy in-order fill gives
    for key, tensor in tensors.items():
        if expected[-1] and size + tensor.nbytes > shard_size:
            expected.append([])
            size = 0
        expected[-1].append(key)
        size += tensor.nbytes
    assert [shards[name] for name in sorted(shards)] == expected  # [3+2] [2+1] [6] [1+1+2] [3+1+1] [2]


def test_every_output_file_gets_the_mode_the_umask_gives(tmp_path: Path) -> None:
    tensors = {f"w{i}": torch.randn(300, 300) for i in range(6)}
    old = os.umask(0o022)
    try:
        parallel_dcp.save(tensors, tmp_path / "dcp", workers=2)
        parallel_dcp.convert(tmp_path / "dcp", tmp_path / "hf", to="safetensors", shard_size="1MB", workers=2)
        parallel_dcp.convert(tmp_path / "dcp", tmp_path / "one.safetensors", workers=2)
        parallel_dcp.convert(tmp_path / "dcp", tmp_path / "bins", to="torch", shard_size="1MB", workers=2)
        parallel_dcp.convert(tmp_path / "dcp", tmp_path / "one.pt", workers=2)
    finally:
        os.umask(old)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 15
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {"0o644"}, modes


def test_verify_after_a_dtype_cast_compares_against_the_cast_reference(
    tmp_path: Path, run_cli: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    tensors = {f"w{i}": torch.randn(64, 64) for i in range(5)} | {"ids": torch.arange(10)}
    st.save_file(tensors, tmp_path / "model.safetensors")
    parallel_dcp.convert(tmp_path / "model.safetensors", tmp_path / "bf16", dtype="bf16", workers=2)
    assert parallel_dcp.verify(tmp_path / "bf16", against=tmp_path / "model.safetensors", dtype="bf16").ok

    plain = parallel_dcp.verify(tmp_path / "bf16", against=tmp_path / "model.safetensors")
    assert plain.problems == [f"w{i}: dtype bfloat16 != float32" for i in range(5)], "sorted by key"
    assert (
        "OK"
        in run_cli("verify", tmp_path / "bf16", "--against", tmp_path / "model.safetensors", "--dtype", "bf16").stdout
    )
    failed = run_cli("verify", tmp_path / "bf16", "--against", tmp_path / "model.safetensors", check_code=1).stdout
    assert failed.index("w0: dtype") < failed.index("w4: dtype")
    with pytest.raises(ValueError, match="needs against"):
        parallel_dcp.verify(tmp_path / "bf16", dtype="bf16")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], r"argument --workers: must be at least 1, got 0"),
        (["--dtype", "int4"], r"argument --dtype: unknown dtype 'int4'"),
        (["--memory-limit", "lots"], r"argument --memory-limit: not a size: 'lots'"),
        (["--shard-size", "big"], r"argument --shard-size: not a size"),
        (["--overwite"], r"unrecognized arguments: --overwite \(did you mean --overwrite\?\)"),
    ],
    ids=["workers-0", "dtype-int4", "memory-limit-lots", "shard-size", "misspelled-flag"],
)
def test_usage_errors_exit_2_with_the_subcommands_usage(
    tmp_path: Path, args: list[str], message: str, run_cli: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    done = run_cli("convert", tmp_path / "src.safetensors", tmp_path / "dst", *args, check_code=2)
    assert done.stderr.startswith("usage: parallel-dcp convert "), done.stderr
    assert re.search(message, done.stderr), done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing was written"


def test_verify_and_inspect_usage_errors_exit_2(
    tmp_path: Path, run_cli: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    done = run_cli("verify", tmp_path, "--workrs", "2", check_code=2)
    assert done.stderr.startswith("usage: parallel-dcp verify ") and "did you mean --workers?" in done.stderr
    done = run_cli("inspect", check_code=2)
    assert done.stderr.startswith("usage: parallel-dcp inspect ")


def test_the_progress_bar_names_the_job_and_uses_binary_units(capsys: pytest.CaptureFixture[str]) -> None:
    with progress.Progress(total=3 * 2**30, enabled=True, desc="convert") as bar:
        progress.report(3 * 2**29)
        progress.flush()
        bar.refresh()
    shown = capsys.readouterr().err
    assert "convert: " in shown and "3.0 GiB / 3.0 GiB" in shown and "iB/s" in shown, shown
    assert "1.5 GiB / 3.0 GiB" in progress.describe_progress(3 * 2**29, 3 * 2**30, 1.0)
    assert ", 1.5 GiB/s, 1 s left" in progress.describe_progress(3 * 2**29, 3 * 2**30, 1.0)


def test_help_ends_with_examples_and_names_the_output_rule(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    top = capsys.readouterr().out.rstrip().splitlines()
    assert len([line for line in top[-3:] if line.strip().startswith("parallel-dcp ")]) == 3, top[-4:]
    with pytest.raises(SystemExit):
        cli.main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "*.safetensors is one safetensors file" in text and "a sharded directory" in text


def test_ci_runs_the_readme_quick_start_commands_as_written() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.strip().splitlines()]
    assert commands == ["tools/demo", "tools/test"]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "tools/demo" in ci, "CI runs the demo at its defaults, exactly as the README shows it"
    assert any(line.startswith("tools/test") for line in ci) and ci.index("tools/demo") < len(ci) - 1
    for tool in ("tools/demo", "tools/test", ".ci/run"):
        assert os.access(ROOT / tool, os.X_OK), f"{tool} is not executable"


def test_ci_runs_the_client_suite_after_the_main_suite() -> None:
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    main = next(i for i, line in enumerate(ci) if line.startswith("tools/test "))
    clients = next(i for i, line in enumerate(ci) if line.startswith("tools/test-clients"))
    assert main < clients, "the client suite runs after the main suite"
    assert os.access(ROOT / "tools" / "test-clients", os.X_OK), "tools/test-clients is not executable"
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert ".venv-clients-*/" in ignored, "the client venvs are not git-ignored"


def test_pyproject_uses_the_spdx_license_string() -> None:
    """The table form makes every install print setuptools' deprecation block."""
    assert re.search(r'^license = "BSD-3-Clause"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
