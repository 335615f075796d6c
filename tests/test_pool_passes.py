"""A pool's loop pass costs what happened since the last one, not the number of workers (issue 30),
and every way a run ends still holds at many workers: crashes retried on fresh workers (whose new
pipes are waited on), a task timeout found behind tasks that started later, tasks sent ahead."""

from __future__ import annotations

import os
import select
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from parallel_dcp import TaskTimeoutError
from parallel_dcp.engine import ready as readymod
from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.pool import WorkerPool

WORKERS = 32
LIMIT = 64 << 30  # a ceiling the governor samples under and never refuses at


def _tasks(n: int) -> list[Task]:
    return [Task(index=i, keys=(f"k{i}",), nbytes=1) for i in range(n)]


def _staggered(task: Task) -> int:
    time.sleep(0.01 * (1 + task.index % 5))  # the replies come a few at a time: many passes
    return task.index


class _CountingPoll:
    """``select.poll`` that counts its registrations (in the coordinator: a fork counts its own)."""

    registered = 0

    def __init__(self) -> None:
        self._poll = select.poll()

    def register(self, fd: int, events: int) -> None:
        _CountingPoll.registered += 1
        self._poll.register(fd, events)

    def unregister(self, fd: int) -> None:
        self._poll.unregister(fd)

    def poll(self, timeout: int | None = None) -> list[tuple[int, int]]:
        return self._poll.poll(timeout)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ahead", [False, True], ids=["plain", "sent-ahead"])
def test_a_pass_registers_only_the_workers_that_started_a_task(monkeypatch: pytest.MonkeyPatch, ahead: bool) -> None:
    """Each task's worker is waited on from its dispatch (two descriptors) and its reply read once
    (one): a run's registrations are a few per task, however many passes it makes and however many
    workers each pass waits on (the loop rebuilt its poll set every pass: 2 x running each)."""
    monkeypatch.setattr(readymod, "select", SimpleNamespace(poll=_CountingPoll))
    tasks = _tasks(2 * WORKERS)
    passes = [0]
    with WorkerPool(WORKERS, _staggered) as pool:
        _CountingPoll.registered = 0
        got = list(
            pool.run(
                tasks,
                governor=MemoryGovernor(LIMIT),
                on_tick=lambda: passes.__setitem__(0, passes[0] + 1),
                handler=_staggered if ahead else None,
            )
        )
    assert sorted(r.value for r in got) == list(range(len(tasks)))
    assert _CountingPoll.registered <= 4 * len(tasks), f"{_CountingPoll.registered} registrations, {passes[0]} passes"


@pytest.mark.timeout(120)
def test_the_workers_map_is_made_only_when_the_governor_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between two samples (here an hour apart: one at the first pass) the governor reads
    nothing: the pool does not walk its workers for it (``_watched``) on those passes, but once
    more at the end (``finish``)."""
    made = [0]
    watched = WorkerPool._watched

    def counting(pool: WorkerPool, running: Any) -> Any:
        made[0] += 1
        return watched(pool, running)

    monkeypatch.setattr(WorkerPool, "_watched", counting)
    passes = [0]
    with WorkerPool(8, _staggered) as pool:
        got = list(
            pool.run(
                _tasks(64),
                governor=MemoryGovernor(LIMIT, interval=3600),
                on_tick=lambda: passes.__setitem__(0, passes[0] + 1),
            )
        )
    assert len(got) == 64 and passes[0] > 4
    assert made[0] <= 2, f"made {made[0]} times in {passes[0]} passes"


def _crash_once(task: Task) -> int:
    """Every fifth task kills its worker the first time it runs (a file marks that it did)."""
    marker = Path(os.environ["PDCP_TEST_MARKERS"]) / str(task.index)
    if task.index % 5 == 0 and not marker.exists():
        marker.touch()
        os._exit(3)
    time.sleep(0.002 * (1 + task.index % 3))
    return task.index


@pytest.mark.timeout(180)
@pytest.mark.parametrize("ahead", [False, True], ids=["plain", "sent-ahead"])
def test_crashes_at_many_workers_are_retried_on_fresh_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ahead: bool
) -> None:
    """A restarted worker's new pipe may take a dead one's descriptor number: it is waited on
    afresh, and every task's result comes back once (a stale registration would hang or lose one)."""
    monkeypatch.setenv("PDCP_TEST_MARKERS", str(tmp_path))
    tasks = _tasks(3 * WORKERS)
    with WorkerPool(WORKERS, _crash_once) as pool:
        first = set(pool.pids)
        got = list(pool.run(tasks, governor=MemoryGovernor(LIMIT), retries=1, handler=_crash_once if ahead else None))
        assert len(set(pool.pids) - first) >= 1  # restarted
    assert sorted(r.value for r in got) == list(range(len(tasks)))
    assert len(list(tmp_path.iterdir())) == len([t for t in tasks if t.index % 5 == 0])


def _one_stuck(task: Task) -> int:
    time.sleep(60 if task.index == 40 else 0.1)
    return task.index


@pytest.mark.timeout(120)
def test_a_timeout_is_found_behind_tasks_that_started_after_it() -> None:
    """Task 40 starts after the first 32 and hangs while the others keep finishing and starting
    (each after it): it is the one the timeout names, before the others are done."""
    # ~13 s of the others' work on 31 workers, past a timeout 50 times an ordinary task's sleep
    # (a loaded 2-core machine delays a 0.1 s task by seconds at worst, not by 5)
    tasks = _tasks(4000)
    results: list[int] = []
    with WorkerPool(WORKERS, _one_stuck) as pool, pytest.raises(TaskTimeoutError) as caught:
        results += (r.value for r in pool.run(tasks, task_timeout=5.0))
    assert list(caught.value.keys) == ["k40"]
    assert len(results) < len(tasks) - 1
