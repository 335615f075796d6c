"""The program's commands run in the test's own process, as ``python -m parallel_dcp`` runs them
(``sys.exit(main(argv))``, a usage error's SystemExit included): a fresh interpreter importing torch
costs 3-6 s a command on this VM. The program itself stays tested in test_cli.py and
test_cli_startup.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from parallel_dcp.cli import main


def run_in_process(
    capsys: pytest.CaptureFixture[str], *args: str | Path, check_code: int | None = 0
) -> subprocess.CompletedProcess[str]:
    """One command's exit code and output, the code checked against ``check_code`` (None: not checked)."""
    argv = [str(a) for a in args]
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exited:
        code = 0 if exited.code is None else exited.code if isinstance(exited.code, int) else 1
    out, err = capsys.readouterr()
    if check_code is not None:
        assert code == check_code, f"exit {code}\nstdout:\n{out}\nstderr:\n{err}"
    return subprocess.CompletedProcess(argv, code, out, err)
