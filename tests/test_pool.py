"""The worker pool forks its workers as the work needs them (one before the first task)."""

from __future__ import annotations

import os
import time

from parallel_dcp.engine.memory import WORKER_MEMORY_BYTES, MemoryGovernor
from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.pool import WorkerPool


def _pid_after_a_moment(task: Task) -> int:
    time.sleep(0.05)  # long enough that every task waits for a free worker
    return os.getpid()


def tasks(n: int, memory: int = 0) -> list[Task]:
    return [Task(index=i, keys=(f"k{i}",), nbytes=1, memory=memory) for i in range(n)]


def test_one_worker_before_the_first_task_the_others_as_tasks_wait() -> None:
    with WorkerPool(4, _pid_after_a_moment, start=1) as pool:
        assert len(pool.pids) == 1
        results = list(pool.run(tasks(12)))
        assert len(pool.pids) == 4
        assert sorted(r.task.index for r in results) == list(range(12))
        assert {r.value for r in results} == set(pool.pids)  # every worker ran tasks


def test_no_worker_is_forked_for_work_that_is_already_covered() -> None:
    with WorkerPool(4, _pid_after_a_moment, start=1) as pool:
        list(pool.run(tasks(1)))
        assert len(pool.pids) == 1


def test_a_worker_the_memory_limit_cannot_afford_is_never_forked() -> None:
    # Room for the first worker's task and nothing beside it: the others would only wait. (An idle
    # forked worker measures close to nothing, so the limit is a MiB short of a second one.)
    need = 64 * 2**20
    governor = MemoryGovernor(2 * need + WORKER_MEMORY_BYTES - 2**20)
    with WorkerPool(3, _pid_after_a_moment, start=1) as pool:
        results = list(pool.run(tasks(4, memory=need), governor=governor))
        assert len(pool.pids) == 1
        assert len({r.value for r in results}) == 1
