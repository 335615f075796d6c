"""A Saver's saves of one layout reuse the listing, the plan and the parts (jobs/plan_reuse.py),
and every change of layout is planned afresh: each save writes what a fresh save writes."""

from __future__ import annotations

import collections
import gc
import re
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import parallel_dcp
from parallel_dcp.engine.partition import CapRange, Item, one_task_memory
from parallel_dcp.errors import InvalidStateDictError
from parallel_dcp.formats.remote_memory_source import RemoteMemorySource
from parallel_dcp.jobs import plan_reuse, targets
from parallel_dcp.jobs.plan_reuse import PlanReuse
from parallel_dcp.jobs.targets import DcpTarget
from tests.conftest import assert_same, shards_by_task

# Savers in every test: their workers are forked from one fork server kept for the module.
pytestmark = pytest.mark.usefixtures("kept_fork_server")

_SHARD = re.compile(r"__(\d+)_\w+_0\.distcp")


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    wide = torch.randn(64, 96)
    shared = torch.randn(6, 10)
    return {
        "model": {
            "w": torch.randn(128, 256),
            "bf16": torch.randn(300, 7).to(torch.bfloat16),
            "transposed": torch.randn(40, 24).t(),
            "strided": wide[:, ::3],
            "rows": wide[10:20],
            "tied_a": shared,
            "tied_b": shared,  # one storage, two keys
            "big": torch.randn(160, 128),  # 80 KiB: the writer copies it itself
            "square": torch.randn(32, 32),
            "empty": torch.zeros(0),  # no bytes: its address is 0
        },
        "optim": {f"s{i}": torch.full((4,), float(i)) for i in range(40)},
        "step": 7,
        "name": "run",
    }


def _metadata(path: Path) -> tuple[Any, Any, dict[Any, tuple[int, int, int]]]:
    """A checkpoint's .metadata, its shards named by task (their names carry the save id)."""
    metadata = FileSystemReader(str(path)).read_metadata()
    stored = {}
    for index, data in metadata.storage_data.items():
        match = _SHARD.fullmatch(data.relative_path)
        assert match, data.relative_path
        stored[index] = (int(match.group(1)), data.offset, data.length)
    return metadata.state_dict_metadata, metadata.planner_data, stored


def _assert_same_checkpoint(actual: Path, expected: Path) -> None:
    assert shards_by_task(actual) == shards_by_task(expected)
    assert _metadata(actual) == _metadata(expected)


def _memo(saver: parallel_dcp.Saver) -> PlanReuse:
    return saver._live()._plans


class _Count:
    """Counts calls of a function while it stays what it was."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
        self.calls = 0
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)


def test_a_second_save_of_the_same_layout_is_planned_once_and_writes_what_save_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = _state()
    with parallel_dcp.Saver(workers=2) as saver:
        first = saver.save(sd, tmp_path / "first")
        with torch.no_grad():  # a training step: every tensor updated in place, the step counted
            for group in ("model", "optim"):
                for tensor in sd[group].values():
                    tensor.add_(1)
        sd["step"] = 8
        partitions = _Count(monkeypatch, targets, "partition")
        parts = _Count(monkeypatch, RemoteMemorySource, "part")
        second = saver.save(sd, tmp_path / "second")
        assert _memo(saver).reused == 1
    assert partitions.calls == 0  # the plan was the first save's
    assert parts.calls == 0  # and so were the parts (a task's values, the step, sent as they are now)
    assert second.tasks == first.tasks
    parallel_dcp.save(sd, tmp_path / "save", workers=2, executor="processes")
    with parallel_dcp.Saver(workers=2) as fresh:
        fresh.save(sd, tmp_path / "fresh")
    _assert_same_checkpoint(tmp_path / "second", tmp_path / "save")
    _assert_same_checkpoint(tmp_path / "second", tmp_path / "fresh")
    assert shards_by_task(tmp_path / "first") != shards_by_task(tmp_path / "second")
    loaded = parallel_dcp.load(tmp_path / "second")
    assert loaded["step"] == 8
    assert_same(loaded["model"], sd["model"])


def _clone_all(sd: dict[str, Any]) -> None:  # the same layout at other addresses
    for group in ("model", "optim"):
        sd[group] = {k: v.clone() if v.is_contiguous() else v for k, v in sd[group].items()}


def _untie(sd: dict[str, Any]) -> None:  # two keys that shared a storage now have their own
    sd["model"]["tied_b"] = sd["model"]["tied_b"].clone()


def _transpose(sd: dict[str, Any]) -> None:  # the same shape and dtype, other strides
    sd["model"]["w"] = torch.randn(256, 128).t()


def _reshape(sd: dict[str, Any]) -> None:
    sd["model"]["w"] = torch.randn(256, 128)


def _retype(sd: dict[str, Any]) -> None:
    sd["model"]["w"] = sd["model"]["w"].double()


def _add(sd: dict[str, Any]) -> None:
    sd["optim"]["s40"] = torch.ones(4)


def _drop(sd: dict[str, Any]) -> None:
    del sd["optim"]["s0"]


def _reorder(sd: dict[str, Any]) -> None:
    sd["optim"] = dict(reversed(sd["optim"].items()))


def _renest(sd: dict[str, Any]) -> None:  # the same flattened name, another nesting
    sd["model.w"] = sd["model"].pop("w")


def _longer_value(sd: dict[str, Any]) -> None:
    sd["name"] = "a run with a much longer name"


def _value_to_tensor(sd: dict[str, Any]) -> None:
    sd["step"] = torch.tensor(8)


def _value_to_nesting(sd: dict[str, Any]) -> None:
    sd["name"] = {"inner": "run"}


# In place: the tensor object stays, its layout changes.
def _set_other_memory(sd: dict[str, Any]) -> None:  # moved: the same layout, the bytes elsewhere
    sd["model"]["w"].set_(torch.randn(128, 256))


def _set_fewer_rows(sd: dict[str, Any]) -> None:  # the same storage and address, fewer rows
    w = sd["model"]["w"]
    w.set_(w.untyped_storage(), 0, (64, 256), (256, 1))


def _data_other_memory(sd: dict[str, Any]) -> None:  # .data = keeps the version counter
    sd["model"]["w"].data = torch.randn(128, 256)


def _data_view(sd: dict[str, Any]) -> None:  # the same bytes, another shape
    w = sd["model"]["w"]
    w.data = w.data.view(256, 128)


def _data_retyped(sd: dict[str, Any]) -> None:  # the same bytes and shape, another dtype
    w = sd["model"]["w"]
    w.data = w.data.view(torch.int32)


def _resize_smaller(sd: dict[str, Any]) -> None:  # within its storage: the bytes stay
    sd["model"]["w"].resize_(64, 256)


def _resize_larger(sd: dict[str, Any]) -> None:  # reallocated
    sd["optim"]["s3"].resize_(4096)


def _transpose_in_place(sd: dict[str, Any]) -> None:  # the same shape, dtype and bytes; strides swapped
    sd["model"]["square"].t_()


def _as_strided_in_place(sd: dict[str, Any]) -> None:
    sd["model"]["w"].as_strided_((128, 128), (256, 2))


# (change, whether the second save reuses the first one's layout)
CHANGES: list[tuple[Callable[[dict[str, Any]], None], bool]] = [
    (_clone_all, True),
    (_untie, True),
    (_transpose, False),
    (_reshape, False),
    (_retype, False),
    (_add, False),
    (_drop, False),
    (_reorder, False),
    (_renest, False),
    (_longer_value, False),
    (_value_to_tensor, False),
    (_value_to_nesting, False),
]
# The same, in place (the tensor object stays): (change, reused, whether every tensor's bytes stay
# where they were: the changes Saver.save(layout_unchanged=True) does not look for).
IN_PLACE: list[tuple[Callable[[dict[str, Any]], None], bool, bool]] = [
    (_set_other_memory, True, False),
    (_set_fewer_rows, False, True),
    (_data_other_memory, True, False),
    (_data_view, False, True),
    (_data_retyped, False, True),
    (_resize_smaller, False, True),
    (_resize_larger, False, False),
    (_transpose_in_place, False, True),
    (_as_strided_in_place, False, True),
]


@pytest.mark.parametrize(("change", "reused"), CHANGES, ids=[c.__name__.strip("_") for c, _ in CHANGES])
def test_a_changed_state_dict_writes_what_a_fresh_save_writes(
    tmp_path: Path, change: Callable[[dict[str, Any]], None], reused: bool
) -> None:
    sd = _state()
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(sd, tmp_path / "first")
        change(sd)
        saver.save(sd, tmp_path / "second")
        assert _memo(saver).reused == int(reused)
        saver.save(sd, tmp_path / "third")  # and the changed layout is the one kept now
        assert _memo(saver).reused == int(reused) + 1
    parallel_dcp.save(sd, tmp_path / "save", workers=2, executor="processes")
    _assert_same_checkpoint(tmp_path / "second", tmp_path / "save")
    _assert_same_checkpoint(tmp_path / "third", tmp_path / "save")


def _each_change_saved_again(
    tmp_path: Path, changes: list[Callable[[dict[str, Any]], None]], *, layout_unchanged: bool
) -> dict[str, bool]:
    """Per change (one Saver for all): a state dict saved, changed, saved again (with the promise
    or not) and compared with a fresh save of it; whether the second save reused the layout."""
    reused = {}
    with parallel_dcp.Saver(workers=2) as saver:
        for change in changes:
            out = tmp_path / change.__name__
            out.mkdir()
            _memo(saver)._kept.clear()  # the layouts of the changes before are not this one's
            sd = _state()
            saver.save(sd, out / "first")
            before = _memo(saver).reused
            change(sd)
            saver.save(sd, out / "second", layout_unchanged=layout_unchanged)
            reused[change.__name__] = _memo(saver).reused > before
            parallel_dcp.save(sd, out / "save", workers=2, executor="processes")
            _assert_same_checkpoint(out / "second", out / "save")
    return reused


def test_a_state_dict_changed_in_place_writes_what_a_fresh_save_writes(tmp_path: Path) -> None:
    reused = _each_change_saved_again(tmp_path, [c for c, _, _ in IN_PLACE], layout_unchanged=False)
    assert reused == {c.__name__: r for c, r, _ in IN_PLACE}


def test_with_the_promise_every_change_but_a_relayout_over_the_same_bytes_is_still_caught(tmp_path: Path) -> None:
    moved = [(c, r) for c, r in CHANGES] + [(c, r) for c, r, same_bytes in IN_PLACE if not same_bytes]
    reused = _each_change_saved_again(tmp_path, [c for c, _ in moved], layout_unchanged=True)
    assert reused == {c.__name__: r for c, r in moved}


class _Kinds:
    """Counts the tensors whose dtype and shape plan_reuse reads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.read = 0
        original = plan_reuse._kind

        def kind(tensor: torch.Tensor) -> Any:
            self.read += 1
            return original(tensor)

        monkeypatch.setattr(plan_reuse, "_kind", kind)


def test_with_the_promise_a_training_step_is_saved_without_reading_each_tensors_dtype_and_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = _state()
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(sd, tmp_path / "first")
        kinds = _Kinds(monkeypatch)
        with torch.no_grad():
            for tensor in sd["optim"].values():
                tensor.mul_(0.5)
        sd["step"] = 8
        saver.save(sd, tmp_path / "promised", layout_unchanged=True)
        assert kinds.read == 0
        saver.save(sd, tmp_path / "checked")  # no promise: every tensor compared
        assert kinds.read == 10 + 40
        assert _memo(saver).reused == 2
        parallel_dcp.save(sd, tmp_path / "save", workers=2, executor="processes")
        _transpose_in_place(sd)  # a broken promise is taken at its word: the layout before
        saver.save(sd, tmp_path / "broken", layout_unchanged=True)
        assert _memo(saver).reused == 3 and kinds.read == 50
    _assert_same_checkpoint(tmp_path / "promised", tmp_path / "save")
    _assert_same_checkpoint(tmp_path / "checked", tmp_path / "save")
    # The strides it was promised: the square's bytes read in their order before the transpose.
    square = parallel_dcp.load(tmp_path / "broken")["model"]["square"]
    assert torch.equal(square, sd["model"]["square"].t()) and not torch.equal(square, sd["model"]["square"])


def test_a_state_dict_walked_along_its_nesting_sees_a_value_that_nests_now(tmp_path: Path) -> None:
    sd: dict[str, Any] = {f"k{i}": torch.full((3,), float(i)) for i in range(50)} | {"step": 1}
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(sd, tmp_path / "a")
        assert _memo(saver)._layout is not None and _memo(saver)._layout.nesting is not None
        sd["step"] = 2
        saver.save(sd, tmp_path / "b")
        assert _memo(saver).reused == 1
        sd["step"] = [1, 2]  # a list: DCP walks it, two keys now
        saver.save(sd, tmp_path / "c")
        assert _memo(saver).reused == 1
    parallel_dcp.save(sd, tmp_path / "save", workers=2, executor="processes")
    _assert_same_checkpoint(tmp_path / "c", tmp_path / "save")


def test_layouts_saved_in_turn_are_each_reused(tmp_path: Path) -> None:
    model, optim = _state()["model"], _state()["optim"]
    with parallel_dcp.Saver(workers=2) as saver:
        for step in range(3):  # a loop that checkpoints its model and its optimizer apart
            saver.save(model, tmp_path / f"model{step}")
            saver.save(optim, tmp_path / f"optim{step}")
        assert _memo(saver).reused == 4
    parallel_dcp.save(model, tmp_path / "model", workers=2, executor="processes")
    parallel_dcp.save(optim, tmp_path / "optim", workers=2, executor="processes")
    _assert_same_checkpoint(tmp_path / "model2", tmp_path / "model")
    _assert_same_checkpoint(tmp_path / "optim2", tmp_path / "optim")


def test_a_kept_layout_nested_otherwise_costs_no_flattening(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A model's flat keys and an optimizer's nested state saved in turn: each save first meets the
    # other's layout, which its nesting rules out at once (no flattening of the whole state dict).
    model = {f"layers.{i}.weight": torch.full((3,), float(i)) for i in range(30)}
    optim = {"state": _state()["optim"], "param_groups": [{"lr": 0.1}]}
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(model, tmp_path / "model0")
        saver.save(optim, tmp_path / "optim0")
        flattened = _Count(monkeypatch, plan_reuse, "flatten_checked")
        saver.save(model, tmp_path / "model1")
        saver.save(optim, tmp_path / "optim1")
        assert _memo(saver).reused == 2 and flattened.calls == 0
        # The same keys and paths in another kind of mapping: flattened once, then reused.
        saver.save(collections.OrderedDict(model), tmp_path / "ordered")
        assert _memo(saver).reused == 3 and flattened.calls == 1
    parallel_dcp.save(optim, tmp_path / "optim", workers=2, executor="processes")
    parallel_dcp.save(model, tmp_path / "model", workers=2, executor="processes")
    _assert_same_checkpoint(tmp_path / "optim1", tmp_path / "optim")
    _assert_same_checkpoint(tmp_path / "model1", tmp_path / "model")
    _assert_same_checkpoint(tmp_path / "ordered", tmp_path / "model")


def _to_meta(sd: dict[str, Any]) -> None:
    sd["model"]["w"] = torch.empty(128, 256, device="meta")


def _empty_to_meta(sd: dict[str, Any]) -> None:  # no bytes before or after: address 0 both times
    sd["model"]["empty"] = torch.empty(0, device="meta")


def _to_sparse(sd: dict[str, Any]) -> None:
    sd["model"]["w"] = torch.randn(128, 256).to_sparse()


def test_bad_input_after_a_good_save_fails_as_it_fails_a_first_save(tmp_path: Path) -> None:
    with parallel_dcp.Saver(workers=2) as saver:
        for change in (_to_meta, _empty_to_meta, _to_sparse):
            for promised in (False, True):
                out = tmp_path / f"{change.__name__}-{promised}"
                out.mkdir()
                sd = _state()
                saver.save(sd, out / "first")
                change(sd)
                with pytest.raises(InvalidStateDictError) as first:
                    parallel_dcp.save(sd, out / "save", workers=2, executor="processes")
                with pytest.raises(InvalidStateDictError) as second:
                    saver.save(sd, out / "second", layout_unchanged=promised)
                assert str(second.value) == str(first.value)
                assert not (out / "second").exists()


def test_the_memo_keeps_no_tensor_and_no_value_of_a_past_save(tmp_path: Path) -> None:
    sd = _state()
    name = "".join(["run-", str(id(sd))])  # made here: nothing else holds it
    sd["name"] = name
    tensor = weakref.ref(sd["model"]["w"])
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(sd, tmp_path / "first")
        saver.save(sd, tmp_path / "second")  # its parts kept too
        del sd
        gc.collect()
        assert tensor() is None
        assert sys.getrefcount(name) == 2  # this frame's and getrefcount's own
        assert _memo(saver)._layout is not None and _memo(saver)._kept[0].parts  # the layout is kept, its data is not


def _items(n: int, memory: int) -> list[Item]:
    return [Item(f"k{i}", 1024, memory, 0) for i in range(n)]


def test_the_partition_is_kept_by_the_caps_that_give_it(tmp_path: Path) -> None:
    memo = PlanReuse()
    sd = {f"k{i}": torch.full((256,), float(i)) for i in range(64)}
    job = memo.job(sd, str(tmp_path), pending_writes=True)
    target = DcpTarget(tmp_path / "out")
    target.plans = memo
    made: list[int] = []

    def plan(items: list[Item], workers: int, budget: int, caps: CapRange) -> list[Any]:
        made.append(budget)
        return target._plan(True, items, workers, budget, caps)

    def tasks(budget: int) -> list[Any]:
        return memo.tasks(job, 4, budget, targets._items, target._room, plan, ("decision",))

    roomy = tasks(2**40)
    assert tasks(2**40 + 12345) == roomy and made == [2**40]  # both above the whole job's memory
    assert memo._current is not None
    whole = one_task_memory(targets._items(job)) + target.io_memory(memo._current.items[(None, ())][1])
    assert tasks(whole) == roomy and len(made) == 1
    tight = tasks(whole // 8)  # binding: planned, and planned as without the memo
    assert len(made) == 2 and tight == target._plan(True, targets._items(job), 4, whole // 8)
    assert tasks(whole // 8) == tight and len(made) == 2
    other = memo.tasks(job, 4, 2**40, targets._items, target._room, plan, ("another",))
    assert other == roomy and len(made) == 3  # another target decision: planned again
    for step in range(10):  # a binding room that moves every save: what a fresh plan gives, a few kept
        budget = whole // 8 + 4096 * (step + 1)
        assert tasks(budget) == target._plan(True, targets._items(job), 4, budget)
    assert len(memo._current.tasks) <= 4 and all(len(kept) <= 4 for kept in memo._current.tasks.values())
