"""More ways to fail: retries, hung tasks, Ctrl-C, a full disk, damaged checkpoints, odd destinations."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import parallel_dcp
from parallel_dcp import (
    CorruptCheckpointError,
    InsufficientSpaceError,
    InvalidDestinationError,
    TaskTimeoutError,
    WorkerCrashed,
    WorkerError,
)
from tests.conftest import assert_same
from tests.faults import FillDisk, KillOnce, SleepInWorker
from tests.forked_process import ForkedProcess

ROOT = Path(__file__).resolve().parent.parent


def test_retries_rerun_a_crashed_task_and_succeed(tmp_path: Path) -> None:
    marker = tmp_path / "killed-once"
    sd = {f"w{i}": torch.randn(32, 32) for i in range(6)} | {"flaky": KillOnce(str(marker))}
    (tmp_path / "out").mkdir()
    parallel_dcp.save(sd, tmp_path / "out" / "ckpt", workers=2, retries=1)
    assert marker.exists(), "the first attempt really crashed"
    # the value pickles as a call of str(): weights_only refuses it, so the test trusts its own file
    loaded = parallel_dcp.load(tmp_path / "out" / "ckpt", trust_pickle=True)
    assert loaded["flaky"] == "ok"
    assert_same({k: v for k, v in loaded.items() if k != "flaky"}, {k: v for k, v in sd.items() if k != "flaky"})
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ckpt"]


def test_a_retried_task_rewrites_the_files_its_dead_attempt_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker killed after it created its shard (the OOM killer mid-write): the retry writes the
    same names again, each created new, and failed with FileExistsError naming the directory
    (review s13 rev2); now the dead attempt's files of this save go first."""
    from parallel_dcp.jobs import targets

    marker = tmp_path / "killed-once"
    write = targets.DcpTarget.write

    def write_then_die(self: Any, job: Any, task: Any, *args: Any, **kwargs: Any) -> Any:
        result = write(self, job, task, *args, **kwargs)
        if task.index == 0 and not marker.exists():  # (in the forked worker: its files are complete)
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    monkeypatch.setattr(targets.DcpTarget, "write", write_then_die)
    sd = {f"w{i}": torch.randn(64, 64) for i in range(6)}
    out = tmp_path / "out" / "ckpt"
    (tmp_path / "out").mkdir()
    parallel_dcp.save(sd, out, workers=2, executor="processes", retries=1)
    assert marker.exists(), "the first attempt really died after writing"
    assert_same(parallel_dcp.load(out), sd)
    assert parallel_dcp.verify(out).ok


def test_without_retries_the_crash_is_final(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    with pytest.raises(WorkerCrashed, match="SIGKILL"):
        parallel_dcp.save({"flaky": KillOnce(str(tmp_path / "m"))}, tmp_path / "out" / "ckpt", workers=1)
    assert list((tmp_path / "out").iterdir()) == []


def test_a_hung_task_is_ended_by_the_task_timeout(tmp_path: Path) -> None:
    # The task sleeps 600 s; ending well before that proves the timeout ended it (the bound is far
    # above what a loaded machine needs, so load cannot fail the test).
    sd = {"w": torch.ones(4), "stuck": SleepInWorker(600)}
    start = time.monotonic()
    with pytest.raises(TaskTimeoutError, match=r"ran \d+\.\d s on worker \d .* past the task timeout of 5 s") as info:
        parallel_dcp.save(sd, tmp_path / "ckpt", workers=2, task_timeout=5)
    assert time.monotonic() - start < 120
    assert "stuck" in info.value.keys
    assert list(tmp_path.iterdir()) == []


SIGINT_SCRIPT = textwrap.dedent(
    """
    import sys, torch, parallel_dcp
    from tests.faults import SleepInWorker
    sd = {"w%d" % i: torch.ones(8) for i in range(4)}
    sd["slow"] = SleepInWorker(600)
    print("saving", flush=True)
    try:
        parallel_dcp.save(sd, sys.argv[1], workers=2)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
    """
)


def test_ctrl_c_stops_workers_and_removes_staging(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGINT_SCRIPT, str(out / "ckpt")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "saving"
        workers = wait_for_workers(proc.pid, 2)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        # A worker is in a 600 s task: exiting within 120 s proves Ctrl-C did not wait for it.
        assert proc.wait(timeout=120) == 130
        assert proc.stdout.read().strip() == "interrupted"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for worker in workers:
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    assert list(out.iterdir()) == [], "staging removed, nothing committed"


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs: a real ENOSPC. Needs root and mount rights (as in CI here)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_too_little_space_is_refused_before_any_write(tiny_tmpfs: Path) -> None:
    sd = {f"w{i}": torch.randn(256, 1024) for i in range(8)}  # 8 MiB into a 4 MiB disk
    with pytest.raises(InsufficientSpaceError, match=r"No space left on device .* needs about \d+ bytes"):
        parallel_dcp.save(sd, tiny_tmpfs / "ckpt", workers=2)
    assert list(tiny_tmpfs.iterdir()) == []


def test_disk_filling_up_mid_save_is_a_clear_error_and_leaves_nothing(tiny_tmpfs: Path) -> None:
    # Enough space at the start; a neighbour fills the disk while the workers write.
    sd = {f"w{i}": torch.randn(64, 1024) for i in range(8)} | {"filler": FillDisk(str(tiny_tmpfs / "neighbour"))}
    with pytest.raises(WorkerError, match=r"No space left on device"):
        parallel_dcp.save(sd, tiny_tmpfs / "ckpt", workers=2)
    assert [p.name for p in tiny_tmpfs.iterdir()] == ["neighbour"]


def _save_under_a_file_size_limit(dest: Path) -> None:
    """(In a forked child: the limit is the process's own) a save whose shards pass RLIMIT_FSIZE."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    try:
        parallel_dcp.save({f"w{i}": torch.randn(512, 1024) for i in range(4)}, dest, workers=2)
    except parallel_dcp.WorkerError as e:
        print(e)
        sys.exit(1)


def test_file_size_limit_is_a_clear_error_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    child = ForkedProcess(_save_under_a_file_size_limit, out / "ckpt")
    printed = child.communicate(timeout=120)
    if child.poll() is None:
        child.kill()
    assert child.returncode == 1, printed
    assert "File too large" in printed
    assert list(out.iterdir()) == []


def test_destination_the_kernel_refuses(tmp_path: Path) -> None:
    with pytest.raises(InvalidDestinationError, match="cannot"):
        parallel_dcp.save({"w": torch.ones(1)}, "/proc/parallel_dcp_cannot_write_here")


def test_truncated_shard_is_refused_before_reading(tmp_path: Path) -> None:
    parallel_dcp.save({f"w{i}": torch.randn(64, 64) for i in range(4)}, tmp_path / "ckpt", workers=2)
    shard = sorted((tmp_path / "ckpt").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CorruptCheckpointError, match=rf"shard {shard.name} has 100 bytes .*truncated"):
        parallel_dcp.load(tmp_path / "ckpt")


def test_missing_shard_is_refused_before_reading(tmp_path: Path) -> None:
    parallel_dcp.save({f"w{i}": torch.randn(64, 64) for i in range(4)}, tmp_path / "ckpt", workers=2)
    shard = sorted((tmp_path / "ckpt").glob("*.distcp"))[0]
    shard.unlink()
    with pytest.raises(CorruptCheckpointError, match=rf"shard {shard.name} is missing"):
        parallel_dcp.load(tmp_path / "ckpt")


def _save_held_by_sleeping_workers(dest: Path) -> None:
    parallel_dcp.save({"a": SleepInWorker(60), "b": SleepInWorker(60)}, dest, workers=2)


def test_coordinator_killed_takes_its_workers_with_it(tmp_path: Path) -> None:
    """The coordinator is a process forked from this one (tests/forked_process.py), SIGKILLed once
    both its workers run."""
    proc = ForkedProcess(_save_held_by_sleeping_workers, tmp_path / "ckpt")
    try:
        workers = wait_for_workers(proc.pid, 2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        _gone, alive = psutil.wait_procs(workers, timeout=60)
        assert not alive, "workers outlived a SIGKILLed coordinator"
    finally:
        if proc.poll() is None:
            proc.kill()


def wait_for_workers(pid: int, count: int) -> list[psutil.Process]:
    """The ``count`` worker processes of coordinator ``pid``, once they have all started."""
    coordinator = psutil.Process(pid)
    deadline = time.monotonic() + 30
    while len(coordinator.children()) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = coordinator.children()
    assert len(workers) == count
    return workers
