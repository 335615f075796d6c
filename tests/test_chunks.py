"""One huge tensor split across workers as DCP chunks: stock readers reassemble it bit for bit."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import parallel_dcp
from parallel_dcp.engine.chunks import split
from parallel_dcp.formats.base import Entry
from tests.conftest import assert_same
from tests.memory_probe import PeakSampler
from tests.test_roundtrip import DTYPES

MiB = 2**20


def chunks_of(path: Path) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    metadata = parallel_dcp.load_metadata(dcp.FileSystemReader(str(path)))
    return {
        key: sorted((tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }


def assert_exact_cover(chunks: list[tuple[tuple[int, ...], tuple[int, ...]]], shape: tuple[int, ...]) -> None:
    """The chunks tile the tensor along one dimension: no gap, no overlap."""
    dim = next((d for d in range(len(shape)) if any(off[d] for off, _ in chunks)), 0)
    position = 0
    for offsets, sizes in sorted(chunks, key=lambda c: c[0][dim]):
        assert offsets[dim] == position
        assert all(sizes[d] == shape[d] for d in range(len(shape)) if d != dim)
        position += sizes[dim]
    assert position == shape[dim]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_dominant_tensor_round_trips_through_stock_readers(tmp_path: Path, workers: int) -> None:
    state = {
        "model": {"embed": torch.randn(4099, 96), "proj": torch.randn(64, 64), "scale": torch.tensor(0.5)},
        "step": 7,
    }
    result = parallel_dcp.save(state, tmp_path / "ckpt", workers=workers, chunk_size=200_000)
    chunks = chunks_of(tmp_path / "ckpt")
    assert len(chunks["model.embed"]) >= 4 and len(chunks["model.proj"]) == 1
    assert_exact_cover(chunks["model.embed"], (4099, 96))
    metadata = parallel_dcp.load_metadata(dcp.FileSystemReader(str(tmp_path / "ckpt")))
    files = {info.relative_path for index, info in metadata.storage_data.items() if index.fqn == "model.embed"}
    assert len(files) == min(workers, result.tasks) == workers  # its chunks were written by different tasks

    target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}, "step": 0}
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert_same(target, state)
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "whole.pt")
    assert_same(torch.load(tmp_path / "whole.pt", weights_only=True), state)
    assert_same(parallel_dcp.load(tmp_path / "ckpt"), state)
    assert parallel_dcp.verify(tmp_path / "ckpt").ok


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunk_boundaries_are_exact_for_odd_sizes_and_every_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        tensor = torch.rand(997, 13, generator=g) > 0.5
    elif dtype.is_floating_point or dtype.is_complex:
        tensor = torch.randn(997, 13, generator=g, dtype=torch.float32).to(dtype)
    else:
        tensor = torch.randint(0, 100, (997, 13), generator=g, dtype=dtype)
    parallel_dcp.save({"t": tensor}, tmp_path / "ckpt", workers=2, chunk_size=tensor.nbytes // 7)
    chunks = chunks_of(tmp_path / "ckpt")["t"]
    assert len(chunks) == 8  # ceil(7 + a remainder)
    assert_exact_cover(chunks, (997, 13))
    target = {"t": torch.empty_like(tensor)}
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert_same(target["t"], tensor)


def test_zero_dim_and_one_row_tensors_are_never_split() -> None:
    assert split(Entry("s", torch.float32, ()), threshold=1) == []
    assert split(Entry("row", torch.float32, (1, 100_000)), threshold=1) == []
    assert split(Entry("small", torch.float32, (10, 10)), threshold=400) == []
    pieces = split(Entry("wide", torch.float32, (3, 100_000)), threshold=100_000)
    assert len(pieces) == 12 and pieces[0].dim == 1  # dim 0 too short for 12 chunks: the long dimension
    assert [p.start for p in pieces] == [i * 100_000 // 12 for i in range(12)] and pieces[-1].stop == 100_000
    assert all(a.stop == b.start for a, b in itertools.pairwise(pieces))


def test_a_tensor_larger_than_the_limit_converts_from_safetensors_under_it(tmp_path: Path) -> None:
    st.save_file({"lm_head.weight": torch.randn(3072, 8192), "norm": torch.ones(8)}, tmp_path / "model.safetensors")
    # Nothing large may live in this process while the tree is sampled: a fork or an exit between
    # two processes' readings would move its shared pages from one reading to the next.
    limit = 64 * MiB
    with PeakSampler() as sampler:
        result = parallel_dcp.convert(tmp_path / "model.safetensors", tmp_path / "dcp", workers=2, memory_limit=limit)
    assert isinstance(result, parallel_dcp.SaveResult)
    assert sampler.peak < limit, f"tree added {sampler.peak / MiB:.1f} MiB, limit {limit / MiB:.0f} MiB"
    assert len(chunks_of(tmp_path / "dcp")["lm_head.weight"]) > 1
    source = st.load_file(tmp_path / "model.safetensors")
    target = {key: torch.empty_like(value) for key, value in source.items()}
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert_same(target, source)


def test_dcp_to_dcp_reads_only_each_chunks_rows_under_the_limit(tmp_path: Path) -> None:
    """A 96 MiB key stored as 16 MiB chunks, re-chunked DCP to DCP and cast, under 80 MiB, bit for bit."""
    parallel_dcp.save({"w": torch.randn(3000, 8192)}, tmp_path / "a", workers=2, chunk_size=16 * MiB)
    assert len(chunks_of(tmp_path / "a")["w"]) == 6
    limit = 80 * MiB
    with PeakSampler() as sampler:
        parallel_dcp.convert(tmp_path / "a", tmp_path / "b", workers=2, memory_limit=limit, dtype="bf16")
    assert sampler.peak < limit, f"tree added {sampler.peak / MiB:.1f} MiB, limit {limit / MiB:.0f} MiB"
    assert len(chunks_of(tmp_path / "b")["w"]) > 1
    expected = parallel_dcp.load(tmp_path / "a")["w"].to(torch.bfloat16)
    assert_same(parallel_dcp.load(tmp_path / "b")["w"], expected)
