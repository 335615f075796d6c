"""A Saver's coordinator sends each busy worker its next task ahead (engine/pool.py, ``_Ahead``):
the hand-offs overlap the work, the files are save()'s, and a worker that fails on a task it was
sent ahead fails the save cleanly."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import parallel_dcp
from parallel_dcp import WorkerCrashed, WorkerError
from parallel_dcp.engine import pool
from parallel_dcp.engine.partition import Task
from tests.conftest import assert_same, shards_by_task

# Savers in every test: their workers are forked from one fork server kept for the module.
pytestmark = pytest.mark.usefixtures("kept_fork_server")

# Enough keys that one worker gets several tasks (the partition splits the job at any count).
KEYS = 2000


def _state(**values: Any) -> dict[str, Any]:
    """``values`` first, then ``KEYS`` small tensors (where the partition puts a first value in a
    later task, one sent ahead: checked where it matters)."""
    torch.manual_seed(0)
    return values | {f"t{i}": torch.randn(16 + i % 48) for i in range(KEYS)} | {"step": 7}


class _SentAhead:
    """Records the tasks the pool sent ahead to busy workers."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tasks: list[Task] = []
        original = pool.WorkerPool._send_ahead

        def send_ahead(owner: pool.WorkerPool, *args: Any) -> None:
            ahead: dict[int, tuple[Task, bytearray]] = args[3]
            before = {task.index for task, _ in ahead.values()}
            original(owner, *args)
            self.tasks += [task for task, _ in ahead.values() if task.index not in before]

        monkeypatch.setattr(pool.WorkerPool, "_send_ahead", send_ahead)


def test_tasks_sent_ahead_write_what_save_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sd = _state(name="run")
    sent = _SentAhead(monkeypatch)
    with parallel_dcp.Saver(workers=1) as saver:
        saver.save(sd, tmp_path / "first")
        with torch.no_grad():
            for value in sd.values():
                if isinstance(value, torch.Tensor):
                    value.add_(1)
        result = saver.save(sd, tmp_path / "second")
    assert result.tasks >= 3 and len(sent.tasks) >= 2 * (result.tasks - 1)  # every task but the first, twice
    reference = parallel_dcp.save(sd, tmp_path / "reference", workers=1, executor="processes")
    assert result.tasks == reference.tasks
    assert shards_by_task(tmp_path / "second") == shards_by_task(tmp_path / "reference")
    second, expected = (FileSystemReader(str(tmp_path / p)).read_metadata() for p in ("second", "reference"))
    assert second.state_dict_metadata == expected.state_dict_metadata and second.planner_data == expected.planner_data
    assert_same(parallel_dcp.load(tmp_path / "second"), sd)
    # The pieces of the scaling model: the coordinator's work beside the workers', the workers'
    # handling of their tasks outside them.
    assert result.coordinator_write_seconds is not None
    assert 0 <= result.coordinator_write_seconds <= result.phases["write"]
    assert all(w.handling_seconds > 0 for w in result.per_worker)
    assert reference.coordinator_write_seconds is None  # forked per save: nothing sent ahead


def _raise(message: str) -> None:
    raise RuntimeError(message)


class ExitOnArrival:
    """Pickles fine in the caller; a worker that unpickles it exits with code 3."""

    def __reduce__(self) -> Any:
        return (os._exit, (3,))


class RaiseOnArrival:
    """Pickles fine in the caller; a worker that unpickles it raises."""

    def __reduce__(self) -> Any:
        return (_raise, ("refused on arrival",))


@pytest.mark.parametrize(
    ("bomb", "error", "message"),
    [
        (ExitOnArrival(), WorkerCrashed, r"died with exit code 3 while running task \d+"),
        (RaiseOnArrival(), WorkerError, r"raised RuntimeError: refused on arrival \(task \d+"),
    ],
)
def test_a_worker_failing_on_a_task_sent_ahead_fails_the_save_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bomb: Any, error: type[Exception], message: str
) -> None:
    sent = _SentAhead(monkeypatch)
    with parallel_dcp.Saver(workers=1) as saver:
        workers = set(saver._live()._pool.pids)  # type: ignore[union-attr]
        with pytest.raises(error, match=message):
            saver.save(_state(bomb=bomb), tmp_path / "ckpt")
        # The value travels with its task, which was one sent ahead while the worker was busy.
        assert any("bomb" in task.keys for task in sent.tasks)
        assert not (tmp_path / "ckpt" / ".metadata").exists()
        assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
        assert not any(psutil.pid_exists(pid) for pid in workers)  # killed and reaped
        assert saver._live()._pool is None
        result = saver.save(_state(), tmp_path / "next")  # new workers
        assert result.tasks >= 3
    assert_same(parallel_dcp.load(tmp_path / "next"), _state())


def test_a_later_save_sends_each_task_as_where_its_bytes_lie(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A later save's tasks travel as where their kept bytes lie (the task's pickle and its part,
    which the coordinator holds until the worker's reply): per task, whether sent ahead or not, the
    coordinator pickles and writes a few hundred bytes, however many keys the task has."""
    sd = _state(name="run")
    sent = _SentAhead(monkeypatch)
    written: list[int] = []  # the size of each message written into a worker's pipe
    pickled: list[int] = []  # the size of each pickle the pool made
    send, dumps = pool._send, pool.pickle.dumps

    def recording_send(conn: Any, message: Any) -> None:
        written.append(len(dumps(message)))
        send(conn, message)

    def recording_dumps(value: Any, *args: Any, **kwargs: Any) -> bytes:
        made = dumps(value, *args, **kwargs)
        pickled.append(len(made))
        return made

    monkeypatch.setattr(pool, "_send", recording_send)
    monkeypatch.setattr(pool, "pickle", SimpleNamespace(**vars(pool.pickle)))
    monkeypatch.setattr(pool.pickle, "dumps", recording_dumps)
    with parallel_dcp.Saver(workers=1) as saver:
        saver.save(sd, tmp_path / "first")
        written.clear()
        pickled.clear()
        sent.tasks.clear()
        result = saver.save(sd, tmp_path / "second")
    assert result.tasks >= 3 and len(sent.tasks) == result.tasks - 1
    keys = min(len(task.keys) for task in sent.tasks)
    assert keys >= 100
    assert len(written) >= result.tasks and max(written) < 512, written
    # (the run's handler, the job without keys, is pickled once a run: not per task)
    assert all(size < 512 for size in sorted(pickled)[:-1]), pickled
    assert_same(parallel_dcp.load(tmp_path / "second"), sd)
