"""The worker pool forks its workers as the work needs them (one before the first task)."""

from __future__ import annotations

import os
import time

import pytest

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


def _private_bytes(pid: int) -> int:
    import psutil

    return int(psutil.Process(pid).memory_full_info().uss)


def test_the_coordinators_collections_do_not_copy_its_heap_into_the_workers() -> None:
    """A full collection in the coordinator writes every tracked object's header: without the
    pool freezing the heap, each page it writes is copied for the worker sharing it (the tree
    then holds the heap twice, charged to the job: seen as a breach of a 32 MiB limit in a
    long-lived test process). The worker's private memory must not grow by the heap's size."""
    import gc

    heap = [{"key": i, "value": [i, str(i)]} for i in range(300_000)]  # ~55 MiB of objects
    frozen_before = gc.get_freeze_count()
    with WorkerPool(1, _pid_after_a_moment) as pool:
        (worker,) = pool.pids
        time.sleep(0.2)  # the worker is waiting for its first task
        before = _private_bytes(worker)
        gc.collect()
        grown = _private_bytes(worker) - before
        assert grown < 8 * 2**20, f"the worker's private memory grew {grown / 2**20:.1f} MiB"
    assert gc.get_freeze_count() == frozen_before  # thawed when the workers are gone
    assert len(heap) == 300_000


def test_a_callers_own_frozen_heap_stays_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    """A program that froze its objects itself (a pre-fork server's habit) keeps them frozen.
    (The count alone can drop by a few: a frozen object is freed when its last reference goes,
    e.g. an earlier test's finished process dropped from multiprocessing's list of children.)"""
    import gc

    unfrozen: list[int] = []
    real_unfreeze = gc.unfreeze
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        monkeypatch.setattr(gc, "unfreeze", lambda: unfrozen.append(gc.get_freeze_count()))
        with WorkerPool(1, _pid_after_a_moment) as pool:
            assert pool.pids
        assert unfrozen == []
        assert gc.get_freeze_count() > frozen // 2
    finally:
        monkeypatch.undo()
        real_unfreeze()


def _large_result_after_a_while(task: Task) -> bytes:
    time.sleep(0.3)
    return bytes(HANDED_OVER)


# Far more than a pipe holds: the worker's send waits until the coordinator reads.
HANDED_OVER = 64 * 1024 * 1024


def test_a_workers_hand_over_of_its_result_is_reported_with_its_next_task() -> None:
    # The coordinator stops reading for two seconds while the first task runs (its progress tick
    # sleeps): the worker, done after 0.3 s, waits in its send of the result. That wait is the
    # worker's hand-over, parallel with every other worker's: reported (with its next task),
    # not left outside every measured part (the scaling model's serial part).
    paused: list[float] = []

    def tick() -> None:
        if not paused:
            paused.append(time.monotonic())
            time.sleep(2.0)  # (a slow start of the worker on a loaded machine still leaves ~1 s)

    with WorkerPool(1, _large_result_after_a_while) as pool:
        results = {r.task.index: r for r in pool.run([Task(i, (f"k{i}",), 0) for i in range(2)], on_tick=tick)}
    assert paused and sorted(results) == [0, 1]
    assert results[0].handover == 0  # nothing handed over before the first task
    assert results[1].handover >= 0.5  # the first result waited in its send, ~1.7 s on a quiet machine
    assert results[1].handling < results[1].handover  # taking the task in, pickling: apart


def _allocate_and_free(task: Task) -> int:
    block = bytearray(8 << 20)  # 8 MiB touched, then freed: what a worker keeps is less
    del block
    return os.getpid()


def test_workers_asked_after_a_run_report_their_own_charge_and_the_next_run_is_unaffected() -> None:
    """A pool with ``report_charges`` asks each worker, as a run ends, to read its own memory; the
    answers are taken by :meth:`charge_reports` or, where nobody took them, before the next run's
    replies (a run right after gets its own results, never a report)."""
    import psutil

    with WorkerPool(2, _allocate_and_free, report_charges=True) as pool:
        first = list(pool.run(tasks(4)))
        reports = pool.charge_reports()
        assert set(reports) == set(pool.pids) == {r.value for r in first}
        for pid, report in reports.items():
            assert report.exact is not None  # a worker's first report reads its file pages in full
            # at most what it has resident (its shares of pages it still shares with this process
            # move as this process runs: the exact figure is checked in test_process_memory)
            assert 0 < report.exact[0] <= psutil.Process(pid).memory_info().rss
        assert pool.charge_reports() == {}  # taken once
        list(pool.run(tasks(4)))  # asked again; not taken
        again = list(pool.run(tasks(6)))  # the answers are read first, out of the replies' way
        assert sorted(r.task.index for r in again) == list(range(6)) and {r.value for r in again} <= set(pool.pids)
        assert set(pool.charge_reports()) == set(pool.pids)
