"""The lean per-key path builds what DCP's planner builds (parallel_dcp.lean)."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import parallel_dcp
from parallel_dcp import _compat
from parallel_dcp.engine.chunks import split
from parallel_dcp.formats import lean
from parallel_dcp.formats.base import entry_of
from parallel_dcp.formats.dcp_format import ChunkSavePlanner
from parallel_dcp.partial import merge_metadata, partial_save
from parallel_dcp.storage.writers import ShardWriter
from tests.test_roundtrip import DTYPES, nested_state, odd_shapes, random_tensor


def states() -> dict[str, dict[str, Any]]:
    matrix = {f"{dtype}-{i}": random_tensor((7, 5 + i), dtype, seed=i) for i, dtype in enumerate(DTYPES)}
    matrix["scalar"] = random_tensor((), torch.int64, seed=3)
    flat, _ = _compat.flatten_state_dict(nested_state())
    return {"matrix": matrix, "odd": odd_shapes(), "nested": flat}


def index_of(writes: list[list[Any]]) -> list[tuple[Any, ...]]:
    return [
        (w.index.fqn, w.index.offset, w.index.index, w.size_in_bytes, pickle.dumps(w.storage_data))
        for part in writes
        for w in part
    ]


@pytest.mark.parametrize("name", list(states()))
def test_build_equals_the_planner(name: str, tmp_path: Path) -> None:
    sd = states()[name]
    keys = list(sd)
    parts = [keys[0::2], keys[1::2]]  # two tasks, as two workers would write them
    stock_dir, lean_dir = tmp_path / "stock", tmp_path / "lean"
    stock_dir.mkdir()
    lean_dir.mkdir()
    stock, lean_parts = [], []
    for i, part in enumerate(parts):
        data = {key: sd[key] for key in part}
        stock.append(partial_save(data, ShardWriter(stock_dir, sync_files=False), ChunkSavePlanner([]), part_idx=i))
        lean_parts.append(lean.write_part(ShardWriter(lean_dir, sync_files=False), data, [], i, ""))
    merged = merge_metadata([m for m, _ in stock])
    built, writes = lean.build(lean_parts)
    assert built.state_dict_metadata == merged.state_dict_metadata
    assert index_of(writes) == index_of([w for _, w in stock])
    for i in range(len(parts)):  # the same records at the same offsets
        assert (lean_dir / f"__{i}_0.distcp").read_bytes() == (stock_dir / f"__{i}_0.distcp").read_bytes()


def test_build_joins_chunks_as_the_planner(tmp_path: Path) -> None:
    big = torch.randn(40, 6)
    pieces = split(entry_of("big", big), big.nbytes // 4)
    assert len(pieces) == 4
    stock, lean_parts = [], []
    for i, (a, b) in enumerate([(pieces[0], pieces[2]), (pieces[1], pieces[3])]):
        chunks = [(a, a.of(big)), (b, b.of(big))]
        whole = {f"small{i}": torch.ones(i + 1)}
        stock.append(partial_save(whole, ShardWriter(tmp_path, sync_files=False), ChunkSavePlanner(chunks), part_idx=i))
        lean_parts.append(lean.write_part(ShardWriter(tmp_path, sync_files=False), whole, chunks, i, "tag"))
    merged = merge_metadata([m for m, _ in stock])
    built, writes = lean.build(lean_parts)
    assert built.state_dict_metadata == merged.state_dict_metadata
    assert [(w.index.fqn, w.index.offset) for p in writes for w in p] == [
        (w.index.fqn, w.index.offset) for _, p in stock for w in p
    ]
    # Each index hint points at its chunk in the merged list (a part's own hints would not).
    for w in (w for p in writes for w in p):
        assert built.state_dict_metadata[w.index.fqn].chunks[w.index.index].offsets == w.index.offset
    assert {w.storage_data.relative_path for p in writes for w in p} == {"__0_tag_0.distcp", "__1_tag_0.distcp"}


def test_build_refuses_a_key_in_two_parts() -> None:
    part = lean.LeanPart("__0_0.distcp", tensors=[("w", torch.float32, False, False, (2,), None, (2,), 0, 10)])
    with pytest.raises(ValueError, match="not disjoint"):
        lean.build([part, part])


def test_saved_metadata_equals_stock_dcp_save(tmp_path: Path) -> None:
    sd = nested_state() | {"odd": odd_shapes()}
    result = parallel_dcp.save(sd, tmp_path / "ours", workers=2, executor="processes")
    assert set(result.phases) == {"plan", "fork", "write", "merge", "commit"}
    assert all(seconds >= 0 for seconds in result.phases.values()) and result.phases["write"] > 0
    assert sum(result.phases.values()) <= result.seconds + 0.01
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group
        dcp.save(sd, storage_writer=FileSystemWriter(str(tmp_path / "stock"), thread_count=1), no_dist=True)
    ours = FileSystemReader(str(tmp_path / "ours")).read_metadata()
    stock = FileSystemReader(str(tmp_path / "stock")).read_metadata()
    assert ours.state_dict_metadata == stock.state_dict_metadata
    assert list(ours.state_dict_metadata) == list(stock.state_dict_metadata)  # stock's order too
    assert ours.planner_data == stock.planner_data
    assert set(ours.storage_data) == set(stock.storage_data)


def test_a_tensor_subclass_goes_through_the_planner(tmp_path: Path) -> None:
    class Tagged(torch.Tensor):
        pass

    assert not lean.lean_eligible([torch.ones(2).as_subclass(Tagged)])
    assert lean.lean_eligible([torch.ones(2), torch.nn.Parameter(torch.ones(2)), 3, "x"])


def test_a_part_and_its_digests_pickle_whole() -> None:
    """LeanPart and FileDigest pickle as tuples of their fields (cheaper to unpickle in the
    coordinator than through copyreg): every field, none left at its default, comes back."""
    import dataclasses
    import pickle

    from parallel_dcp.formats.lean import LeanPart
    from parallel_dcp.storage.manifest import FileDigest

    part = LeanPart(
        "__1_0.distcp",
        [("v", 0, 8)],
        [("t", 1, 2)],
        {"__1_0.distcp": FileDigest(16, "00ff"), "other": FileDigest(1, None)},
        ["zstd"],
        [(3, (b"a", b"b", b"c"))],
        [(b"t\0", b"\1", b"\2", b"\0", b"\1", b"\2" * 8, b"\0" * 8, b"\4" * 8)],
    )
    defaults = LeanPart("x")
    assert all(getattr(part, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(LeanPart))
    assert pickle.loads(pickle.dumps(part, protocol=5)) == part
