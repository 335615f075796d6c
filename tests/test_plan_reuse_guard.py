"""The layout check of a Saver's later save in one C pass (``_compat.layout_guard``, made once a
layout's save passed the check in Python): it refuses every change the Python passes refuse, and
each task's pickle is kept by the pool from one save to the next."""

from __future__ import annotations

import gc
import pickle
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import parallel_dcp
from parallel_dcp import _compat
from parallel_dcp.engine import pool as pool_module
from tests.test_plan_reuse import CHANGES, IN_PLACE, _assert_same_checkpoint, _Kinds, _memo, _state

# Savers in every test: their workers are forked from one fork server kept for the module.
pytestmark = pytest.mark.usefixtures("kept_fork_server")


def _guard_of(tensors: list[torch.Tensor]) -> _compat.LayoutGuard:
    guard = _compat.layout_guard(tensors, [t.shape for t in tensors], [t.stride() for t in tensors])
    assert guard is not None  # torch 2.13 has one: the fast path is what this file tests
    return guard


def test_the_guard_says_true_only_for_the_same_type_dtype_shape_and_strides() -> None:
    square, rows = torch.randn(8, 8), torch.randn(6, 4)
    guard = _guard_of([square, rows])
    assert guard([square, rows])
    assert guard([torch.zeros(8, 8), torch.ones(6, 4)])  # other tensors, the same layout
    refused = {
        "transposed": [square.t(), rows],  # the same shape and bytes, strides swapped
        "reshaped": [square, rows.view(4, 6)],
        "retyped": [square, rows.to(torch.float64)],
        "reinterpreted": [square, rows.view(torch.int32)],  # the same bytes and shape, another dtype
        "a parameter": [torch.nn.Parameter(square), rows],  # another exact type
        "a value": [square, 4],
        "fewer": [square],
        "more": [square, rows, rows],
        "strided view": [torch.randn(8, 16)[:, ::2], rows],
        "sparse": [square.to_sparse(), rows],
        "meta": [torch.empty(8, 8, device="meta"), rows],
    }
    assert {name: guard(later) for name, later in refused.items()} == dict.fromkeys(refused, False)


def test_the_guard_holds_a_tied_tensor_once_and_refuses_a_tie_undone() -> None:
    tied, other = torch.randn(5), torch.randn(2, 3)
    guard = _guard_of([tied, other, tied])  # (TensorGuards alone says False for an object passed twice)
    assert guard([tied, other, tied])
    fresh = torch.randn(5)
    assert guard([fresh, other, fresh])  # tied again, other tensors
    assert not guard([tied, other, torch.randn(5)])  # untied: no verdict, the Python passes decide
    untied = _guard_of([tied, other, torch.randn(5)])
    assert untied([tied, other, torch.randn(5)])
    assert not untied([tied, other, tied])  # tied now: TensorGuards refuses, the Python passes decide


def test_the_guard_keeps_no_tensor() -> None:
    tensor = torch.randn(4, 4)
    gone = weakref.ref(tensor)
    guard = _guard_of([tensor])
    del tensor
    gc.collect()
    assert gone() is None
    assert guard([torch.randn(4, 4)])


def _saved_thrice_then_changed(
    tmp_path: Path, changes: list[Callable[[dict[str, Any]], None]], *, layout_unchanged: bool
) -> dict[str, bool]:
    """Per change (one Saver for all): a state dict saved twice (the second save makes the guard),
    then changed and saved again (with the promise or not), compared with a fresh save of it;
    whether that save reused the layout."""
    reused = {}
    with parallel_dcp.Saver(workers=2) as saver:
        for change in changes:
            out = tmp_path / change.__name__
            out.mkdir()
            _memo(saver)._kept.clear()
            sd = _state()
            saver.save(sd, out / "first")
            saver.save(sd, out / "second")
            assert _memo(saver)._kept[0].guard is not None
            before = _memo(saver).reused
            change(sd)
            saver.save(sd, out / "changed", layout_unchanged=layout_unchanged)
            reused[change.__name__] = _memo(saver).reused > before
            parallel_dcp.save(sd, out / "save", workers=2, executor="processes")
            _assert_same_checkpoint(out / "changed", out / "save")
    return reused


@pytest.fixture(params=[None, 3], ids=["one chunk", "chunks of 3"])
def chunked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layout check as it runs over 50,000 tensors (jobs/plan_reuse.py's _chunked: type,
    address and guard chunk by chunk), here over this file's 50 tensors in chunks of 3: a change
    and a tie fall in any chunk, a tie across two."""
    if request.param is not None:
        monkeypatch.setattr(_compat, "GUARD_CHUNK", request.param)


def test_a_chunked_guard_checks_each_chunk_and_ties_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compat, "GUARD_CHUNK", 2)
    tensors = [torch.randn(3), torch.randn(2, 2), torch.randn(4), torch.randn(4), torch.randn(3)]
    tensors.append(tensors[1])  # place 5 (chunk 2) tied to place 1 (chunk 0)
    guard = _guard_of(tensors)
    assert guard.chunk == 2 and guard(tensors)
    assert [guard.part(tensors, k) for k in range(3)] == [True, True, True]
    later = [torch.randn(3), torch.randn(2, 2), torch.randn(4), torch.randn(4, 1), torch.randn(3)]
    later.append(later[1])
    assert [guard.part(later, k) for k in range(3)] == [True, False, True]  # place 3 reshaped
    assert not guard(later)
    untied = [*tensors[:5], torch.randn(2, 2)]
    assert [guard.part(untied, k) for k in range(3)] == [True, True, False]  # the tie undone
    newly_tied = list(tensors)
    newly_tied[4] = newly_tied[0]  # a new tie, across chunks: each place laid out as before
    assert guard(newly_tied)  # what the Python passes say too (a new tie is reused: the test below)
    within = [*tensors[:3], tensors[2], *tensors[4:]]  # a new tie within chunk 1
    assert not guard(within)  # TensorGuards: one object twice is no verdict (the Python passes decide)


def test_with_the_guard_made_every_change_in_place_is_refused_as_before(tmp_path: Path, chunked: None) -> None:
    reused = _saved_thrice_then_changed(tmp_path, [c for c, _, _ in IN_PLACE], layout_unchanged=False)
    assert reused == {c.__name__: r for c, r, _ in IN_PLACE}


def test_with_the_guard_made_every_change_of_layout_is_refused_as_before(tmp_path: Path, chunked: None) -> None:
    reused = _saved_thrice_then_changed(tmp_path, [c for c, _ in CHANGES], layout_unchanged=False)
    assert reused == {c.__name__: r for c, r in CHANGES}


def test_with_the_guard_made_moved_tensors_are_checked_under_the_promise_too(tmp_path: Path, chunked: None) -> None:
    moved = [(c, r) for c, r, same_bytes in IN_PLACE if not same_bytes]
    reused = _saved_thrice_then_changed(tmp_path, [c for c, _ in moved], layout_unchanged=True)
    assert reused == {c.__name__: r for c, r in moved}


def test_a_later_save_reads_no_tensors_dtype_or_shape_in_python_once_the_guard_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = _state()
    tensors = 10 + 40
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(sd, tmp_path / "first")
        kinds = _Kinds(monkeypatch)
        saver.save(sd, tmp_path / "second")  # checked in Python, which makes the guard
        assert kinds.read == tensors
        with torch.no_grad():
            for tensor in sd["optim"].values():
                tensor.mul_(0.5)
        saver.save(sd, tmp_path / "third")
        assert kinds.read == tensors  # the guard's pass alone
        sd["optim"]["s1"] = sd["optim"]["s0"]  # tied now: the guard refuses (one object twice), no verdict
        saver.save(sd, tmp_path / "fourth")
        assert kinds.read == 2 * tensors and _memo(saver).reused == 3  # the Python passes decide: reused
        saver.save(sd, tmp_path / "fifth")  # and the guard, made again, holds the tensors as they are
        assert kinds.read == 2 * tensors and _memo(saver).reused == 4
    parallel_dcp.save(sd, tmp_path / "save", workers=2, executor="processes")
    _assert_same_checkpoint(tmp_path / "fifth", tmp_path / "save")


def test_without_a_guard_a_later_save_checks_in_python_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_compat, "layout_guard", lambda *args: None)  # a torch without TensorGuards
    sd = _state()
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(sd, tmp_path / "first")
        kinds = _Kinds(monkeypatch)
        saver.save(sd, tmp_path / "second")
        saver.save(sd, tmp_path / "third")
        assert kinds.read == 2 * 50 and _memo(saver).reused == 2
        sd["model"]["square"].t_()
        saver.save(sd, tmp_path / "fourth")
        assert _memo(saver).reused == 2  # refused, as with the guard
    parallel_dcp.save(sd, tmp_path / "save", workers=2, executor="processes")
    _assert_same_checkpoint(tmp_path / "fourth", tmp_path / "save")


def test_each_tasks_pickle_is_kept_from_one_save_to_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[dict[int, bytes | None]] = []
    original = pool_module.WorkerPool._message

    def message(self: pool_module.WorkerPool, task: Any) -> Any:
        made, keep = original(self, task)
        if isinstance(made, pool_module._PartAt):  # (not the Saver's probe of its workers)
            sent[-1][task.index] = keep[0]  # the task's pickle, held for the worker to copy
        return made, keep

    monkeypatch.setattr(pool_module.WorkerPool, "_message", message)
    sd = _state()
    sent.append({})
    with parallel_dcp.Saver(workers=2) as saver:
        for name in ("first", "second", "third"):
            sent.append({})
            saver.save(sd, tmp_path / name)
    _, first, second, third = sent
    assert len(first) >= 2 and first.keys() == second.keys() == third.keys()
    # The second save planned the same Task objects: their pickles made once, sent again as they are.
    assert all(second[i] is third[i] for i in second)
    assert all(isinstance(b, bytes) and pickle.loads(b).index == i for i, b in third.items())
    parallel_dcp.save(sd, tmp_path / "save", workers=2, executor="processes")
    _assert_same_checkpoint(tmp_path / "third", tmp_path / "save")
