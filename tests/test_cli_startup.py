"""`parallel-dcp --help` and usage errors answer without importing torch (issue 25, item 9).

Checked through ``sys.modules`` in a fresh interpreter, never by timing: importing torch takes
seconds, and nothing before a command runs may need it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _fresh(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


_REPORT = (
    "import json, sys; print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))))"
)


def test_building_the_parser_imports_no_torch() -> None:
    done = _fresh(f"import parallel_dcp.cli as cli; cli.build_parser().format_help(); {_REPORT}")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["convert", "--help"],
        ["inspect", "--help"],
        ["verify", "--help"],
        ["bench", "--help"],
        ["convert"],  # usage error: exit 2
        ["convert", "a", "b", "--overwite"],  # usage error with a suggestion
        # Bad flag values (issue 31, frictions 1 and 5): refused before torch is imported.
        ["convert", "a", "b", "--dtype", "int4"],
        ["convert", "a", "b", "--rename", "abc"],
        ["convert", "a", "b", "--rename", "(=x"],
        ["convert", "a", "b", "--keys", "re:(["],
        ["convert", "a", "b", "--rename-file", "/nonexistent/rules.json"],
        ["inspect", "a", "--keys", "re:(["],
    ],
)
def test_help_and_usage_errors_import_no_torch(argv: list[str]) -> None:
    code = (
        "import atexit, sys\n"
        f"atexit.register(lambda: sys.__stderr__.write('TORCH=' + str('torch' in sys.modules) + chr(10)))\n"
        "from parallel_dcp.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    done = _fresh(code)
    assert done.returncode in (0, 2), done.stderr
    assert "TORCH=False" in done.stderr, done.stderr


def test_the_api_still_serves_every_exported_name() -> None:
    """The lazily imported names behave as before: in __all__, importable, and in dir()."""
    done = _fresh(
        "import parallel_dcp, sys\n"
        "assert 'torch' not in sys.modules\n"
        "from parallel_dcp import FastReader, SaveResult, partial_save\n"
        "missing = [n for n in parallel_dcp.__all__ if not hasattr(parallel_dcp, n)]\n"
        "assert missing == [], missing\n"
        "assert set(parallel_dcp.__all__) <= set(dir(parallel_dcp))\n"
        "assert SaveResult.__module__ == 'parallel_dcp.jobs.pipeline'\n"
        "print('ok')\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        import parallel_dcp

        parallel_dcp.nope  # noqa: B018


def test_cli_format_names_are_the_registry() -> None:
    from parallel_dcp import cli
    from parallel_dcp.formats import FORMATS

    assert cli.FORMATS == FORMATS
