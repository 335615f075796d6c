"""Ctrl-C at any moment of a command: one line, exit code 130, nothing committed; never a
traceback, a worker's "Exception ignored", or a Ctrl-C swallowed (issue 31, friction 3).

Each moment is reached by a hook in the child (an import of torch that waits, a fork that
signals itself), found by a marker file the parent polls for: no sleeps decide the timing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import parallel_dcp

ROOT = Path(__file__).resolve().parent.parent

# A finder that, when torch is first imported, writes the marker and waits (the import of torch
# takes seconds in a real run: Ctrl-C lands there most often).
_SLOW_TORCH = """
import importlib.abc, pathlib, sys, time
class SlowTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            pathlib.Path(MARKER).write_text("importing torch")
            time.sleep(120)
        return None
sys.meta_path.insert(0, SlowTorch())
"""

# A finder that waits inside the package's own import, before the command's main() has run (the
# window in which a Ctrl-C used to print a KeyboardInterrupt traceback).
_SLOW_PACKAGE = """
import importlib.abc, pathlib, sys, time
class SlowPackage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "parallel_dcp.api":
            sys.meta_path.remove(self)
            pathlib.Path(MARKER).write_text("importing parallel_dcp")
            time.sleep(120)
        return None
sys.meta_path.insert(0, SlowPackage())
"""

# A fork that signals both sides at once: the parent right after the fork, the worker at its
# first instant (as a Ctrl-C to the process group does while workers start).
_FORK_SIGNALS = """
import os, pathlib, signal
real_fork = os.fork
def fork():
    pid = real_fork()
    pathlib.Path(MARKER).write_text("forked")
    os.kill(os.getpid(), signal.SIGINT)
    return pid
os.fork = fork
"""

# Ctrl-C just after the conversion committed (the summary and the interpreter's exit remain).
_AFTER_THE_JOB = """
import os, pathlib, signal
import parallel_dcp.cli.interrupt as interrupt
real_finished = interrupt.finished
def finished():
    real_finished()
    if not pathlib.Path(MARKER).exists():
        pathlib.Path(MARKER).write_text("done")
        os.kill(os.getpid(), signal.SIGINT)
interrupt.finished = finished
"""


def _run(tmp_path: Path, hook: str, argv: list[str], *, signal_on_marker: bool) -> tuple[int, str]:
    marker = tmp_path / "marker"
    code = (
        f"MARKER = {str(marker)!r}\n{hook}\nimport sys\nsys.argv = ['parallel-dcp', *{argv!r}]\n"
        "from parallel_dcp.cli import main\nsys.exit(main())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        if signal_on_marker:
            deadline = time.monotonic() + 120
            while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            assert marker.exists(), "the hook never ran"
            os.killpg(proc.pid, signal.SIGINT)  # as the terminal sends it: the whole group
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, err


@pytest.fixture
def source(tmp_path: Path) -> Path:
    parallel_dcp.save({f"w{i}": torch.randn(64, 64) for i in range(8)}, tmp_path / "src", workers=1)
    return tmp_path / "src"


def test_ctrl_c_while_torch_imports_is_one_line_and_130(tmp_path: Path, source: Path) -> None:
    code, err = _run(tmp_path, _SLOW_TORCH, ["convert", str(source), str(tmp_path / "dst")], signal_on_marker=True)
    assert code == 130, err
    assert err.strip() == "parallel-dcp: interrupted; nothing was committed", err
    assert not (tmp_path / "dst" / ".metadata").exists()


def test_ctrl_c_while_the_package_imports_is_one_line_and_130(tmp_path: Path, source: Path) -> None:
    code, err = _run(tmp_path, _SLOW_PACKAGE, ["convert", str(source), str(tmp_path / "dst")], signal_on_marker=True)
    assert code == 130, err
    assert err.strip() == "parallel-dcp: interrupted", err
    assert not (tmp_path / "dst").exists()


def test_a_library_import_keeps_the_callers_sigint_handling() -> None:
    """Only the command takes SIGINT while it imports: a program importing parallel_dcp keeps
    Python's own handler (its Ctrl-C raises KeyboardInterrupt as before)."""
    code = (
        "import signal; before = signal.getsignal(signal.SIGINT)\n"
        "import parallel_dcp; print(signal.getsignal(signal.SIGINT) is before)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "True", out.stderr


def test_ctrl_c_while_workers_fork_stops_the_job(tmp_path: Path, source: Path) -> None:
    argv = ["convert", str(source), str(tmp_path / "dst"), "--workers", "2", "-q"]
    code, err = _run(tmp_path, _FORK_SIGNALS, argv, signal_on_marker=False)
    assert (tmp_path / "marker").exists(), "no worker was forked"
    assert code == 130, err
    assert "Exception ignored" not in err and "Traceback" not in err, err
    # One line, from the coordinator alone: a worker that took the Ctrl-C at its first instant
    # ran on as a copy of the coordinator (its own message, its own cleanup).
    assert err.strip() == "parallel-dcp: interrupted; nothing was committed", err
    assert not (tmp_path / "dst" / ".metadata").exists()


def test_ctrl_c_just_after_the_job_keeps_its_exit_code(tmp_path: Path, source: Path) -> None:
    argv = ["convert", str(source), str(tmp_path / "dst"), "--workers", "1", "-q"]
    code, err = _run(tmp_path, _AFTER_THE_JOB, argv, signal_on_marker=False)
    assert (tmp_path / "marker").exists()
    assert code == 0, err
    assert "Traceback" not in err and "interrupted" not in err, err
    assert parallel_dcp.verify(tmp_path / "dst", workers=1).ok


@pytest.mark.parametrize("command", [["verify", "SRC"], ["inspect", "SRC", "--diff", "SRC"]])
def test_commands_that_write_nothing_do_not_say_nothing_was_committed(
    tmp_path: Path, source: Path, command: list[str]
) -> None:
    argv = [str(source) if a == "SRC" else a for a in command]
    code, err = _run(tmp_path, _SLOW_TORCH, argv, signal_on_marker=True)
    assert code == 130, err
    assert err.strip() == "parallel-dcp: interrupted", err


def test_after_the_command_the_interpreters_exit_ignores_ctrl_c(tmp_path: Path, source: Path) -> None:
    """Python puts a Python SIGINT handler back to the default action as it begins to tear down its
    modules (torch's take up to a second), and a Ctrl-C there killed the finished command by SIGINT
    (exit -2, nothing said, the checkpoint committed: review s17 rev2 F4). Once the command has
    finished, SIGINT is ignored by the kernel, which the exit leaves as it is."""
    code = (
        "import signal, sys\n"
        f"sys.argv = ['parallel-dcp', 'convert', {str(source)!r}, {str(tmp_path / 'dst')!r}, '-q']\n"
        "from parallel_dcp.cli import main\n"
        "code = main()\n"
        "print(f'after: {signal.getsignal(signal.SIGINT)!r}', file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "after: <Handlers.SIG_IGN: 1>" in run.stderr, run.stderr
    assert (tmp_path / "dst" / ".metadata").exists()
