"""load and FastReader on every format convert reads (issue 33): safetensors files and Hugging Face
folders (indexed or not), torch.save files and folders, quantized releases with dequantize=True,
each equal to the stock reader bit for bit; into= fills the caller's memory; hostile input."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

import parallel_dcp
from parallel_dcp import (
    CorruptCheckpointError,
    InvalidStateDictError,
    MemoryLimitExceeded,
    ReadStats,
    UnsafeCheckpointError,
)
from parallel_dcp.formats import range_read
from tests.conftest import assert_same
from tests.quantized_checkpoints import fp8_checkpoint, mxfp4_checkpoint

MiB = 2**20


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every dtype and shape a release holds, large ones cut into pieces (PIECE_BYTES is shrunk)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(301, 67, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(129, 40, generator=g),
        "model.layers.0.norm.weight": torch.randn(67, generator=g).to(torch.float16),
        "model.layers.0.fp8.weight": torch.randn(33, 16, generator=g).to(torch.float8_e4m3fn),
        "model.ids": torch.arange(-50, 50, dtype=torch.int64),
        "model.mask": torch.rand(17, generator=g) > 0.5,
        "model.scalar": torch.tensor(2.5, dtype=torch.float64),
        "model.empty": torch.zeros(0, 5),
        "lm_head.weight": torch.randn(1, 5000, generator=g),
    }


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of 4 KiB: every large tensor is read as row ranges by several threads."""
    monkeypatch.setattr(range_read, "PIECE_BYTES", 4096)


def hf_folder(directory: Path, state: dict[str, torch.Tensor], shards: int, index: bool) -> Path:
    directory.mkdir(parents=True)
    keys = list(state)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: state[k] for k in part}, str(directory / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, name)
    if index:
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text("{}")
    return directory


def stock_folder(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out |= load_file(str(directory / name))
    return out


@pytest.mark.parametrize("io", ["auto", "buffered"])
@pytest.mark.parametrize("index", [True, False])
def test_a_hf_folder_equals_stock_load_file(tmp_path: Path, index: bool, io: str) -> None:
    state = tensors()
    src = hf_folder(tmp_path / "hf", state, 3, index)
    stats = ReadStats()
    got = parallel_dcp.load(src, workers=3, io=io, stats=stats)
    assert_same(got, stock_folder(src))
    assert_same(got, state)
    # every tensor's bytes came straight from the files, none through a copy of the source's
    assert stats.fast == len(state) and stats.fallback == 0


def test_a_single_safetensors_file_equals_stock_load_file(tmp_path: Path) -> None:
    state = tensors(1)
    save_file(state, str(tmp_path / "model.safetensors"))
    assert_same(
        parallel_dcp.load(tmp_path / "model.safetensors", workers=2), load_file(str(tmp_path / "model.safetensors"))
    )


def test_an_indexed_folder_reads_only_the_shards_its_index_names(tmp_path: Path) -> None:
    state = tensors(2)
    src = hf_folder(tmp_path / "hf", state, 2, index=True)
    save_file({"stray": torch.ones(3)}, str(src / "consolidated.safetensors"))  # not in the index
    got = parallel_dcp.load(src, workers=2)
    assert "stray" not in got
    assert_same(got, state)


def test_keys_select_and_unknown_keys_are_named(tmp_path: Path) -> None:
    state = tensors()
    src = hf_folder(tmp_path / "hf", state, 2, index=True)
    wanted = ["lm_head.weight", "model.ids"]
    assert_same(parallel_dcp.load(src, keys=wanted), {k: state[k] for k in wanted})
    with pytest.raises(KeyError, match="nope"):
        parallel_dcp.load(src, keys=["nope"])


def test_dtype_casts_floating_tensors_and_keeps_the_others(tmp_path: Path) -> None:
    state = tensors()
    src = hf_folder(tmp_path / "hf", state, 2, index=False)
    got = parallel_dcp.load(src, dtype="bfloat16", workers=2)
    expected = {k: v.to(torch.bfloat16) if v.dtype.is_floating_point else v for k, v in state.items()}
    assert_same(got, expected)


def torch_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(40, 30, generator=g)
    return {
        "model": {"w": base, "tied": base, "b": torch.randn(30, generator=g).to(torch.bfloat16)},
        "view": torch.arange(120, dtype=torch.int32).view(10, 12)[:, 2:7],  # strided: read by mapping
        "offset": torch.arange(100, dtype=torch.int16)[37:],  # a storage offset inside the record
        "layers": [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)],
        "step": 7,
        "name": "run-1",
    }


def test_a_torch_save_file_equals_torch_load_weights_only(tmp_path: Path) -> None:
    torch.save(torch_state(), tmp_path / "model.pt")
    stats = ReadStats()
    got = parallel_dcp.load(tmp_path / "model.pt", workers=2, stats=stats)
    assert_same(got, torch.load(tmp_path / "model.pt", weights_only=True))
    assert stats.fast == 6 and stats.fallback_keys == {"view"}


def test_a_torch_folder_with_an_index_equals_torch_load(tmp_path: Path) -> None:
    state = tensors(4)
    src = tmp_path / "bin"
    src.mkdir()
    keys = list(state)
    weight_map = {}
    for i, part in enumerate([keys[:4], keys[4:]]):
        name = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({k: state[k] for k in part}, src / name)
        weight_map |= dict.fromkeys(part, name)
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_same(parallel_dcp.load(src, workers=2), state)


def test_a_torch_save_file_that_needs_pickle_is_refused_unless_trusted(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(3), "opaque": ReadStats()}, tmp_path / "model.pt")
    with pytest.raises(UnsafeCheckpointError, match="trust_pickle"):
        parallel_dcp.load(tmp_path / "model.pt")
    with pytest.warns(UserWarning, match="trust_pickle"):
        got = parallel_dcp.load(tmp_path / "model.pt", trust_pickle=True)
    assert_same(got["w"], torch.ones(3))


def test_a_legacy_torch_save_file_is_read(tmp_path: Path) -> None:
    state = {"w": torch.randn(6, 7), "b": torch.arange(4)}
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with pytest.warns(UserWarning, match="legacy"):
        got = parallel_dcp.load(tmp_path / "old.pt")
    assert_same(got, state)


def test_a_fp8_release_with_dequantize_equals_convert(tmp_path: Path) -> None:
    src = fp8_checkpoint(tmp_path / "fp8")
    parallel_dcp.convert(src, tmp_path / "one.safetensors", dequantize=True, workers=1)
    stats = ReadStats()
    got = parallel_dcp.load(src, dequantize=True, workers=2, stats=stats)
    assert_same(got, load_file(str(tmp_path / "one.safetensors")))
    assert stats.fast == 5 and stats.fallback == 4  # the plain tensors by range, the pairs computed
    half = parallel_dcp.load(src, dequantize=True, dtype="float16", keys=["model.layers.0.mlp.down_proj.weight"])
    parallel_dcp.convert(src, tmp_path / "half.safetensors", dequantize=True, dtype="float16", workers=1)
    expected = load_file(str(tmp_path / "half.safetensors"))
    assert_same(half, {"model.layers.0.mlp.down_proj.weight": expected["model.layers.0.mlp.down_proj.weight"]})


def test_a_mxfp4_release_with_dequantize_equals_convert(tmp_path: Path) -> None:
    src = mxfp4_checkpoint(tmp_path / "mxfp4")
    parallel_dcp.convert(src, tmp_path / "one.safetensors", dequantize=True, workers=1)
    assert_same(parallel_dcp.load(src, dequantize=True, workers=2), load_file(str(tmp_path / "one.safetensors")))


def test_into_fills_the_callers_tensors_in_place(tmp_path: Path) -> None:
    state = tensors()
    src = hf_folder(tmp_path / "hf", state, 2, index=True)
    into = {k: torch.empty_like(v) for k, v in state.items()}
    # a transposed (non-contiguous) destination is filled through a staging buffer
    into["model.layers.0.mlp.up_proj.weight"] = torch.empty(40, 129).t()
    pointers = {k: v.data_ptr() for k, v in into.items()}
    stats = ReadStats()
    assert parallel_dcp.load(src, into=into, workers=3, stats=stats) is into
    assert {k: v.data_ptr() for k, v in into.items()} == pointers
    assert_same(into, state)
    assert stats.fast == len(state)


def test_into_with_dtype_casts_into_the_callers_tensors(tmp_path: Path) -> None:
    state = tensors()
    save_file(state, str(tmp_path / "model.safetensors"))
    into = {
        k: torch.empty(v.shape, dtype=torch.float32 if v.dtype.is_floating_point else v.dtype) for k, v in state.items()
    }
    pointers = {k: v.data_ptr() for k, v in into.items()}
    parallel_dcp.load(tmp_path / "model.safetensors", into=into, dtype=torch.float32, workers=2)
    assert {k: v.data_ptr() for k, v in into.items()} == pointers
    assert_same(into, {k: v.float() if v.dtype.is_floating_point else v for k, v in state.items()})


def test_into_of_another_dtype_or_shape_is_refused_before_any_read(tmp_path: Path) -> None:
    state = tensors()
    save_file(state, str(tmp_path / "model.safetensors"))
    into = {"lm_head.weight": torch.full((1, 5000), 7.0, dtype=torch.float16)}
    with pytest.raises(InvalidStateDictError, match=r"lm_head\.weight.*float16.*float32"):
        parallel_dcp.load(tmp_path / "model.safetensors", into=into)
    into = {"lm_head.weight": torch.full((5000, 1), 7.0)}
    with pytest.raises(InvalidStateDictError, match="shape"):
        parallel_dcp.load(tmp_path / "model.safetensors", into=into)
    assert bool((into["lm_head.weight"] == 7.0).all())


def test_a_dcp_checkpoint_with_dtype(tmp_path: Path) -> None:
    state = {"w": torch.randn(20, 30), "i": torch.arange(5), "n": 3}
    parallel_dcp.save(state, tmp_path / "ckpt", workers=1)
    assert_same(
        parallel_dcp.load(tmp_path / "ckpt", dtype="bf16"), {"w": state["w"].bfloat16(), "i": state["i"], "n": 3}
    )
    into = {"w": torch.empty(20, 30, dtype=torch.float16), "i": torch.empty(5, dtype=torch.int64)}
    pointer = into["w"].data_ptr()
    parallel_dcp.load(tmp_path / "ckpt", into=into, dtype=torch.float16)
    assert into["w"].data_ptr() == pointer
    assert_same(into, {"w": state["w"].half(), "i": state["i"]})


def test_the_memory_limit_is_checked_before_any_read(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(4 * MiB)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(MemoryLimitExceeded, match="raise --memory-limit"):
        parallel_dcp.load(tmp_path / "model.safetensors", memory_limit="8MiB")


# --- hostile input: the one open rule, sizes before reads ----------------------------------------


def test_a_shard_that_is_a_symlink_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    state = tensors()
    src = hf_folder(tmp_path / "hf", state, 2, index=True)
    outside = tmp_path / "outside.safetensors"
    (src / "model-00002-of-00002.safetensors").rename(outside)
    (src / "model-00002-of-00002.safetensors").symlink_to(outside)
    with pytest.raises(UnsafeCheckpointError, match="symlink leading out"):
        parallel_dcp.load(src)
    with pytest.raises(UnsafeCheckpointError, match="symlink leading out"):
        parallel_dcp.FastReader(src)


def test_an_index_naming_a_file_outside_the_folder_is_refused(tmp_path: Path) -> None:
    src = hf_folder(tmp_path / "hf", tensors(), 1, index=True)
    save_file({"x": torch.ones(2)}, str(tmp_path / "secret.safetensors"))
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../secret.safetensors"}}))
    with pytest.raises((UnsafeCheckpointError, CorruptCheckpointError)):
        parallel_dcp.load(src)


def test_a_fifo_in_place_of_a_shard_is_refused_without_blocking(tmp_path: Path) -> None:
    src = hf_folder(tmp_path / "hf", tensors(), 2, index=True)
    (src / "model-00001-of-00002.safetensors").unlink()
    os.mkfifo(src / "model-00001-of-00002.safetensors")
    with pytest.raises(UnsafeCheckpointError, match="not a regular file"):
        parallel_dcp.load(src)


def test_a_socket_in_place_of_a_shard_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A socket's open fails (ENXIO) before fstat can name it: the error was a bare "[Errno 6] No
    such device or address" (review s17 F3)."""
    import socket

    src = hf_folder(tmp_path / "hf", tensors(), 2, index=True)
    (src / "model-00001-of-00002.safetensors").unlink()
    monkeypatch.chdir(src)  # (bound by a short name: a socket's path is at most 107 bytes)
    bound = socket.socket(socket.AF_UNIX)
    bound.bind("model-00001-of-00002.safetensors")
    bound.close()
    with pytest.raises(UnsafeCheckpointError, match=r"model-00001-of-00002\.safetensors.* not a regular file"):
        parallel_dcp.load(src)
    with pytest.raises(UnsafeCheckpointError, match="not a regular file"):
        parallel_dcp.convert(src, tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["model.safetensors", "model.pt"])
def test_a_truncated_file_is_a_clear_error(tmp_path: Path, name: str) -> None:
    state = tensors()
    path = tmp_path / name
    if name.endswith(".pt"):
        torch.save(state, path)
    else:
        save_file(state, str(path))
    size = path.stat().st_size
    os.truncate(path, size - 1000)
    with pytest.raises(CorruptCheckpointError, match=name):
        parallel_dcp.load(path)


def test_a_file_truncated_after_opening_is_refused_before_reading(tmp_path: Path) -> None:
    state = tensors()
    save_file(state, str(tmp_path / "model.safetensors"))
    reader = parallel_dcp.FastReader(tmp_path / "model.safetensors", workers=2)
    os.truncate(tmp_path / "model.safetensors", (tmp_path / "model.safetensors").stat().st_size - 100)
    target = {k: torch.empty_like(v) for k, v in state.items()}
    with pytest.raises(BaseException, match="truncated file") as caught:
        dcp.load(target, storage_reader=reader, no_dist=True)
    assert isinstance(caught.value, (CorruptCheckpointError, dcp.api.CheckpointException))


# --- FastReader under stock dcp.load ----------------------------------------------------------------


def test_fast_reader_serves_stock_dcp_load_from_a_hf_folder(tmp_path: Path) -> None:
    state = tensors()
    src = hf_folder(tmp_path / "hf", state, 3, index=False)
    target = {k: torch.empty_like(v) for k, v in state.items()}
    reader = parallel_dcp.FastReader(src, workers=2)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert_same(target, state)
    assert reader.stats.fallback == 0


def test_fast_reader_serves_a_torch_save_file_with_its_nesting(tmp_path: Path) -> None:
    state = torch_state()
    torch.save(state, tmp_path / "model.pt")
    target: dict[str, Any] = {
        "model": {k: torch.empty_like(v) for k, v in state["model"].items()},
        "view": torch.empty(10, 5, dtype=torch.int32),
        "offset": torch.empty(63, dtype=torch.int16),
        "layers": [torch.empty(3, 4), torch.empty(5)],
        "step": 0,
        "name": "",
    }
    dcp.load(target, storage_reader=parallel_dcp.FastReader(tmp_path / "model.pt"), no_dist=True)
    assert_same(target, torch.load(tmp_path / "model.pt", weights_only=True))


class RegionPlanner:
    """What DCP's planner does for a sharded target: each item a region of a stored tensor."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets
        self.committed: list[str] = []

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        region = self.targets[item.dest_index.fqn]
        for dim, (offset, length) in enumerate(zip(item.dest_offsets, item.lengths, strict=True)):
            region = region.narrow(dim, offset, length)
        return region

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(item.dest_index.fqn)


@pytest.mark.parametrize("region", ["rows", "columns"])
def test_fast_reader_reads_regions_of_stored_tensors(tmp_path: Path, region: str) -> None:
    state = tensors()
    save_file(state, str(tmp_path / "model.safetensors"))
    key = "model.embed_tokens.weight"
    reader = parallel_dcp.FastReader(tmp_path / "model.safetensors", workers=2)
    metadata: Metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    offsets, sizes = ([100, 0], [150, 67]) if region == "rows" else ([0, 10], [301, 20])
    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    items = create_read_items_for_chunk_list(key, metadata.state_dict_metadata[key], [chunk])  # type: ignore[arg-type]
    shard = torch.empty(sizes, dtype=torch.bfloat16)
    planner = RegionPlanner({key: shard})
    reader.read_data(LoadPlan(items), planner).wait()  # type: ignore[arg-type]
    expected = state[key][offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]]
    assert_same(shard, expected)
    assert planner.committed == [key] * len(items)
    # a row range is one byte range of the file, read in place; columns come from the rows they
    # span (tests/test_file_read_path.py), never through a whole-tensor Source.read
    assert (reader.stats.fast, reader.stats.fallback) == (1, 0)


def test_a_dcp_copy_of_a_fp8_release_with_dequantize_equals_convert(tmp_path: Path) -> None:
    src = fp8_checkpoint(tmp_path / "fp8")
    parallel_dcp.convert(src, tmp_path / "fp8-dcp", workers=1)  # FP8 and scales as they are
    parallel_dcp.convert(src, tmp_path / "one.safetensors", dequantize=True, workers=1)
    got = parallel_dcp.load(tmp_path / "fp8-dcp", dequantize=True, workers=2)
    assert_same(got, load_file(str(tmp_path / "one.safetensors")))


def test_worker_process_options_are_refused_for_file_formats(tmp_path: Path) -> None:
    save_file({"w": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="read by threads"):
        parallel_dcp.load(tmp_path / "model.safetensors", retries=1)


def test_fast_reader_follows_a_checkpoint_id_of_another_format(tmp_path: Path) -> None:
    state = {"w": torch.randn(6, 5), "b": torch.arange(3)}
    parallel_dcp.save(state, tmp_path / "ckpt", workers=1)
    save_file({k: v + 1 for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    reader = parallel_dcp.FastReader(tmp_path / "ckpt")
    target = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=reader, checkpoint_id=tmp_path / "model.safetensors", no_dist=True)
    assert_same(target, {k: v + 1 for k, v in state.items()})
    dcp.load(target, storage_reader=reader, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert_same(target, state)


def test_keys_take_patterns_as_for_a_dcp_checkpoint(tmp_path: Path) -> None:
    state = tensors()
    src = hf_folder(tmp_path / "hf", state, 2, index=True)
    got = parallel_dcp.load(src, keys=["model.layers.*", "re:lm_head\\..*"])
    expected = [k for k in state if k.startswith("model.layers.")] + ["lm_head.weight"]
    assert_same(got, {k: state[k] for k in expected})
    with pytest.raises(parallel_dcp.KeyNotFoundError, match="nothing"):
        parallel_dcp.load(src, keys=["decoder.*"])
