"""save()'s default for large in-memory state dicts: workers kept between calls, reading the
caller's memory (jobs/shared_workers.py); explicit executors and small saves as before."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

import parallel_dcp
from parallel_dcp.jobs import shared_workers
from tests.conftest import assert_same

MiB = 2**20


@pytest.fixture
def small_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_workers, "MIN_BYTES", 2 * MiB)  # the real 256 MiB is slow on 2 cores
    monkeypatch.setattr(shared_workers, "other_threads", lambda: True)  # as beside a data loader thread


def _state(scale: float = 1.0) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return {f"layer{i}": torch.randn(256, 1024) * scale for i in range(4)}  # 4 x 1 MiB


def test_small_saves_never_start_them(tmp_path: Path) -> None:
    result = parallel_dcp.save({"w": torch.ones(1000)}, tmp_path / "ckpt", workers=2)
    assert result.executor != "saver" and shared_workers._workers is None
    assert not psutil.Process().children()


def test_torchs_own_busy_threads_do_not_count() -> None:
    """torch's intra-op threads run native code without the GIL: after a burst of matmuls they
    have kept a core busy over their short life, yet they cannot convoy with writer threads."""
    code = (
        "import time, torch\n"
        "from parallel_dcp.jobs import shared_workers\n"
        "torch.set_num_threads(2)\n"
        "a = torch.randn(512, 512)\n"
        "end = time.monotonic() + 0.5\n"
        "while time.monotonic() < end:\n"
        "    a = (a @ a).tanh()\n"
        "print(shared_workers.other_threads())\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


def test_a_busy_thread_starved_of_a_core_still_counts() -> None:
    """On a loaded node a spinning data loader runs for a small share of its life (here one core
    shared with seven spinning processes: about an eighth), yet it takes the GIL whenever it runs:
    it counts by the time it wanted a core (ran + waited for one), not the time it got one."""
    code = (
        "import os, subprocess, sys, threading, time\n"
        "from parallel_dcp.jobs import shared_workers\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"  # this thread and what it starts
        # each hog spins only while this process lives: a test killed by its timeout leaves none
        "hog = 'import os, sys\\nwhile os.getppid() == int(sys.argv[1]): pass'\n"
        "hogs = [subprocess.Popen([sys.executable, '-c', hog, str(os.getpid())]) for _ in range(7)]\n"
        "stop = threading.Event()\n"
        "def spin():\n"
        "    while not stop.is_set():\n"
        "        sum(range(100))\n"
        "busy = threading.Thread(target=spin)\n"
        "busy.start()\n"
        "time.sleep(1.5)\n"
        "counted = shared_workers.other_threads()\n"
        "with open(f'/proc/self/task/{busy.native_id}/schedstat') as f:\n"
        "    ran = int(f.read().split()[0]) / 1e9\n"
        "stop.set(); busy.join()\n"
        "for proc in hogs:\n"
        "    proc.kill(); proc.wait()\n"
        "print(counted, ran < shared_workers.BUSY_SHARE * 1.5)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", "True"]  # counted, though it ran under BUSY_SHARE of its life


def test_many_small_tensors_are_not_walked_in_full(small_threshold: None) -> None:
    many = {f"k{i}": torch.ones(1) for i in range(10_000)}
    many["big"] = torch.ones(4 * MiB)  # beyond the walk's first values: not seen, not eligible
    options = parallel_dcp.Options()
    assert not shared_workers.eligible(many, options)
    assert shared_workers.eligible({"big": torch.ones(4 * MiB)}, options)
    assert not shared_workers.eligible({"big": torch.ones(4 * MiB)}, parallel_dcp.Options(executor="threads"))


def test_idle_workers_stop_by_themselves(
    tmp_path: Path, small_threshold: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_workers, "IDLE_SECONDS", 0.2)
    parallel_dcp.save(_state(), tmp_path / "ckpt", workers=1)
    deadline = time.monotonic() + 30
    while (shared_workers._workers is not None or psutil.Process().children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert shared_workers._workers is None
    assert not psutil.Process().children(), "the kept workers and their fork server are gone"


def test_a_fork_of_the_caller_starts_its_own(tmp_path: Path, small_threshold: None) -> None:
    sd = _state()
    parallel_dcp.save(sd, tmp_path / "parent", workers=1)
    parent_workers = shared_workers._workers
    assert parent_workers is not None
    pid = os.fork()
    if pid == 0:  # the child: its own workers, the parent's untouched
        code = 1
        try:
            result = parallel_dcp.save(sd, tmp_path / "child", workers=1)
            ours = shared_workers._workers
            code = 0 if ours is not parent_workers and result.executor == "saver" else 2
            shared_workers.stop()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert shared_workers._workers is parent_workers and parent_workers._pool is not None
    again = parallel_dcp.save(sd, tmp_path / "again", workers=1)
    assert again.executor == "saver"
    assert_same(parallel_dcp.load(tmp_path / "child"), sd)


def test_a_save_from_another_thread_meanwhile_runs_as_before(tmp_path: Path, small_threshold: None) -> None:
    sd = _state()
    results: dict[str, parallel_dcp.SaveResult] = {}
    with shared_workers._lock:  # the kept workers busy with another save
        thread = threading.Thread(target=lambda: results.update(r=parallel_dcp.save(sd, tmp_path / "t", workers=1)))
        thread.start()
        thread.join()
    assert results["r"].executor in ("threads", "processes")
    assert_same(parallel_dcp.load(tmp_path / "t"), sd)
