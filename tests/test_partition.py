"""The partition is disjoint, covers every key, and balances bytes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel_dcp.engine.memory import ITEM_MEMORY_BYTES, TASK_MEMORY_BYTES
from parallel_dcp.engine.partition import (
    COORDINATOR_BYTES_PER_WORKER,
    ITEM_OVERHEAD_BYTES,
    MIN_TASK_BYTES,
    TASKS_PER_WORKER,
    Item,
    partition,
    task_count,
)

sizes = st.lists(st.integers(min_value=0, max_value=1 << 30), min_size=0, max_size=300)


@settings(max_examples=200, deadline=None)
@given(sizes=sizes, workers=st.integers(min_value=1, max_value=64))
def test_partition_is_disjoint_and_covers_every_key(sizes: list[int], workers: int) -> None:
    items = [Item(f"k{i}", n) for i, n in enumerate(sizes)]
    tasks = partition(items, workers)
    keys = [k for t in tasks for k in t.keys]
    assert sorted(keys) == sorted(i.key for i in items)
    assert len(keys) == len(set(keys))
    assert [t.index for t in tasks] == list(range(len(tasks)))
    assert all(t.keys for t in tasks)
    by_key = {i.key: i.nbytes for i in items}
    assert all(t.nbytes == sum(by_key[k] for k in t.keys) for t in tasks)
    if len(items) >= workers:
        assert len(tasks) >= workers
    if len(tasks) > workers:  # a whole number of tasks a worker: no last round with workers idle
        assert len(tasks) % workers == 0


def test_equal_items_balance_evenly() -> None:
    tasks = partition([Item(f"k{i}", 64 << 20) for i in range(64)], workers=4)
    loads = [t.nbytes for t in tasks]
    assert max(loads) == min(loads)


def test_one_large_item_does_not_starve_the_others() -> None:
    items = [Item("embedding", 1 << 30)] + [Item(f"layer{i}", 16 << 20) for i in range(64)]
    tasks = partition(items, workers=2)
    assert tasks[0].keys == ("embedding",), "largest task first, so it starts at once"
    rest = sum(t.nbytes for t in tasks[1:])
    assert rest == 64 * (16 << 20)


def test_many_small_items_are_spread_by_count() -> None:
    tasks = partition([Item(f"s{i}", 256) for i in range(50_000)], workers=2)
    counts = sorted(len(t.keys) for t in tasks)
    assert counts[-1] - counts[0] <= 1


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="workers"):
        partition([Item("a", 1)], workers=0)
    with pytest.raises(ValueError, match="unique"):
        partition([Item("a", 1), Item("a", 2)], workers=1)


@settings(max_examples=300, deadline=None)
@given(
    total=st.integers(min_value=1, max_value=1 << 44),
    workers=st.integers(min_value=1, max_value=256),
    items=st.integers(min_value=1, max_value=100_000),
)
def test_task_count_bounds(total: int, workers: int, items: int) -> None:
    count = task_count(total, workers, items)
    assert 1 <= count <= min(items, workers * TASKS_PER_WORKER)
    assert count >= min(workers, items)
    if count > workers:
        assert count % workers == 0
        smallest = max(MIN_TASK_BYTES, COORDINATOR_BYTES_PER_WORKER * workers)
        assert (count - 1) * smallest < total  # never cut finer than the coordinator can keep up with


def test_many_small_keys_on_many_workers_get_one_task_each() -> None:
    """50,000 keys of 10 KiB: 8 tasks on 2 workers and 64 on 16 (4 each), but on 64 workers 64 (one
    each), not 111: the coordinator's ~0.5 ms a task would outrun the workers, and 111 equal tasks
    on 64 workers run in two rounds of which the second leaves 17 workers idle."""
    items = [Item(f"state.{i}", 10 << 10) for i in range(50_000)]
    assert [len(partition(items, workers)) for workers in (1, 2, 16, 32, 64, 128)] == [4, 8, 64, 32, 64, 128]


def test_an_llm_like_dict_on_64_workers_is_one_task_each() -> None:
    items = [Item(f"layers.{i}.weight", (4 << 30) // 590) for i in range(590)]
    assert len(partition(items, 16)) == 64
    assert len(partition(items, 64)) == 64  # not 130 (32 MiB each): three rounds, the last of two tasks


def test_a_task_count_between_whole_rounds_is_rounded_down() -> None:
    """Five 32 MiB tasks' worth on two workers: four tasks (two rounds), not five (three)."""
    items = [Item(f"k{i}", (160 << 20) // 40 - ITEM_OVERHEAD_BYTES) for i in range(40)]
    tasks = partition(items, 2)
    assert len(tasks) == 4
    assert max(t.nbytes for t in tasks) - min(t.nbytes for t in tasks) <= (160 << 20) // 40


def test_plans_cut_as_on_other_workers_nest_and_need_one_worker() -> None:
    from parallel_dcp.engine.partition import planned_as_on

    items = [Item(f"k{i}", 1 << 20) for i in range(1000)]
    with planned_as_on(64):
        assert len(partition(items, 1)) == 64
        with planned_as_on(2):
            assert len(partition(items, 1)) == 8
        assert len(partition(items, 1)) == 64
    assert len(partition(items, 1)) == 4
    with pytest.raises(ValueError, match="workers"), planned_as_on(0):
        pass


def _consecutive(tasks: list, items: list[Item]) -> bool:
    """Every task's keys are one run of ``items``, in their order."""
    place = {item.key: i for i, item in enumerate(items)}
    return all(
        [place[k] for k in t.keys] == list(range(place[t.keys[0]], place[t.keys[0]] + len(t.keys))) for t in tasks
    )


@pytest.mark.parametrize("per_task", [20_000, 100])
def test_many_small_keys_under_a_memory_cap_stay_in_consecutive_runs(per_task: int) -> None:
    """50,000 small tensors whose one task would hold more than a task may: consecutive runs that
    each fit, not keys scattered one by one over the tasks (which made the commit build .metadata
    key by key: 1.9-2.9 s of the coordinator a save at 16 workers). Roomy, the 64 runs of an
    uncapped plan; tight, as many runs as the memory needs, in whole rounds of the 16 workers."""
    items = [Item(f"state.{i}", 4096) for i in range(50_000)]
    cap = TASK_MEMORY_BYTES + per_task * ITEM_MEMORY_BYTES
    tasks = partition(items, 16, max_task_memory=cap)
    assert sorted(k for t in tasks for k in t.keys) == sorted(i.key for i in items)
    assert all(t.memory <= cap for t in tasks)
    assert _consecutive(tasks, items)
    assert len(tasks) == (64 if per_task == 20_000 else 512)  # 50,000 / 100 = 500, in whole rounds of 16


memory_items = st.lists(
    st.tuples(st.integers(0, 1 << 22), st.integers(0, 1 << 22), st.integers(0, 1 << 22)), min_size=1, max_size=300
)


@settings(max_examples=200, deadline=None)
@given(
    columns=memory_items,
    workers=st.integers(min_value=1, max_value=64),
    room=st.integers(min_value=0, max_value=1 << 26),
    adds_up=st.booleans(),
)
def test_no_task_goes_over_its_memory_cap_unless_one_item_alone_does(
    columns: list[tuple[int, int, int]], workers: int, room: int, adds_up: bool
) -> None:
    items = [Item(f"k{i}", n, m, min(t, m)) for i, (n, m, t) in enumerate(columns)]
    cap = TASK_MEMORY_BYTES + room
    tasks = partition(items, workers, max_task_memory=cap, memory_adds_up=adds_up)
    keys = [k for t in tasks for k in t.keys]
    assert sorted(keys) == sorted(i.key for i in items) and len(keys) == len(set(keys))
    assert [t.index for t in tasks] == list(range(len(tasks)))
    assert all(t.memory <= cap or len(t.keys) == 1 for t in tasks)
