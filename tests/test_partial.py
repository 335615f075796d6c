"""The seed primitives, driven by hand the way a user of the public API would."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from parallel_dcp import commit, extract_metadata, load_metadata, merge_metadata, partial_load, partial_save
from tests.conftest import assert_same


def test_two_parts_merge_and_commit_into_a_stock_checkpoint(tmp_path: Path) -> None:
    part_a = {"a": torch.arange(6.0), "b": torch.ones(2, 3)}
    part_b = {"c": torch.zeros(4, dtype=torch.int64), "note": "hello"}
    meta_a, writes_a = partial_save(part_a, FileSystemWriter(tmp_path), part_idx=0)
    meta_b, writes_b = partial_save(part_b, FileSystemWriter(tmp_path), part_idx=1)
    assert not (tmp_path / ".metadata").exists(), "a partial save must not commit"
    assert sorted(p.name for p in tmp_path.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    merged = merge_metadata([meta_a, meta_b])
    commit(merged, [writes_a, writes_b], FileSystemWriter(tmp_path))
    assert (tmp_path / ".metadata").is_file()

    target = {"a": torch.empty(6), "b": torch.empty(2, 3), "c": torch.empty(4, dtype=torch.int64), "note": None}
    dcp_load(target, checkpoint_id=str(tmp_path), no_dist=True)
    assert_same(target, {**part_a, **part_b})


def test_extract_and_partial_load_read_only_the_chosen_keys(tmp_path: Path) -> None:
    sd = {"x": torch.randn(3), "y": torch.randn(5), "z": 7}
    meta, writes = partial_save(sd, FileSystemWriter(tmp_path), part_idx=3)
    commit(merge_metadata([meta]), [writes], FileSystemWriter(tmp_path))

    full = load_metadata(FileSystemReader(tmp_path))
    assert set(full.state_dict_metadata) == {"x", "y", "z"}
    only = extract_metadata(["y", "z"], full)
    assert set(only.state_dict_metadata) == {"y", "z"}
    assert {index.fqn for index in only.storage_data} == {"y", "z"}
    loaded = partial_load(only, FileSystemReader(tmp_path))
    assert_same(loaded, {"y": sd["y"], "z": 7})


def test_merge_refuses_overlapping_parts(tmp_path: Path) -> None:
    meta_a, _ = partial_save({"same": torch.ones(1)}, FileSystemWriter(tmp_path / "a"), part_idx=0)
    meta_b, _ = partial_save({"same": torch.ones(1)}, FileSystemWriter(tmp_path / "b"), part_idx=1)
    with pytest.raises(ValueError, match="not disjoint"):
        merge_metadata([meta_a, meta_b])
    with pytest.raises(ValueError, match="at least one"):
        merge_metadata([])


def test_extract_metadata_names_missing_keys(tmp_path: Path) -> None:
    meta, writes = partial_save({"x": torch.ones(1)}, FileSystemWriter(tmp_path), part_idx=0)
    commit(merge_metadata([meta]), [writes], FileSystemWriter(tmp_path))
    with pytest.raises(KeyError, match="missing_one"):
        extract_metadata(["x", "missing_one"], load_metadata(FileSystemReader(tmp_path)))


def test_negative_part_index_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="part_idx"):
        partial_save({"x": torch.ones(1)}, FileSystemWriter(tmp_path), part_idx=-1)
