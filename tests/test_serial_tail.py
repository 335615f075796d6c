"""The coordinator's per-key work (issue 30, the serial tail): one pass over the keys, columns the
planner reads, and no step that grows with keys x workers. Counted, never timed."""

from __future__ import annotations

import cProfile
import heapq
import pickle
import pstats
from pathlib import Path
from typing import Any

import pytest
import torch

import parallel_dcp
from parallel_dcp.engine import partition as partition_module
from parallel_dcp.engine.memory import ITEM_MEMORY_BYTES, TASK_MEMORY_BYTES, MemoryGovernor
from parallel_dcp.engine.partition import ITEM_OVERHEAD_BYTES, Item, partition
from parallel_dcp.formats.memory_format import MemorySource
from parallel_dcp.formats.remote_memory_source import RemoteMemorySource, _layout
from parallel_dcp.jobs.pipeline import needed_space, plan_job
from parallel_dcp.jobs.targets import DcpTarget, Job
from parallel_dcp.options import Options


def _every_kind_of_key() -> dict[str, Any]:
    base = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    return {
        "contiguous": torch.randn(8, 4),
        "transposed": torch.randn(4, 8).t(),  # storage exactly its bytes, not contiguous
        "strided": base[:, ::2],  # a view with gaps: copied before writing
        "rows": base[8:16],  # a contiguous slice of a larger storage (aliased)
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "step": 7,
        "name": "run-1",
        "nested": {"bf16": torch.ones(3, 3, dtype=torch.bfloat16), "list": [torch.zeros(2), {"x": 1}]},
        "big": torch.zeros(1024, dtype=torch.int64),
    }


def test_opening_a_state_dict_sizes_every_key_as_the_per_key_rules_do() -> None:
    source = MemorySource("unused", state_dict=_every_kind_of_key())
    sizes = source.tensor_sizes()
    assert set(sizes) == set(source.entries)
    for key, entry in source.entries.items():
        assert sizes[key] == (entry.nbytes, MemorySource.copied_bytes(source, key)), key
    assert sizes["strided"][1] == sizes["strided"][0] > 0  # the one key a worker copies
    assert source.plain_tensors()
    # The job's sizes, read from the columns, are what sizing each unit on its own gives.
    keys = source.keys()
    job = Job(source, keys)
    assert job.sizes() == {unit: Job(source, keys)._sized(unit) for unit in keys}
    assert list(job.sizes()) == list(keys)
    # A cast is sized per unit (its memory holds the cast result), not from the columns.
    cast = Job(source, source.keys(), dtype=torch.bfloat16)
    assert cast.sizes()["contiguous"] == (8 * 4 * 2, 8 * 4 * 2)


def test_a_savers_source_sizes_and_pickles_what_its_layouts_say() -> None:
    state = _every_kind_of_key()
    source = RemoteMemorySource("unused", state_dict=state)
    flat = source._flat
    for key, entry in source.entries.items():
        tensor = flat[key]
        layout = _layout(tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size())
        assert source.copied_bytes(key) == layout.memory(), key
        assert source.tensor_sizes()[key] == (entry.nbytes, layout.memory()), key
    # What a worker unpickles: the same entries, and each tensor's layout.
    worker = pickle.loads(pickle.dumps(source))
    assert worker.entries == source.entries
    assert worker.values == source.values and worker.mapping == source.mapping
    for key in source.entries:
        tensor = flat[key]
        assert worker._layouts[key] == _layout(
            tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size()
        )
        assert worker.copied_bytes(key) == source.copied_bytes(key)


def _plan_calls(keys: int, workers: int) -> int:
    """Python-level calls made while opening and planning a save of ``keys`` small tensors."""
    state = {f"layer{i}.weight": torch.full((4,), float(i)) for i in range(keys)}
    options = Options(workers=workers, executor="processes", memory_limit="8GiB")
    governor = MemoryGovernor(options.memory_ceiling())  # its own reading: outside the count
    profile = cProfile.Profile()
    profile.enable()
    source = MemorySource("unused", state_dict=state)
    plan = plan_job(Job(source, source.keys()), DcpTarget("unused"), options, governor)
    needed_space(plan.job)
    profile.disable()
    return sum(row[1] for row in pstats.Stats(profile).stats.values())  # type: ignore[attr-defined]


def test_opening_and_planning_make_few_calls_per_key_and_none_per_key_and_worker() -> None:
    small, large = _plan_calls(1000, 2), _plan_calls(3000, 2)
    per_key = (large - small) / 2000
    # One pass: a few calls per key (the entry, its sizes' tuple, the item). Before: 43.
    assert per_key <= 8, f"{per_key:.1f} calls per key"
    # 64 workers plan more tasks, but no step walks every key once per worker.
    assert _plan_calls(3000, 64) - large < 3000


def test_partition_skips_a_full_task_once_not_once_per_item(monkeypatch: pytest.MonkeyPatch) -> None:
    pops = 0
    real = heapq.heappop

    def counted(heap: list[Any]) -> Any:
        nonlocal pops
        pops += 1
        return real(heap)

    class _Heapq:
        heappop = staticmethod(counted)
        heappush = staticmethod(heapq.heappush)
        heapreplace = staticmethod(heapq.heapreplace)

    monkeypatch.setattr(partition_module, "heapq", _Heapq)
    # Equal items, 10 to a task by memory: the tasks fill up and the planner opens new ones.
    memory = 1 << 20
    cap = TASK_MEMORY_BYTES + 10 * (memory + ITEM_MEMORY_BYTES)

    def pops_for(n: int) -> int:
        nonlocal pops
        pops = 0
        # (one large item among them: small ones alone are cut into consecutive runs, no heap)
        items = [Item(f"k{i}", 4096, memory) for i in range(n)] + [Item("large", 100 << 20, memory)]
        tasks = partition(items, 2, max_task_memory=cap)
        assert sorted(k for t in tasks for k in t.keys) == sorted(it.key for it in items)
        assert all(t.memory <= cap for t in tasks)
        return pops

    # Linear in the items: each full task leaves the heap for good (before: every later item
    # popped every full task, 10x the pops at 4x the items).
    assert pops_for(2000) <= 5 * pops_for(500)
    assert pops_for(2000) <= 3 * 2000


def test_ranges_cut_where_each_items_middle_falls() -> None:
    sizes = [(i * 7919) % 50_000 for i in range(997)]
    items = [Item(f"k{i}", n) for i, n in enumerate(sizes)]
    bins = 17
    total = sum(n + ITEM_OVERHEAD_BYTES for n in sizes)
    runs = partition_module._ranges(items, bins, total)
    assert [it for run in runs for it in run] == items  # consecutive, in order
    done = 0
    for index, run in enumerate(runs):
        for it in run:
            middle = done + (it.nbytes + ITEM_OVERHEAD_BYTES) / 2
            assert index * total <= middle * bins  # not before its run
            assert index == bins - 1 or middle * bins < (index + 1) * total  # nor after it
            done += it.nbytes + ITEM_OVERHEAD_BYTES


def test_a_save_of_every_kind_of_key_reads_back(tmp_path: Path) -> None:
    state = _every_kind_of_key()
    parallel_dcp.save(state, tmp_path / "ckpt", workers=2)
    back = parallel_dcp.load(tmp_path / "ckpt")
    assert torch.equal(back["strided"], state["strided"]) and torch.equal(back["rows"], state["rows"])
    assert torch.equal(back["transposed"], state["transposed"]) and back["step"] == 7


def test_an_optimizers_long_list_of_param_ids_costs_no_call_per_id() -> None:
    from parallel_dcp.engine.threads import plain_value
    from parallel_dcp.formats.validate import flatten_checked

    ids = list(range(20_000))
    state = {"optimizer": {"state": {"0": {"step": torch.ones(1)}}, "param_groups": [{"lr": 0.1, "params": ids}]}}
    profile = cProfile.Profile()
    profile.enable()
    flat, _ = flatten_checked(state)
    plain = plain_value(flat["optimizer.param_groups.0.params"])
    profile.disable()
    assert plain and flat["optimizer.param_groups.0.params"] is ids  # kept whole, as DCP keeps it
    calls = sum(row[1] for row in pstats.Stats(profile).stats.values())  # type: ignore[attr-defined]
    assert calls < 200, f"{calls} calls for one list of 20,000 ids (before: one or more per id)"
    # A list that is not all scalars still gets the full rule.
    assert not plain_value([1, 2, object()]) and plain_value([1, (2, "x"), {"a": None}])


def test_a_jobs_totals_are_the_sums_over_its_sizes_made_once() -> None:
    sd = _every_kind_of_key() | {"step": 3, "big": torch.zeros(300)}
    source = MemorySource("unused", state_dict=sd)
    job = Job(source, source.keys()).split(256)  # "big" (1200 bytes) in chunks
    assert job.chunks
    sizes = job.sizes()
    memories = [m for _, m in sizes.values()]
    total, most, place = job.totals()
    assert total == sum(n for n, _ in sizes.values()) and most == max(memories)
    assert place == memories.index(most) and job.sizes()[job.keys[place]][1] == most
    job._ordered_sizes.clear()  # (the sizes are not asked for again: the totals are kept)
    assert job.totals() == (total, most, place) and not job._ordered_sizes
    empty = Job(MemorySource("unused", state_dict={}), ())
    assert empty.totals() == (0, 0, -1)
