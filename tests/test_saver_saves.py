"""What a Saver's saves write and how a save fails on its workers (a worker's crash, its memory
past the limit, an item over the limit, Ctrl-C), the coordinator's switch interval during a save,
and each later save's memory baseline. Their workers are forked from one fork server kept for the
module (tests/conftest.py, ``kept_fork_server``): none of these checks the server's own start or
stop, which tests/test_saver.py checks with a server of each Saver's own."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import psutil
import pytest
import torch

import parallel_dcp
from parallel_dcp import MemoryLimitExceeded, WorkerCrashed
from parallel_dcp._compat import fork_server_pid
from parallel_dcp.engine.ready import wait_ready
from tests.conftest import assert_same, shards_by_task
from tests.test_saver import _state, _stock_load, _workers

pytestmark = pytest.mark.usefixtures("kept_fork_server")

MiB = 2**20


def test_saves_reuse_the_workers_and_write_what_save_writes(tmp_path: Path) -> None:
    sd = _state()
    with parallel_dcp.Saver(workers=2) as saver:
        started = _workers(saver)
        first = saver.save(sd, tmp_path / "first")
        with torch.no_grad():  # a training step between checkpoints: updated in place
            for tensor in sd["model"].values():
                if tensor.is_floating_point():
                    tensor.mul_(2)
        second = saver.save(sd, tmp_path / "second")
        assert _workers(saver) == started  # no worker was started for either save
    assert first.executor == second.executor == "saver"
    assert second.phases["fork"] < second.seconds
    reference = parallel_dcp.save(sd, tmp_path / "reference", workers=2, executor="processes")
    assert second.tasks == reference.tasks and second.bytes == reference.bytes
    assert shards_by_task(tmp_path / "second") == shards_by_task(
        tmp_path / "reference"
    )  # the fresh bytes, not stale ones
    assert_same(_stock_load(tmp_path / "second", sd), sd)
    assert parallel_dcp.verify(tmp_path / "second").ok
    assert shards_by_task(tmp_path / "first") != shards_by_task(tmp_path / "second")


def test_split_tensors_are_read_chunk_by_chunk(tmp_path: Path) -> None:
    sd = {"big": torch.randn(512, 1024), "cols": torch.randn(256, 2048)[:, :1024], "small": torch.ones(3)}
    with parallel_dcp.Saver(workers=3) as saver:
        result = saver.save(sd, tmp_path / "ckpt", chunk_size="256KiB")
    assert result.tasks >= 3
    assert_same(parallel_dcp.load(tmp_path / "ckpt"), sd)


def test_a_crashed_worker_fails_the_save_and_the_next_save_starts_new_workers(tmp_path: Path) -> None:
    sd = {"w": torch.ones(8), "bomb": ExitOnArrival(3)}
    with parallel_dcp.Saver(workers=2) as saver:
        before = _workers(saver)
        with pytest.raises(WorkerCrashed, match="exit code 3"):
            saver.save(sd, tmp_path / "broken")
        assert not (tmp_path / "broken").exists() or not any((tmp_path / "broken").iterdir())
        result = saver.save({"w": torch.ones(8)}, tmp_path / "ok")
        after = _workers(saver)
        assert not before & after
        assert result.phases["fork"] > 0
    assert_same(parallel_dcp.load(tmp_path / "ok"), {"w": torch.ones(8)})


def test_a_worker_that_allocates_past_the_limit_is_stopped(tmp_path: Path) -> None:
    sd = {"w": torch.ones(8), "hog": HogOnArrival(400 * MiB, hold_s=600)}
    with parallel_dcp.Saver(workers=2, memory_limit="128MiB") as saver:
        stopped = r"worker \d \(pid \d+\) pushed the job to .* over the memory limit"
        with pytest.raises(MemoryLimitExceeded, match=stopped):
            saver.save(sd, tmp_path / "ckpt")
        assert list(tmp_path.iterdir()) == []
        saver.save({"w": torch.ones(8)}, tmp_path / "ckpt")  # new workers, under the same limit
    assert_same(parallel_dcp.load(tmp_path / "ckpt"), {"w": torch.ones(8)})


def test_ctrl_c_during_a_save_stops_it_and_the_next_save_starts_new_workers(tmp_path: Path) -> None:
    sd = {"w": torch.ones(8), "slow": SleepOnArrival(600)}
    with parallel_dcp.Saver(workers=2) as saver:
        before = _workers(saver)
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                saver.save(sd, tmp_path / "ckpt")
        finally:
            timer.cancel()
        assert list(tmp_path.iterdir()) == []
        assert not any(
            psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in before
        )
        saver.save({"w": torch.ones(8)}, tmp_path / "ckpt")
        assert not before & _workers(saver)
    assert_same(parallel_dcp.load(tmp_path / "ckpt"), {"w": torch.ones(8)})


def test_an_item_over_the_limit_fails_before_any_write(tmp_path: Path) -> None:
    # The limit leaves room for the two workers' planned resting cost (WORKER_MEMORY_BYTES each).
    with parallel_dcp.Saver(workers=2, memory_limit="48MiB") as saver:
        with pytest.raises(MemoryLimitExceeded, match=r"'big' needs .* more than the memory limit 48\.0 MiB"):
            # a view with gaps: its 128 MiB span copied by a worker, then DCP's 64 MiB copy; never split
            saver.save({"big": torch.zeros(32 * MiB)[::2]}, tmp_path / "ckpt", chunk_size="1GiB")
        assert list(tmp_path.iterdir()) == []
        saver.save({"w": torch.ones(4)}, tmp_path / "ckpt")  # the workers are still there to use


class ExitOnArrival:
    """Pickles fine in the caller; a worker that unpickles it exits with ``code``."""

    def __init__(self, code: int) -> None:
        self.code = code

    def __reduce__(self) -> Any:
        return (os._exit, (self.code,))


def _hog(nbytes: int, hold_s: float) -> bytearray:
    held = bytearray(nbytes)
    for offset in range(0, nbytes, 4096):  # touched: resident
        held[offset] = 1
    time.sleep(hold_s)
    return held


class HogOnArrival:
    """Pickles fine in the caller; a worker that unpickles it allocates ``nbytes`` and holds them."""

    def __init__(self, nbytes: int, hold_s: float) -> None:
        self.nbytes, self.hold_s = nbytes, hold_s

    def __reduce__(self) -> Any:
        return (_hog, (self.nbytes, self.hold_s))


class SleepOnArrival:
    """Pickles fine in the caller; a worker that unpickles it sleeps ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self) -> Any:
        return (time.sleep, (self.seconds,))


class _SwitchProbe:
    """A value pickled by the coordinator: notes the switch interval while the save runs."""

    seen: ClassVar[list[float]] = []

    def __getstate__(self) -> dict[str, Any]:
        _SwitchProbe.seen.append(sys.getswitchinterval())
        return {}


def test_the_coordinator_takes_the_gil_back_promptly_during_a_save_and_restores_it(tmp_path: Path) -> None:
    from parallel_dcp.engine.prompt_gil import COORDINATOR_SWITCH_S

    before = sys.getswitchinterval()
    assert before > COORDINATOR_SWITCH_S
    _SwitchProbe.seen.clear()
    with parallel_dcp.Saver(workers=1) as saver:
        saver.save({"w": torch.ones(4), "probe": _SwitchProbe()}, tmp_path / "ckpt")
    assert _SwitchProbe.seen and set(_SwitchProbe.seen) == {COORDINATOR_SWITCH_S}
    assert sys.getswitchinterval() == before


def test_a_later_saves_baseline_is_never_above_what_the_tree_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each save's governor subtracts its baseline from every reading. Read from the counters'
    upper bound, it charged each idle worker the buffers it had freed after its last task (and the
    code its first tasks paged in): here 30-32 MiB over the truth (about 8 MiB a worker), an under-count of the
    whole save once they were read again. Now each idle process (the fork server and the workers)
    is charged within a slack of the truth (above it only by file pages paged in since its last
    full reading, under the slack: code or a data file's, only a full listing tells), and from a
    later save on from what the workers read of themselves as they went idle: their counters."""
    from parallel_dcp.engine import process_memory

    baselines: list[dict[int, tuple[int, int]]] = []  # per save: pid -> (how, charged)
    expecting: dict[int, int] = {}
    plan, charge = process_memory.ChargeReader.plan, process_memory.ChargeReader.charge

    def spy_plan(self: Any, pids: Any, **kw: Any) -> list[int]:
        how = plan(self, pids, **kw)
        expecting.clear()
        if kw.get("baseline"):
            expecting.update(zip(pids, how, strict=True))
            baselines.append({})
        return how

    def spy_charge(self: Any, pid: int, how: int) -> tuple[int, int]:
        got = charge(self, pid, how)
        if expecting.pop(pid, None) is not None:
            baselines[-1][pid] = (how, got[0])
        return got

    monkeypatch.setattr(process_memory.ChargeReader, "plan", spy_plan)
    monkeypatch.setattr(process_memory.ChargeReader, "charge", spy_charge)
    sd = {f"t{i}": torch.randn(2 * MiB) for i in range(8)}  # 8 MiB each, two a worker
    slack = process_memory._FAULT_SLACK
    idle: dict[int, int] = {}  # the fork server's and each worker's charge after a save
    with parallel_dcp.Saver(workers=4) as saver:
        for n in range(4):
            saver.save(sd, tmp_path / f"ckpt{n}")
            server = fork_server_pid()
            # this save's baseline against what the same processes held, idle, after the last one
            for pid, (_, charged) in baselines[-1].items():
                if pid in idle:
                    # the fork server gains the shares of pages its workers copy, its counters still:
                    # it may lag by what they gave up, up to a slack a process of the reading (6)
                    under = slack * len(baselines[-1]) if pid == server else slack
                    assert idle[pid] - under <= charged <= idle[pid] + slack, (n, pid, charged, idle[pid])
            pool = saver._workers._pool  # type: ignore[union-attr]
            for worker in pool._owed_charges:  # each has read itself (asked as the save ended): idle now
                assert wait_ready([pool._conns[worker]], 30)
            idle = {pid: process_memory.charged_memory(pid)[0] for pid in [server, *_workers(saver)] if pid}
    assert len(baselines) == 4 and sum(pid in idle for pid in baselines[-1]) == 5
    workers = [how for pid, (how, _) in baselines[-1].items() if pid in idle and pid != server]
    assert workers == [process_memory.LOWER] * 4
