"""A Saver's later save sends each worker its first task on the kept plan before it checks the
layout (jobs/speculation.py); a stale plan leaves nothing and the save writes what ``save()`` writes."""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import parallel_dcp
from parallel_dcp.engine import pool as pool_module
from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.pool import WorkerPool
from parallel_dcp.engine.remote_memory import StaleRead, read_gathered, read_into
from parallel_dcp.errors import StalePlan, WorkerCrashed, WorkerError
from parallel_dcp.jobs import plan_reuse, speculation
from parallel_dcp.jobs.plan_reuse import PlanReuse
from tests.conftest import assert_same
from tests.test_plan_reuse import CHANGES, IN_PLACE, _assert_same_checkpoint, _state

# Savers in every test: their workers are forked from one fork server kept for the module.
pytestmark = pytest.mark.usefixtures("kept_fork_server")

MiB = 2**20


def _memo(saver: parallel_dcp.Saver) -> PlanReuse:
    return saver._live()._plans


def _pids(saver: parallel_dcp.Saver) -> list[int]:
    pool = saver._live()._pool
    assert pool is not None
    return pool.pids


def _step(sd: dict[str, Any]) -> None:
    with torch.no_grad():
        for group in ("model", "optim"):
            for tensor in sd[group].values():
                tensor.add_(1)
    sd["step"] += 1


def _only_committed(path: Path, like: Path) -> None:
    """``path`` holds its ``.metadata``'s shards and the files ``like`` (a save()) holds besides
    its shards: no file of a discarded speculation, no lock, no staging record."""

    def split(where: Path) -> tuple[set[str], set[str]]:
        shards = {d.relative_path for d in FileSystemReader(str(where)).read_metadata().storage_data.values()}
        return shards, set(os.listdir(where)) - shards

    shards, rest = split(path)
    assert shards <= set(os.listdir(path))
    assert rest == split(like)[1]


def test_a_later_save_sends_its_first_tasks_before_it_checks_the_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = _state()
    events: list[str] = []
    send, leaves = pool_module._send, plan_reuse.leaves

    def logged_send(conn: Any, message: Any) -> None:
        sent = message.load() if isinstance(message, pool_module._PartAt) else message  # (where its bytes lie)
        if isinstance(sent, pool_module._TaskPart):
            events.append(f"task {sent.task.index}")
        send(conn, message)

    def logged_leaves(*args: Any) -> Any:
        events.append("check")
        return leaves(*args)

    monkeypatch.setattr(pool_module, "_send", logged_send)
    monkeypatch.setattr(plan_reuse, "leaves", logged_leaves)
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(sd, tmp_path / "first")
        _step(sd)
        events.clear()
        second = saver.save(sd, tmp_path / "second")
        assert (_memo(saver).speculations, _memo(saver).speculated, _memo(saver).reused) == (1, 1, 1)
    # The task without a value went out first (the other one carries this save's values: after).
    assert events[0].startswith("task ") and events[1] == "check" and len(events) == 3, events
    assert second.phases["plan"] < second.seconds
    parallel_dcp.save(sd, tmp_path / "save", workers=2, executor="processes")
    _assert_same_checkpoint(tmp_path / "second", tmp_path / "save")
    _only_committed(tmp_path / "second", tmp_path / "save")
    assert_same(parallel_dcp.load(tmp_path / "second"), sd)


LAYOUT_CHANGES = [c for c, _ in CHANGES] + [c for c, _, _ in IN_PLACE]


@pytest.mark.parametrize("promise", [False, True], ids=["checked", "promised"])
def test_every_change_found_by_the_check_drops_the_speculation_and_writes_what_save_writes(
    tmp_path: Path, promise: bool
) -> None:
    with parallel_dcp.Saver(workers=2) as saver:
        for change in LAYOUT_CHANGES:
            if promise and change in [c for c, _, same_bytes in IN_PLACE if same_bytes]:
                continue  # the relayouts over the same bytes the promise rules out (test_plan_reuse)
            out = tmp_path / f"{change.__name__}"
            out.mkdir()
            memo = _memo(saver)
            memo._kept.clear()
            sd = _state()
            saver.save(sd, out / "first")
            top = tuple(sd)
            before = (memo.speculations, memo.speculated)
            workers = _pids(saver)
            change(sd)
            saver.save(sd, out / "second", layout_unchanged=promise)
            tried = int(tuple(sd) == top)  # another top level: not even tried
            assert (memo.speculations, memo.speculated) == (before[0] + tried, before[1]), change.__name__
            assert _pids(saver) == workers  # drained, not killed
            parallel_dcp.save(sd, out / "save", workers=2, executor="processes")
            _assert_same_checkpoint(out / "second", out / "save")
            _only_committed(out / "second", out / "save")
            assert sorted(os.listdir(out)) == ["first", "save", "second"]


def test_a_tensor_freed_before_a_save_is_a_clean_fallback(tmp_path: Path) -> None:
    sd = _state()
    sd["model"]["huge"] = torch.randn(64 * MiB // 4)  # over glibc's largest mmap threshold: unmapped when freed
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(sd, tmp_path / "first")
        workers = _pids(saver)
        old = sd["model"]["huge"]
        sd["model"]["huge"] = old.clone()  # the same layout elsewhere; the old bytes freed
        del old  # a worker sent there copies nothing (StaleRead) or what lies there now
        _step(sd)
        saver.save(sd, tmp_path / "second")
        memo = _memo(saver)
        assert (memo.speculations, memo.speculated) == (1, 0)
        assert _pids(saver) == workers
        _step(sd)
        saver.save(sd, tmp_path / "third")  # tensors moved: checked first; then steady again
        assert memo.speculations == 1
        _step(sd)
        saver.save(sd, tmp_path / "fourth")
        assert (memo.speculations, memo.speculated) == (2, 1)
    parallel_dcp.save(sd, tmp_path / "save", workers=2, executor="processes")
    _assert_same_checkpoint(tmp_path / "fourth", tmp_path / "save")
    for name in ("second", "third", "fourth"):
        _only_committed(tmp_path / name, tmp_path / "save")
    assert_same(parallel_dcp.load(tmp_path / "fourth"), sd)


def test_a_speculative_read_that_fails_is_a_clean_fallback(tmp_path: Path) -> None:
    sd = _state()
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(sd, tmp_path / "first")
        workers = _pids(saver)
        kept = _memo(saver)._kept[0]
        # A kept part whose addresses are no longer mapped, where the state dict did not change:
        # the check passes, the worker's copy fails (what a tensor freed under a plan would do).
        index, made = next((i, p) for i, p in kept.parts.items() if isinstance(p, bytes))
        part = pickle.loads(made)
        addresses = [8 * (n + 1) for n in range(len(part.source.addresses))]
        kept.parts[index] = pickle.dumps(replace(part, source=replace(part.source, addresses=addresses)))
        _step(sd)
        saver.save(sd, tmp_path / "second")
        memo = _memo(saver)
        assert (memo.speculations, memo.speculated) == (1, 1)  # the check passed; the copy did not
        assert _pids(saver) == workers
        assert not kept.steady
    parallel_dcp.save(sd, tmp_path / "save", workers=2, executor="processes")
    _assert_same_checkpoint(tmp_path / "second", tmp_path / "save")
    _only_committed(tmp_path / "second", tmp_path / "save")


def test_layouts_saved_in_turn_are_each_speculated_on(tmp_path: Path) -> None:
    model, optim = {"model": {"w": torch.ones(64)}}, {"optim": {"m": torch.zeros(64)}}
    with parallel_dcp.Saver(workers=2) as saver:
        for step in range(3):
            saver.save(model, tmp_path / f"model{step}")
            saver.save(optim, tmp_path / f"optim{step}")
        memo = _memo(saver)
        assert (memo.speculations, memo.speculated, memo.reused) == (4, 4, 4)
        saver.save({"model": {"w": torch.ones(64), "b": torch.ones(2)}}, tmp_path / "other")
        assert (memo.speculations, memo.speculated, memo.reused) == (5, 4, 4)  # its top level: tried
    assert_same(parallel_dcp.load(tmp_path / "optim2"), optim)
    _only_committed(tmp_path / "other", tmp_path / "model0")


def test_without_speculation_the_check_comes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(speculation, "SPECULATE", False)
    sd = _state()
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(sd, tmp_path / "first")
        saver.save(sd, tmp_path / "second")
        assert (_memo(saver).speculations, _memo(saver).reused) == (0, 1)


def test_a_copy_from_unmapped_memory_is_a_stale_read() -> None:
    out = ctypes.create_string_buffer(64)
    with pytest.raises(StaleRead) as raised:
        read_into(os.getpid(), 8, 16, ctypes.addressof(out))
    assert isinstance(raised.value, OSError)
    good = ctypes.create_string_buffer(b"x" * 16)
    with pytest.raises(StaleRead):
        read_gathered(os.getpid(), [(ctypes.addressof(good), 16), (8, 16)], ctypes.addressof(out))


class _CopyFrom:
    """A task that copies 16 bytes at its own pid's ``address``: task 1 from an unmapped one."""

    def __call__(self, task: Task) -> int:
        out = ctypes.create_string_buffer(16)
        good = ctypes.create_string_buffer(16)
        address = 8 if task.index == 1 else ctypes.addressof(good)
        read_into(os.getpid(), address, 16, ctypes.addressof(out))
        return task.index


def test_a_stale_read_in_a_worker_is_a_stale_plan_and_the_pool_stays_usable() -> None:
    tasks = [Task(i, (f"k{i}",), 1) for i in range(6)]
    with WorkerPool(2, _CopyFrom()) as workers:
        pids = workers.pids
        with pytest.raises(StalePlan, match="StaleRead") as raised:
            list(workers.run(tasks))
        assert isinstance(raised.value, WorkerError)
        assert workers.pids == pids  # drained, not killed
        fine = [t for t in tasks if t.index != 1]
        assert sorted(r.value for r in workers.run(fine)) == [0, 2, 3, 4, 5]


def _big_state() -> dict[str, Any]:
    torch.manual_seed(1)
    return {"optim": {f"{i}": {"m": torch.randn(256), "v": torch.rand(256)} for i in range(20000)}}


def _speculating(saver: parallel_dcp.Saver, tmp_path: Path, stop: Callable[[], None]) -> type[BaseException]:
    """A later save of a large state dict, ``stop`` called while it runs: what it raised."""
    sd = _big_state()
    saver.save(sd, tmp_path / "first")
    timer = threading.Timer(0.05, stop)
    timer.start()
    try:
        saver.save(sd, tmp_path / "second")
    except BaseException as exc:  # what the caller sees
        return type(exc)
    finally:
        timer.cancel()
        timer.join()
    raise AssertionError("the save ended before it was stopped")


def test_a_worker_crash_during_a_speculative_save_fails_it_as_any_save(tmp_path: Path) -> None:
    with parallel_dcp.Saver(workers=2) as saver:
        before = set(_pids(saver))
        raised = _speculating(saver, tmp_path, lambda: os.kill(sorted(before)[0], signal.SIGKILL))
        assert raised is WorkerCrashed
        assert _memo(saver).speculations == 1
        assert sorted(os.listdir(tmp_path)) == ["first"]
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in before)
        saver.save({"w": torch.ones(8)}, tmp_path / "ok")
        assert not before & set(_pids(saver))


def test_ctrl_c_during_a_speculative_save_stops_it_as_any_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Ctrl-C reaches the pool's loop while the speculative tasks run (sent from the loop's
    first look ahead, so that it cannot land in the commit, where it is held until the end)."""
    sent: list[int] = []
    ahead = speculation.SpeculativeParts.ahead

    def interrupted(self: speculation.SpeculativeParts) -> None:
        if not sent:
            sent.append(os.getpid())
            os.kill(os.getpid(), signal.SIGINT)
        ahead(self)

    monkeypatch.setattr(speculation.SpeculativeParts, "ahead", interrupted)
    with parallel_dcp.Saver(workers=2) as saver:
        before = set(_pids(saver))
        sd = _big_state()
        saver.save(sd, tmp_path / "first")
        with pytest.raises(KeyboardInterrupt):
            saver.save(sd, tmp_path / "second")
        assert sent
        assert _memo(saver).speculations == 1
        assert sorted(os.listdir(tmp_path)) == ["first"]
        saver.save({"w": torch.ones(8)}, tmp_path / "ok")
        assert not before & set(_pids(saver))
    assert_same(parallel_dcp.load(tmp_path / "ok"), {"w": torch.ones(8)})
