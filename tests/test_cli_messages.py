"""The command line's manners (issue 25, items 8 and 10; issue 24, item 14): a closed pipe ends
quietly, messages name flags, warnings are one line, counts agree with their nouns, install lines
work from a checkout, and names with control characters are escaped in every text output (the
``--json`` output keeps them exact)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch as st
import tomllib
import torch

import parallel_dcp
from parallel_dcp import cli
from parallel_dcp.cli import messages

ROOT = Path(__file__).resolve().parent.parent
EVIL = "w\x1b]0;pwned\x07\x1b[2J\nparallel-dcp: OK"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "parallel_dcp", *args], capture_output=True, text=True, env=env, timeout=300
    )


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def evil(tmp_path: Path) -> Path:
    st.save_file({EVIL: torch.ones(64, 4), "b": torch.zeros(2)}, tmp_path / "evil.safetensors")
    return tmp_path / "evil.safetensors"


def _clean(text: str) -> bool:
    """No raw control character but the line breaks the output itself makes, and no forged line."""
    return not re.search(r"[\x00-\x09\x0b-\x1f\x7f]", text) and not any(
        line.startswith("parallel-dcp: OK") for line in text.splitlines()
    )


@pytest.mark.parametrize("args", [["inspect", "--keys"], ["inspect", "--json"]])
def test_a_closed_pipe_ends_quietly(evil: Path, args: list[str]) -> None:
    """``parallel-dcp inspect X --json | head -1``: the reader is gone before the output is written."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    command, *flags = args
    proc = subprocess.Popen(
        [sys.executable, "-m", "parallel_dcp", command, str(evil), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # as `head -1` does once it has its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) in (0, 141)
    assert err == "", err


def test_messages_name_flags_not_keywords(evil: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _main(capsys, "convert", str(evil), str(tmp_path / "out"), "--workers", "1", "-q")[0] == 0
    code, _, err = _main(capsys, "convert", str(evil), str(tmp_path / "out"), "--workers", "1")
    assert code == 1 and "--overwrite" in err
    assert "overwrite=True" not in err and "convert(..." not in err
    # the dry run's notes too
    code, out, _ = _main(capsys, "convert", str(evil), str(tmp_path / "out"), "--dry-run")
    assert code == 0 and "without --overwrite" in out and "overwrite=True" not in out
    # and the library keeps both for Python callers
    with pytest.raises(parallel_dcp.CheckpointExistsError, match=r"overwrite=True \(--overwrite\)"):
        parallel_dcp.convert(evil, tmp_path / "out", workers=1)


@pytest.mark.parametrize(
    ("library", "command_line"),
    [
        ("pass overwrite=True (--overwrite) to replace it", "pass --overwrite to replace it"),
        ("run the same command with --resume (convert(..., resume=True)) to continue", "with --resume to continue"),
        ("which convert(..., resume=True) (--resume) would have kept", "which --resume would have kept"),
        ("run it without distributed (--distributed)", "run it without --distributed"),
        ("select tensors only with keys= (--keys)", "select tensors only with --keys"),
        ("convert with copy_files=False (--no-copy-files) and", "convert with --no-copy-files and"),
        ("(pass overwrite=True to replace it)", "(pass --overwrite to replace it)"),
        ("files that need weights_only=False (runs", "files that need weights_only=False (runs"),
    ],
)
def test_keywords_become_flags(library: str, command_line: str) -> None:
    assert command_line in messages.as_flags(library)


def test_warnings_print_as_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    warning = UserWarning("first line\n  second line: overwrite=True (--overwrite)")
    messages.show_warning(warning, UserWarning, "x.py", 3)
    err = capsys.readouterr().err
    assert err == "parallel-dcp: warning: first line second line: --overwrite\n"


def test_counts_agree_with_their_nouns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    st.save_file({"only": torch.ones(4)}, tmp_path / "one.safetensors")
    code, out, _ = _main(capsys, "convert", str(tmp_path / "one.safetensors"), str(tmp_path / "o.pt"), "--workers", "1")
    assert code == 0 and "1 key," in out and "in 1 file," in out and "1 worker," in out
    assert not re.search(r"\b1 (keys|files|workers)\b", out)
    code, out, _ = _main(capsys, "inspect", str(tmp_path / "one.safetensors"))
    assert "1 key (1 tensor)" in out and "1 file" in out and "1 files" not in out
    code, out, _ = _main(capsys, "verify", str(tmp_path / "o.pt"), "--against", str(tmp_path / "one.safetensors"))
    assert code == 0 and "1 key read back" in out


def test_install_lines_work_from_a_checkout() -> None:
    """Nothing tells users to install 'parallel_dcp[...]' (not on any index); every extra named
    (pip install '.[name]') exists; the demo's environment has the zstd extra."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = set()
    for path in [*(ROOT / "parallel_dcp").rglob("*.py"), ROOT / "tools" / "demo", ROOT / "tools" / "_setup.sh"]:
        text = path.read_text()
        assert "parallel_dcp[" not in text, path
        named |= set(re.findall(r"pip install '\.\[(\w+)\]'", text))
    assert named and named <= set(extras), named
    demo = (ROOT / "tools" / "demo").read_text()
    setup = re.search(r'_setup\.sh"\s+"([^"]*)"', demo)
    assert setup is not None and "zstd" in setup.group(1).split(",")
    assert "zstandard" in " ".join(extras["zstd"])
    shown = subprocess.run(
        [sys.executable, "-m", "parallel_dcp", "convert", "--help"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=120,
    ).stdout
    assert "pip install '.[zstd]'" in " ".join(shown.split())


def test_control_characters_are_escaped_in_text_and_exact_in_json(
    evil: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outputs = []
    for argv in (
        ["inspect", str(evil)],
        ["inspect", str(evil), "--keys"],
        ["convert", str(evil), str(tmp_path / "plan"), "--dry-run", "--chunk-size", "256", "--workers", "2"],
    ):
        code, out, err = _main(capsys, *argv)
        assert code == 0, err
        outputs.append(out + err)
    parallel_dcp.convert(evil, tmp_path / "dcp", workers=1, dtype="bf16")
    code, out, err = _main(capsys, "verify", str(tmp_path / "dcp"), "--against", str(evil))
    assert code == 1
    outputs.append(out + err)
    code, out, err = _main(capsys, "convert", str(evil), str(tmp_path / "x"), "--keys", "nothing*")
    assert code == 1
    outputs.append(out + err)
    for text in outputs:
        assert _clean(text), text
        assert "w\\x1b]0;pwned\\x07\\x1b[2J\\nparallel-dcp: OK" in text, text

    code, out, _ = _main(capsys, "inspect", str(evil), "--json")
    assert EVIL in [e["key"] for e in json.loads(out)["key_list"]]
    code, out, _ = _main(capsys, "verify", str(tmp_path / "dcp"), "--against", str(evil), "--json")
    assert any(p.startswith(EVIL) for p in json.loads(out)["problems"])
