"""Failures surface with their diagnosis, commit nothing, and leave the destination as it was."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

import parallel_dcp
from parallel_dcp import (
    CheckpointExistsError,
    InvalidDestinationError,
    InvalidStateDictError,
    RemoteTraceback,
    WorkerCrashed,
    WorkerError,
)
from tests.conftest import assert_same
from tests.faults import ExitWorker, KillWorker, RaiseInWorker, SegfaultWorker


def state_with(bad: Any) -> dict[str, Any]:
    sd: dict[str, Any] = {f"w{i}": torch.randn(64, 64) for i in range(8)}
    sd["bad_value"] = bad
    return sd


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def test_worker_exception_reaches_the_caller_with_its_traceback(tmp_path: Path) -> None:
    with pytest.raises(WorkerError) as info:
        parallel_dcp.save(state_with(RaiseInWorker()), tmp_path / "ckpt", workers=2)
    error = info.value
    assert "injected failure while pickling in the worker" in str(error)
    assert "'bad_value'" in str(error) and "bad_value" in error.keys
    assert isinstance(error.__cause__, RemoteTraceback)
    assert "__reduce__" in error.__cause__.text and "Traceback" in error.__cause__.text
    assert leftovers(tmp_path) == [], "no checkpoint, no staging directory"


CRASHES = [
    pytest.param(KillWorker(signal.SIGKILL), r"SIGKILL\(-9\)", id="sigkill"),
    pytest.param(ExitWorker(3), r"exit code 3", id="os._exit"),
    pytest.param(SegfaultWorker(), r"SIGSEGV\(-11\)", id="segfault"),
]


@pytest.mark.parametrize(("bad", "pattern"), CRASHES)
def test_a_dead_worker_is_named_with_its_exit_and_keys(bad: Any, pattern: str, tmp_path: Path) -> None:
    with pytest.raises(WorkerCrashed, match=pattern) as info:
        parallel_dcp.save(state_with(bad), tmp_path / "ckpt", workers=2)
    assert "bad_value" in info.value.keys
    assert "'bad_value'" in str(info.value)
    assert leftovers(tmp_path) == []


def test_existing_checkpoint_is_refused_without_overwrite(tmp_path: Path) -> None:
    old = {"w": torch.ones(3)}
    parallel_dcp.save(old, tmp_path / "ckpt", workers=1)
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    with pytest.raises(CheckpointExistsError, match="overwrite"):
        parallel_dcp.save({"w": torch.zeros(3)}, tmp_path / "ckpt", workers=1)
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before
    assert leftovers(tmp_path) == ["ckpt"]


def test_overwrite_replaces_the_checkpoint(tmp_path: Path) -> None:
    parallel_dcp.save({"w": torch.ones(3), "old_only": torch.ones(1)}, tmp_path / "ckpt", workers=2)
    new = {"w": torch.full((3,), 5.0), "fresh": torch.arange(4)}
    parallel_dcp.save(new, tmp_path / "ckpt", workers=2, overwrite=True)
    assert_same(parallel_dcp.load(tmp_path / "ckpt"), new)
    assert leftovers(tmp_path) == ["ckpt"], "the old checkpoint and the staging directory are gone"


@pytest.mark.parametrize("bad", [RaiseInWorker(), KillWorker()], ids=["raises", "sigkill"])
def test_failed_overwrite_leaves_the_old_checkpoint_intact(bad: Any, tmp_path: Path) -> None:
    old = {"w": torch.arange(10.0), "meta": "old"}
    parallel_dcp.save(old, tmp_path / "ckpt", workers=2)
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    with pytest.raises((WorkerError, WorkerCrashed)):
        parallel_dcp.save(state_with(bad), tmp_path / "ckpt", workers=2, overwrite=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before
    assert_same(parallel_dcp.load(tmp_path / "ckpt"), old)
    assert leftovers(tmp_path) == ["ckpt"]


def test_destination_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(InvalidDestinationError, match="is a file"):
        parallel_dcp.save({"w": torch.ones(1)}, tmp_path / "file")
    assert (tmp_path / "file").read_text() == "not a directory"


def test_destination_inside_a_missing_parent(tmp_path: Path) -> None:
    with pytest.raises(InvalidDestinationError, match="does not exist"):
        parallel_dcp.save({"w": torch.ones(1)}, tmp_path / "missing" / "ckpt")
    assert leftovers(tmp_path) == []


def test_foreign_directory_is_never_overwritten(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "precious.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(InvalidDestinationError, match="not a DCP checkpoint"):
            parallel_dcp.save({"w": torch.ones(1)}, tmp_path / "ckpt", overwrite=overwrite)
    assert (tmp_path / "ckpt" / "precious.txt").read_text() == "keep me"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_parent(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(InvalidDestinationError, match="not writable"):
            parallel_dcp.save({"w": torch.ones(1)}, tmp_path / "ckpt")
    finally:
        tmp_path.chmod(0o700)


def test_an_empty_existing_directory_is_used(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    parallel_dcp.save({"w": torch.ones(2)}, tmp_path / "ckpt", workers=1)
    assert_same(parallel_dcp.load(tmp_path / "ckpt"), {"w": torch.ones(2)})


BAD_INPUT = [
    pytest.param({1: torch.ones(1)}, "not a string", id="int-key"),
    pytest.param({"a": {("x", 1): torch.ones(1)}}, "not a string", id="tuple-key-nested"),
    pytest.param({"a": {"b": torch.ones(1)}, "a.b": torch.ones(1)}, "flatten to the same name", id="flatten-clash"),
    pytest.param({"s": torch.ones(3).to_sparse()}, "layout", id="sparse"),
    pytest.param({"m": torch.empty(3, device="meta")}, "meta", id="meta"),
    pytest.param({"q": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)}, "quantized", id="quantized"),
    pytest.param([torch.ones(1)], "must be a mapping", id="not-a-mapping"),
]


@pytest.mark.parametrize(("sd", "pattern"), BAD_INPUT)
def test_bad_input_fails_before_any_write(sd: Any, pattern: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidStateDictError, match=pattern):
        parallel_dcp.save(sd, tmp_path / "ckpt", workers=2)
    assert leftovers(tmp_path) == []


def test_bad_options(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="workers"):
        parallel_dcp.save({"w": torch.ones(1)}, tmp_path / "ckpt", workers=0)
    with pytest.raises(TypeError, match="workers"):
        parallel_dcp.save({"w": torch.ones(1)}, tmp_path / "ckpt", workers=2.5)  # type: ignore[arg-type]
    assert leftovers(tmp_path) == []
