"""What a review of a Saver's and save()'s lifetime broke (round four), each pinned by a test:
two threads saving on one Saver took each other's replies (a checkpoint committed without the
other's shards, reported as a success)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader

import parallel_dcp
from parallel_dcp.jobs import saver as saver_module
from tests.conftest import assert_same


def _state(seed: int, keys: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, 1024, generator=g) for i in range(keys)}


def _stock_load(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(out, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return out


def test_saves_from_two_threads_on_one_saver_run_one_at_a_time(tmp_path: Path) -> None:
    states = [_state(0), _state(1), {f"other{i}": torch.randn(300, 100) for i in range(5)}]
    errors: list[BaseException] = []
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(states[0], tmp_path / "warm")  # its layout kept: the next saves dispatch ahead
        for round_ in range(4):
            barrier = threading.Barrier(len(states))

            def run(i: int, r: int = round_, b: threading.Barrier = barrier) -> None:
                b.wait()
                try:
                    saver.save(states[i], tmp_path / f"{r}-{i}")
                except BaseException as exc:  # reported below
                    errors.append(exc)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(states))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            assert not any(t.is_alive() for t in threads)
    assert errors == []
    for round_ in range(4):
        for i, state in enumerate(states):
            assert_same(_stock_load(tmp_path / f"{round_}-{i}", state), state)


def test_a_save_from_inside_a_save_of_the_same_saver_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inner: list[BaseException] = []
    with parallel_dcp.Saver(workers=1) as saver:
        original = saver_module.SaverWorkers._save_here

        def reentrant(self: Any, *args: Any) -> Any:
            try:
                saver.save(_state(2, 2), tmp_path / "inner")
            except RuntimeError as exc:
                inner.append(exc)
            return original(self, *args)

        monkeypatch.setattr(saver_module.SaverWorkers, "_save_here", reentrant)
        saver.save(_state(3, 2), tmp_path / "outer")
    assert len(inner) == 1 and "inside a save" in str(inner[0])
    assert not (tmp_path / "inner").exists()
    assert_same(_stock_load(tmp_path / "outer", _state(3, 2)), _state(3, 2))
