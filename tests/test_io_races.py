"""Another process in the checkpoint directory: symlinks planted while a save runs, an overwrite
while a load reads. Each attack runs in a real second process, forked from this one
(tests/forked_process.py: a fresh interpreter would import torch again first, 3-15 s)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import parallel_dcp
from parallel_dcp import ParallelDCPError
from tests.faults import WaitForFile
from tests.forked_process import ForkedProcess


def _save_held_by_a_marker(dest: Path, marker: Path, io: str) -> None:
    """The save under attack (in the second process): a task held until ``marker`` exists."""
    sd = {"w": torch.randn(256, 1024), "held": WaitForFile(str(marker))}
    try:
        parallel_dcp.save(sd, dest, workers=2, io=io)
    except parallel_dcp.ParallelDCPError as e:
        print("refused:", e)
        sys.exit(1)
    print("saved")


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_shard_names_planted_as_symlinks_during_a_save_are_never_written_through(tmp_path: Path, io: str) -> None:
    if io == "direct" and parallel_dcp.storage.io_mode.direct_refusal(tmp_path) is not None:
        pytest.skip("no O_DIRECT here")
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    dest, marker = tmp_path / "ckpt", tmp_path / "planted"
    saver = ForkedProcess(_save_held_by_a_marker, dest, marker, io)
    try:
        # The attacker: waits for the save's owner record, learns its id, plants every shard name.
        deadline = time.monotonic() + 120
        owners: list[str] = []
        while not owners and time.monotonic() < deadline:
            owners = [n for n in (os.listdir(dest) if dest.exists() else []) if n.startswith(".parallel_dcp.owner.")]
            time.sleep(0.01)
        assert owners, "the save never started"
        save_id = owners[0].rsplit(".", 1)[1]
        planted = 0
        for index in range(4):
            try:
                os.symlink(victim, dest / f"__{index}_{save_id}_0.distcp")
                planted += 1
            except FileExistsError:
                pass  # that task had already created its shard
        assert planted, "nothing could be planted"
        marker.touch()
        out = saver.communicate(timeout=120)
    finally:
        if saver.poll() is None:
            saver.kill()
    assert saver.returncode == 1, out
    assert "refused:" in out and "File exists" in out, out
    assert victim.read_bytes() == b"precious"
    assert not any(p.is_symlink() for p in dest.iterdir()) if dest.exists() else True


def _overwrite(dest: Path, times: int) -> None:
    """The writer (in the second process): ``times`` saves over ``dest``, alternating two checkpoints."""
    a = {"w": torch.full((512, 1024), 1.0), "v": torch.arange(100)}
    b = {"w": torch.full((512, 1024), 2.0), "x": torch.ones(3000)}
    for i in range(times):
        parallel_dcp.save(a if i % 2 else b, dest, workers=2, overwrite=True)
    print("done", flush=True)


def _one_of(loaded: dict[str, torch.Tensor]) -> bool:
    if set(loaded) == {"w"}:
        return bool((loaded["w"] == 1.0).all()) or bool((loaded["w"] == 2.0).all())
    if set(loaded) == {"w", "v"}:
        return bool((loaded["w"] == 1.0).all()) and torch.equal(loaded["v"], torch.arange(100))
    if set(loaded) == {"w", "x"}:
        return bool((loaded["w"] == 2.0).all()) and bool((loaded["x"] == 1.0).all())
    return False


def test_reading_while_another_process_overwrites_is_right_or_a_clear_error(tmp_path: Path) -> None:
    dest = tmp_path / "ckpt"
    parallel_dcp.save({"w": torch.full((512, 1024), 2.0), "x": torch.ones(3000)}, dest, workers=1)
    writer = ForkedProcess(_overwrite, dest, 30)
    loads = changed = 0
    try:
        while writer.poll() is None:
            for reader in ("load", "fast_reader"):
                try:
                    if reader == "load":
                        loaded = parallel_dcp.load(dest, workers=2)
                    else:
                        # "w" has the same shape in both checkpoints: stock DCP's planner accepts either
                        loaded = {"w": torch.empty(512, 1024)}
                        dcp.load(loaded, storage_reader=parallel_dcp.FastReader(dest, workers=2))
                except ParallelDCPError:
                    changed += 1
                    continue
                except CheckpointException as exc:  # stock DCP wraps what the reader raised
                    inner = [failure[0] if isinstance(failure, tuple) else failure for failure in exc.failures.values()]
                    assert all(isinstance(e, ParallelDCPError) for e in inner), inner
                    changed += 1
                    continue
                assert _one_of(loaded), {k: v.flatten()[:3] for k, v in loaded.items()}
                loads += 1
    finally:
        out = writer.communicate(timeout=120)
        if writer.poll() is None:
            writer.kill()
    assert writer.returncode == 0, out
    assert loads + changed >= 1, "no read ran while the checkpoint was overwritten"
    assert _one_of(parallel_dcp.load(dest, workers=2))  # once the writer is done, a plain load
