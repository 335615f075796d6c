"""The caps a partition reports (CapRange): inside them a fresh partition gives the very same tasks,
so a planner that keeps one plan per range (jobs/plan_reuse.py) plans what a fresh save plans."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel_dcp.engine.memory import ITEM_MEMORY_BYTES, TASK_MEMORY_BYTES, task_budget
from parallel_dcp.engine.partition import CapRange, Item, one_task_memory, partition
from parallel_dcp.jobs import targets
from parallel_dcp.jobs.plan_reuse import PlanReuse
from parallel_dcp.jobs.targets import DcpTarget


@st.composite
def layouts(draw: Any) -> tuple[list[Item], bool]:
    """Items as jobs make them: many small ones (consecutive runs), or a few large (largest first);
    their memory 0 (read in place), their bytes (copied), or a read buffer (transient)."""
    many = draw(st.booleans())
    count = draw(st.integers(20, 200) if many else st.integers(1, 40))
    largest = 64 << 10 if many else 64 << 20
    items = []
    for i in range(count):
        nbytes = draw(st.integers(0, largest))
        kind = draw(st.sampled_from(["in place", "copied", "read"]))
        memory = 0 if kind == "in place" else nbytes
        items.append(Item(f"k{i}", nbytes, memory, nbytes if kind == "read" else 0))
    return items, draw(st.booleans())


def _cap(items: list[Item], adds_up: bool, fraction: float) -> int:
    """A cap at ``fraction`` of the way from one task's fixed cost to one task holding every item."""
    whole = one_task_memory(items, memory_adds_up=adds_up)
    return max(1, TASK_MEMORY_BYTES + int(fraction * (whole - TASK_MEMORY_BYTES)))


@settings(max_examples=300, deadline=None)
@given(
    layout=layouts(),
    workers=st.integers(1, 16),
    fraction=st.floats(0, 1.3),
    other=st.floats(0, 1.3),
    inside=st.lists(st.floats(0, 1), min_size=1, max_size=6),
)
def test_inside_the_caps_a_fresh_partition_is_the_same(
    layout: tuple[list[Item], bool], workers: int, fraction: float, other: float, inside: list[float]
) -> None:
    items, adds_up = layout
    cap = _cap(items, adds_up, fraction)
    caps = CapRange()
    tasks = partition(items, workers, max_task_memory=cap, memory_adds_up=adds_up, caps=caps)
    assert cap in caps
    # Another cap anywhere (mostly outside), and a few drawn from inside the range: where the range
    # holds a cap, the partition under it is the same.
    lo = max(caps.lo, 1)  # (-inf where no comparison bound it below)
    within = [int(lo + at * (min(caps.hi, 2 * cap + (1 << 30)) - 1 - lo)) for at in inside]
    for again in (_cap(items, adds_up, other), *within):
        if again in caps:
            assert partition(items, workers, max_task_memory=again, memory_adds_up=adds_up) == tasks


def test_the_caps_reach_as_far_as_one_task_holds_everything() -> None:
    items = [Item(f"k{i}", 1024, 1024, 0) for i in range(64)]
    whole = one_task_memory(items)
    caps = CapRange()
    partition(items, 4, max_task_memory=whole, caps=caps)
    assert (caps.lo, caps.hi) == (whole, float("inf"))
    partition(items, 4, caps=caps)  # no cap: every cap
    assert (caps.lo, caps.hi) == (float("-inf"), float("inf"))


def test_50000_small_keys_keep_their_plan_while_the_default_limit_drifts() -> None:
    """The default limit is half the memory available, which moves save to save by a few MB: the
    runs of 50,000 small keys (as a Saver(16) cuts them under it) hold over a range that wide."""
    items = [Item(f"k{i}", 256, 0, 0) for i in range(50_000)]
    cap = task_budget(6 << 30, 16) // 8  # (binding: the job's memory is 50,000 items' fixed cost)
    assert one_task_memory(items) > cap
    caps = CapRange()
    tasks = partition(items, 16, max_task_memory=cap, caps=caps)
    assert caps.hi - caps.lo > ITEM_MEMORY_BYTES * 100
    for again in (int(caps.lo), int(caps.hi) - 1):
        assert partition(items, 16, max_task_memory=again) == tasks


def test_a_saver_plans_once_while_a_binding_budget_moves_inside_the_caps(tmp_path: Path) -> None:
    """The memo takes a kept plan exactly where its caps hold the new room: what it returns is
    always a fresh plan's, and it plans afresh only for a room outside every kept plan's caps."""
    memo = PlanReuse()
    sd = {f"k{i}": torch.full((256,), float(i)) for i in range(2000)}
    job = memo.job(sd, str(tmp_path), pending_writes=True)
    target = DcpTarget(tmp_path / "out")
    target.plans = memo
    ranges: list[CapRange] = []

    def plan(items: list[Item], workers: int, budget: int, caps: CapRange) -> list[Any]:
        ranges.append(caps)
        return target._plan(True, items, workers, budget, caps)

    items = targets._items(job)
    whole = one_task_memory(items)
    nbytes = sum(item.nbytes for item in items)
    budgets = [whole // 2 + 37_000 * step for step in range(30)] + [whole // 3, whole // 2, 2 * whole]
    for budget in budgets:
        room = target._room(nbytes, budget)
        expected_new = not any(room in caps for caps in ranges[-4:])
        made = len(ranges)
        tasks = memo.tasks(job, 4, budget, targets._items, target._room, plan, ("decision",))
        assert tasks == target._plan(True, items, 4, budget)
        assert len(ranges) == made + expected_new
    assert len(ranges) < len(budgets) // 3  # the budget moved every time; the plan rarely changed


def test_inside_the_caps_on_seeded_layouts_of_many_small_keys() -> None:
    """The same on 500 seeded layouts of 20-400 small keys under a binding cap, 5 caps drawn inside
    each range: runs cut where they fill up (``_filled_in_order``) are common here, rare in the
    draws above (a range that ignored where those cuts fall fails ~1 cap in 20 here)."""
    rng = random.Random(30)
    for _ in range(500):
        items = []
        for i in range(rng.randint(20, 400)):
            nbytes, kind = rng.randint(0, 64 << 10), rng.choice(["in place", "copied", "read"])
            items.append(Item(f"k{i}", nbytes, 0 if kind == "in place" else nbytes, nbytes if kind == "read" else 0))
        workers, adds_up = rng.randint(1, 8), rng.random() < 0.5
        whole = one_task_memory(items, memory_adds_up=adds_up)
        cap = TASK_MEMORY_BYTES + int(rng.random() * (whole - TASK_MEMORY_BYTES))
        caps = CapRange()
        tasks = partition(items, workers, max_task_memory=cap, memory_adds_up=adds_up, caps=caps)
        for _ in range(5):
            again = rng.randint(int(max(caps.lo, 1)), int(min(caps.hi, whole + 1)) - 1)
            assert partition(items, workers, max_task_memory=again, memory_adds_up=adds_up) == tasks
