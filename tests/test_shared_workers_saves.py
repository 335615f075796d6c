"""save() on the workers it keeps (jobs/shared_workers.py): what they write, when a large save
runs on them (beside a busy thread, or while they are warm) or on writer threads, and a failed
save on them. Their workers are forked from one fork server kept for the module (tests/conftest.py,
``kept_fork_server``): none of these checks the server's start or stop; tests/test_shared_workers.py
keeps the tests that see the kept workers' processes (none started by a small save, gone once idle,
a fork of the caller starting its own)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import parallel_dcp
from parallel_dcp.jobs import shared_workers
from tests.conftest import assert_same, shards_by_task
from tests.test_shared_workers import MiB, _state

pytestmark = pytest.mark.usefixtures("kept_fork_server")


@pytest.fixture
def small_threshold(monkeypatch: pytest.MonkeyPatch) -> None:  # as in tests/test_shared_workers.py
    monkeypatch.setattr(shared_workers, "MIN_BYTES", 2 * MiB)  # the real 256 MiB is slow on 2 cores
    monkeypatch.setattr(shared_workers, "other_threads", lambda: True)  # as beside a data loader thread


def test_a_large_save_runs_on_kept_workers_and_writes_what_the_others_write(
    tmp_path: Path, small_threshold: None
) -> None:
    sd = _state()
    first = parallel_dcp.save(sd, tmp_path / "first", workers=2)
    kept = shared_workers._workers
    assert kept is not None and kept._pool is not None
    pids = set(kept._pool.pids)
    with torch.no_grad():
        for tensor in sd.values():
            tensor.mul_(2)  # a training step between checkpoints
    second = parallel_dcp.save(sd, tmp_path / "second", workers=2)
    assert first.executor == second.executor == "saver"
    assert shared_workers._workers is kept and kept._pool is not None and set(kept._pool.pids) == pids
    assert second.phases["fork"] < first.phases["fork"]  # no worker started for the second save
    threads = parallel_dcp.save(sd, tmp_path / "threads", workers=2, executor="threads")
    processes = parallel_dcp.save(sd, tmp_path / "processes", workers=2, executor="processes")
    assert threads.executor == "threads" and processes.executor == "processes"  # explicit choices kept
    assert shards_by_task(tmp_path / "second") == shards_by_task(tmp_path / "processes")
    assert_same(parallel_dcp.load(tmp_path / "second"), sd)
    assert parallel_dcp.verify(tmp_path / "second").ok


def test_alone_a_large_save_runs_on_writer_threads_and_beside_a_thread_or_while_warm_on_kept_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_workers, "MIN_BYTES", 2 * MiB)
    if shared_workers.other_threads():
        pytest.skip("another thread runs in this test process")
    alone = parallel_dcp.save(_state(), tmp_path / "alone", workers=1)
    assert alone.executor == "threads" and shared_workers._workers is None
    stop = threading.Event()
    idle = threading.Thread(target=stop.wait)  # a thread that sleeps: no convoy, not counted
    idle.start()
    try:
        time.sleep(0.2)
        assert not shared_workers.other_threads()
        beside_idle = parallel_dcp.save(_state(), tmp_path / "idle", workers=1)
    finally:
        stop.set()
        idle.join()
    assert beside_idle.executor == "threads"

    def spin() -> None:
        while not stop.is_set():
            sum(range(100))

    stop = threading.Event()
    busy = threading.Thread(target=spin)  # a data loader: busy for a while before the save
    busy.start()
    try:
        time.sleep(0.2)
        assert shared_workers.other_threads()
        beside = parallel_dcp.save(_state(), tmp_path / "beside", workers=1)
    finally:
        stop.set()
        busy.join()
    assert beside.executor == "saver"
    assert shared_workers._workers is not None  # kept for the next save beside a busy thread
    again = parallel_dcp.save(_state(), tmp_path / "again", workers=1)  # alone, but they are warm
    assert again.executor == "saver"
    other_count = parallel_dcp.save(_state(), tmp_path / "two", workers=2)  # none warm for 2: no start
    assert other_count.executor == "threads" and shared_workers._workers is not None
    assert shared_workers._workers.workers == 1
    shared_workers.stop()
    cold = parallel_dcp.save(_state(), tmp_path / "cold", workers=1)  # alone and cold: threads
    assert cold.executor == "threads" and shared_workers._workers is None
    shards = shards_by_task(tmp_path / "alone")
    assert all(shards_by_task(tmp_path / name) == shards for name in ("beside", "again", "cold"))


def test_a_failed_save_on_kept_workers_commits_nothing_and_the_next_one_works(
    tmp_path: Path, small_threshold: None
) -> None:
    sd = _state()
    parallel_dcp.save(sd, tmp_path / "ckpt", workers=1)
    with pytest.raises(parallel_dcp.CheckpointExistsError):
        parallel_dcp.save(sd, tmp_path / "ckpt", workers=1)  # refused before anything is written
    result = parallel_dcp.save(sd, tmp_path / "ckpt", workers=1, overwrite=True)
    assert result.executor == "saver"
    assert_same(parallel_dcp.load(tmp_path / "ckpt"), sd)
