"""torch's warnings meant for trainers never reach the CLI's output (a real subprocess of the CLI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import parallel_dcp

WARNING = "torch.distributed is disabled"

# Runs the real CLI (python -m parallel_dcp) with stock DCP called where parallel_dcp works: a
# stock dcp.save in every worker task and a stock dcp.load in the coordinator's commit, each of
# which warns outside a process group. With BEFORE=1 one stock save also runs before the CLI
# starts, proving the warning would be printed when nothing hides it.
SCRIPT = """
import os, runpy, sys, tempfile, torch
import torch.distributed.checkpoint as dcp
import parallel_dcp.jobs.targets as targets

scratch = tempfile.mkdtemp()

def stock_save(tag):
    dcp.save({"x": torch.zeros(2)}, checkpoint_id=os.path.join(scratch, f"{tag}-{os.getpid()}"))

if os.environ.get("BEFORE") == "1":
    stock_save("before")

write, commit = targets.DcpTarget.write, targets.DcpTarget.commit

def write_and_warn(self, *args, **kwargs):
    stock_save("worker")
    return write(self, *args, **kwargs)

def commit_and_warn(self, *args, **kwargs):
    stock_save("commit")
    dcp.load({"x": torch.zeros(2)}, checkpoint_id=os.path.join(scratch, f"commit-{os.getpid()}"))
    return commit(self, *args, **kwargs)

targets.DcpTarget.write, targets.DcpTarget.commit = write_and_warn, commit_and_warn
sys.argv = ["parallel-dcp", *sys.argv[1:]]
runpy.run_module("parallel_dcp", run_name="__main__", alter_sys=True)
"""


def _cli(args: list[str], before: bool) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent), BEFORE="1" if before else "0")
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, env=env, timeout=120)


def test_trainer_warnings_do_not_reach_the_cli_output(tmp_path: Path) -> None:
    parallel_dcp.save({"a": torch.ones(8), "b": {"c": torch.zeros(3)}}, tmp_path / "src", workers=2)
    run = _cli(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--workers", "2"], before=False)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "out" / ".metadata").is_file()
    assert WARNING not in run.stdout + run.stderr, run.stderr
    for command in (
        ["verify", str(tmp_path / "out"), "--against", str(tmp_path / "src")],
        ["inspect", str(tmp_path / "out")],
    ):
        run = _cli(command, before=False)
        assert run.returncode == 0 and WARNING not in run.stdout + run.stderr, run.stderr

    # the control: the same script shows the warning when it is raised before the CLI runs
    control = _cli(["inspect", str(tmp_path / "out")], before=True)
    assert control.returncode == 0 and WARNING in control.stderr
