"""The one rule for opening a source's files (storage/pinned_paths.open_source), review s14 F6 and F10.

F6: a shard that is a link within its folder (``model.safetensors -> store/model.safetensors``) is
listed as where it leads; a folder on that path swapped for a link out of the tree after the listing
(``store -> /elsewhere``) was followed by every reader, and a file outside the tree was read into
the output. The swap is placed deterministically by wrapping the function that resolved the path.

F10: a DCP checkpoint in the Hugging Face hub cache (``snapshots/<rev>/.metadata -> ../../blobs/<sha>``,
a torchtitan checkpoint on the hub) was refused as a planted link; stock ``dcp.load`` reads it. It
is read through the snapshot's links (and only a snapshot's); nothing writes into the cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import parallel_dcp
import parallel_dcp.formats.folder_files as folder_files
import parallel_dcp.jobs.source_check as source_check
import parallel_dcp.jobs.verify as verify_job
import parallel_dcp.storage.safe_files as safe_files
from parallel_dcp.errors import InvalidDestinationError, SourceChecksumError, UnsafeCheckpointError, WorkerError

# --- F6: a folder on a resolved in-tree link's path swapped for a link out of the tree -----------


@pytest.fixture
def linked_shard(tmp_path: Path) -> Iterator[tuple[Path, Callable[[], None]]]:
    """A folder whose shard is a link into its own ``store/``, and ``swap()``: ``store/`` renamed
    away and replaced by a link to a folder outside holding a same-header file of 7s."""
    src = tmp_path / "src"
    (src / "store").mkdir(parents=True)
    save_file({"w": torch.ones(64, 64)}, src / "store" / "model.safetensors")
    (src / "model.safetensors").symlink_to("store/model.safetensors")
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"w": torch.full((64, 64), 7.0)}, outside / "model.safetensors")

    def swap() -> None:
        if not (src / "store").is_symlink():
            (src / "store").rename(src / "store.old")
            (src / "store").symlink_to(outside)

    yield src, swap


def _swap_after(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, swap: Callable[[], None]) -> None:
    resolve = getattr(module, name)

    def resolving_then_swapping(*args: Any, **kwargs: Any) -> Any:
        found = resolve(*args, **kwargs)
        swap()
        return found

    monkeypatch.setattr(module, name, resolving_then_swapping)


_SWAPPED = r"store -> .*outside \(on the way to .*store/model\.safetensors\) is now a symlink"


@pytest.mark.parametrize("workers", [1, 2])
def test_convert_refuses_a_folder_swapped_for_a_link_after_the_listing(
    linked_shard: tuple[Path, Callable[[], None]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    src, swap = linked_shard
    _swap_after(monkeypatch, folder_files, "_in_tree", swap)
    with pytest.raises(UnsafeCheckpointError, match=_SWAPPED):
        parallel_dcp.convert(src, tmp_path / "out", workers=workers, check_source=False)


def test_load_refuses_a_folder_swapped_for_a_link_after_the_listing(
    linked_shard: tuple[Path, Callable[[], None]], monkeypatch: pytest.MonkeyPatch
) -> None:
    src, swap = linked_shard
    _swap_after(monkeypatch, folder_files, "_in_tree", swap)
    with pytest.raises(UnsafeCheckpointError, match=_SWAPPED):
        parallel_dcp.load(src)


def _recorded(src: Path, tmp_path: Path) -> Path:
    """``src`` as a folder parallel_dcp wrote (with its record), its shard moved into ``store/``
    and linked back, as the fixture's plain one is."""
    made = tmp_path / "made"
    parallel_dcp.convert(src, made, to="safetensors", workers=1)
    shutil.rmtree(src)
    (made / "store").mkdir()
    (made / "model.safetensors").rename(made / "store" / "model.safetensors")
    (made / "model.safetensors").symlink_to("store/model.safetensors")
    return made


def _recorded_then_swapped(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: Any) -> Path:
    """A recorded copy of ``src`` whose ``store/`` is swapped for a link to ``outside/`` (a same-bytes
    shard there) right after ``module`` resolved the shard."""
    made = _recorded(src, tmp_path)
    (tmp_path / "outside" / "model.safetensors").write_bytes((made / "store" / "model.safetensors").read_bytes())

    def swap() -> None:
        if not (made / "store").is_symlink():
            (made / "store").rename(made / "store.old")
            (made / "store").symlink_to(tmp_path / "outside")

    _swap_after(monkeypatch, module, "resolve_in_tree", swap)
    return made


def test_verify_refuses_a_folder_swapped_for_a_link_after_it_resolved_the_shard(
    linked_shard: tuple[Path, Callable[[], None]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = _recorded_then_swapped(linked_shard[0], tmp_path, monkeypatch, verify_job)
    report = parallel_dcp.verify(made, workers=1)
    assert any("store -> " in p and "is now a symlink" in p for p in report.problems), report.problems


def test_the_source_check_refuses_a_folder_swapped_for_a_link_after_it_resolved_the_shard(
    linked_shard: tuple[Path, Callable[[], None]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = _recorded_then_swapped(linked_shard[0], tmp_path, monkeypatch, source_check)
    with pytest.raises((UnsafeCheckpointError, WorkerError), match=r"store -> .* is now a symlink"):
        parallel_dcp.convert(made, tmp_path / "out", workers=1, check_source=True)  # (hashed in a worker)


# --- F10: a DCP checkpoint in the Hugging Face hub cache ------------------------------------------


def _hub_snapshot(folder: Path, root: Path) -> Path:
    """``folder``'s files laid out as the hub library caches them: ``models--org--m/snapshots/abc/NAME
    -> ../../blobs/<sha256>``."""
    repo = root / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    for name in sorted(os.listdir(folder)):
        data = (folder / name).read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / name).symlink_to(f"../../blobs/{blob}")
    return snapshot


def _stock(folder: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {k: torch.empty_like(v) for k, v in like.items()}
    dcp.load(state, checkpoint_id=folder)
    return state


_STATE = {"w": torch.randn(64, 64), "b": torch.arange(100, dtype=torch.int64)}


@pytest.mark.parametrize("recorded", [True, False], ids=["our save", "stock save"])
def test_a_dcp_checkpoint_in_the_hub_cache_reads_as_stock_dcp_load_reads_it(tmp_path: Path, recorded: bool) -> None:
    made = tmp_path / "made"
    if recorded:
        parallel_dcp.save(_STATE, made, workers=1)
    else:
        dcp.save(_STATE, checkpoint_id=made)
    snapshot = _hub_snapshot(made, tmp_path / "hub")
    stock = _stock(snapshot, _STATE)
    loaded = parallel_dcp.load(snapshot)
    assert sorted(loaded) == sorted(stock)
    assert all(torch.equal(loaded[k], stock[k]) for k in stock)
    parallel_dcp.convert(snapshot, tmp_path / "out.safetensors", workers=2)
    assert all(torch.equal(v, stock[k]) for k, v in load_file(tmp_path / "out.safetensors").items())
    parallel_dcp.convert(snapshot, tmp_path / "out_dcp", to="dcp", workers=2)
    again = _stock(tmp_path / "out_dcp", _STATE)
    assert all(torch.equal(again[k], stock[k]) for k in stock)
    assert parallel_dcp.verify(snapshot, workers=1).problems == []


def test_a_damaged_blob_of_a_recorded_dcp_checkpoint_in_the_hub_cache_is_refused(tmp_path: Path) -> None:
    made = tmp_path / "made"
    parallel_dcp.save(_STATE, made, workers=1)
    snapshot = _hub_snapshot(made, tmp_path / "hub")
    shard = next(n for n in os.listdir(snapshot) if n.endswith(".distcp"))
    blob = Path(os.path.realpath(snapshot / shard))
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 1
    blob.write_bytes(bytes(data))
    with pytest.raises(SourceChecksumError, match=shard):
        parallel_dcp.convert(snapshot, tmp_path / "out.safetensors", workers=1)
    problems = parallel_dcp.verify(snapshot, workers=1).problems
    assert any(shard in p and "recorded" in p for p in problems), problems


def test_a_planted_link_in_a_plain_dcp_folder_is_still_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    parallel_dcp.save(_STATE, folder, workers=1)
    shard = next(n for n in os.listdir(folder) if n.endswith(".distcp"))
    (folder / shard).rename(tmp_path / shard)
    (folder / shard).symlink_to(tmp_path / shard)
    with pytest.raises(UnsafeCheckpointError, match=f"{shard} is a symlink"):
        parallel_dcp.load(folder)


def test_a_hub_snapshot_whose_blobs_folder_is_swapped_for_a_link_out_is_refused(tmp_path: Path) -> None:
    made = tmp_path / "made"
    parallel_dcp.save(_STATE, made, workers=1)
    snapshot = _hub_snapshot(made, tmp_path / "hub")
    blobs = tmp_path / "hub" / "models--org--m" / "blobs"
    blobs.rename(tmp_path / "elsewhere")
    blobs.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeCheckpointError, match=r"out of .*models--org--m"):
        parallel_dcp.load(snapshot)


@pytest.mark.parametrize("overwrite", [True, False])
def test_nothing_is_written_into_a_hub_cache_snapshot(tmp_path: Path, overwrite: bool) -> None:
    made = tmp_path / "made"
    parallel_dcp.save(_STATE, made, workers=1)
    snapshot = _hub_snapshot(made, tmp_path / "hub")
    before = {n: os.readlink(snapshot / n) for n in os.listdir(snapshot)}
    with pytest.raises(InvalidDestinationError, match="Hugging Face cache"):
        parallel_dcp.save({"w": torch.zeros(4)}, snapshot, overwrite=overwrite, workers=1)
    with pytest.raises(InvalidDestinationError, match="Hugging Face cache"):
        parallel_dcp.convert(made, snapshot / "sub", overwrite=overwrite, workers=1)
    with pytest.raises(InvalidDestinationError, match="Hugging Face cache"):
        parallel_dcp.convert(made, snapshot / "model.safetensors", overwrite=overwrite, workers=1)
    assert {n: os.readlink(snapshot / n) for n in os.listdir(snapshot)} == before


def test_a_hub_blobs_folder_swapped_for_a_link_after_the_snapshot_link_was_resolved_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = tmp_path / "made"
    parallel_dcp.save(_STATE, made, workers=1)
    snapshot = _hub_snapshot(made, tmp_path / "hub")
    blobs = tmp_path / "hub" / "models--org--m" / "blobs"
    shutil.copytree(blobs, tmp_path / "elsewhere")  # (the same bytes: only where they lie differs)

    def swap() -> None:
        if not blobs.is_symlink():
            blobs.rename(tmp_path / "blobs.old")
            blobs.symlink_to(tmp_path / "elsewhere")

    _swap_after(monkeypatch, safe_files, "hub_blob", swap)
    with pytest.raises(UnsafeCheckpointError, match=r"out of its Hugging Face cache repository .*models--org--m"):
        parallel_dcp.load(snapshot)
