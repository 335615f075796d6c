"""The partition is disjoint, covers every key, and balances bytes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel_dcp.engine.partition import Item, partition

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
