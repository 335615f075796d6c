"""The zero-copy read path: load (allocating and into=) and FastReader under stock dcp.load, bit for
bit, with the fast path (not DCP's reader) proven to serve them; the fallback; hostile input."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

import parallel_dcp
from parallel_dcp import CorruptCheckpointError, InvalidStateDictError, ReadStats, UnsafeCheckpointError
from parallel_dcp.formats.fast_read import thread_memory
from parallel_dcp.partial import extract_metadata, load_metadata, partial_load
from tests.conftest import assert_same, empty_like_state
from tests.memory_probe import PeakSampler
from tests.test_roundtrip import DTYPES, random_tensor

MiB = 2**20
SHAPES = [(), (0,), (7,), (33, 17), (2, 3, 5), (1, 300, 1)]


class Opaque:
    """A value whose pickle names a class: weights_only=True refuses it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.n == self.n


def matrix_state() -> dict[str, Any]:
    sd: dict[str, Any] = {"model": {}, "step": 12, "lr": [0.5, 1e-3]}
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate(SHAPES):
            sd["model"][f"{str(dtype).removeprefix('torch.')}.{j}"] = random_tensor(shape, dtype, seed=i * 10 + j)
    # Larger than a small record: read with preadv straight into the target, reads merged.
    sd["big"] = {f"w{i}": random_tensor((700, 400), torch.float32, seed=100 + i) for i in range(3)}
    sd["big"]["h"] = random_tensor((600, 1000), torch.bfloat16, seed=200)
    return sd


def tensor_count(sd: Any) -> int:
    """Tensors with elements (stock DCP's planner makes no read item for an empty one)."""
    if isinstance(sd, torch.Tensor):
        return int(sd.numel() > 0)
    if isinstance(sd, dict):
        return sum(tensor_count(v) for v in sd.values())
    return 0


def write(sd: dict[str, Any], path: Path, writer: str) -> None:
    if writer == "stock":
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    else:
        parallel_dcp.save(sd, path, workers=2, chunk_size="1MiB")  # splits the big ones into chunks


@pytest.fixture(scope="module", params=["stock", "parallel_dcp"])
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    sd = matrix_state()
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    write(sd, path, request.param)
    return path, sd


@pytest.mark.parametrize("workers", [1, 2])
def test_load_reads_the_matrix_bit_for_bit_through_the_fast_path(
    written: tuple[Path, dict[str, Any]], workers: int
) -> None:
    path, sd = written
    stats = ReadStats()
    assert_same(parallel_dcp.load(path, workers=workers, stats=stats), sd)
    assert stats.fallback == 0 and not stats.fallback_keys
    assert stats.fast >= tensor_count(sd) and stats.values == 2  # step and lr
    assert stats.reads < stats.fast  # small records are read many per call


def test_load_into_fills_the_callers_tensors_in_place(written: tuple[Path, dict[str, Any]]) -> None:
    path, sd = written
    into = empty_like_state(sd)
    ids = {k: id(v) for k, v in into["model"].items()}
    stats = ReadStats()
    result = parallel_dcp.load(path, into=into, workers=2, stats=stats)
    assert result is into
    assert {k: id(v) for k, v in into["model"].items()} == ids
    assert_same(into, sd)
    assert stats.fallback == 0 and stats.fast >= tensor_count(sd)


def test_stock_load_with_fast_reader(written: tuple[Path, dict[str, Any]]) -> None:
    path, sd = written
    target = empty_like_state(sd)
    reader = parallel_dcp.FastReader(path, workers=2)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert_same(target, sd)
    assert reader.stats.fallback == 0 and reader.stats.fast >= tensor_count(sd)


def test_keys_select_a_subset(written: tuple[Path, dict[str, Any]]) -> None:
    path, sd = written
    stats = ReadStats()
    part = parallel_dcp.load(path, keys=["big.h", "step"], stats=stats)
    assert_same(part, {"big": {"h": sd["big"]["h"]}, "step": 12})
    assert stats.fallback == 0


class _ColumnsPlanner(DefaultLoadPlanner):
    """Reads columns ``start:stop`` of a 2-D key: a region no stored chunk holds contiguously."""

    def __init__(self, key: str, start: int, stop: int, target: torch.Tensor) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        self.key, self.start, self.stop, self.target = key, start, stop, target

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        stored = self.metadata.state_dict_metadata[self.key]
        assert isinstance(stored, TensorStorageMetadata)
        rows = stored.size[0]
        wanted = ChunkStorageMetadata(torch.Size([0, self.start]), torch.Size([rows, self.stop - self.start]))
        return LoadPlan(create_read_items_for_chunk_list(self.key, stored, [wanted]))

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.target


def test_a_region_across_stored_chunks_is_read_by_the_fast_path(tmp_path: Path) -> None:
    w = random_tensor((512, 96), torch.float32)
    parallel_dcp.save({"w": w}, tmp_path / "ckpt", workers=2, chunk_size="64KiB")  # row chunks
    reader = parallel_dcp.FastReader(tmp_path / "ckpt", workers=2)
    metadata = load_metadata(reader)
    stored = metadata.state_dict_metadata["w"]
    assert isinstance(stored, TensorStorageMetadata) and len(stored.chunks) > 1
    target = torch.zeros(512, 40)
    partial_load(extract_metadata(["w"], metadata), reader, _ColumnsPlanner("w", 30, 70, target), state_dict={})
    assert_same(target, w[:, 30:70].contiguous())
    assert reader.stats.fallback == 0 and reader.stats.fast == len(stored.chunks)


def test_compressed_records_are_decompressed_on_the_reading_threads(tmp_path: Path) -> None:
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard

    sd = {"a": random_tensor((40, 30), torch.float32), "b": random_tensor((9,), torch.bfloat16), "n": 3}
    writer = dcp.FileSystemWriter(str(tmp_path / "z"), _extensions=[ZStandard()])
    dcp.save(sd, storage_writer=writer, no_dist=True)
    stats = ReadStats()
    assert_same(parallel_dcp.load(tmp_path / "z", stats=stats), sd)
    # bounded decompression straight into the targets (issue 17), not DCP's whole-record BytesIO
    assert stats.compressed == 2 and stats.fallback == 0 and stats.fast == 0
    target = empty_like_state(sd)
    reader = parallel_dcp.FastReader(tmp_path / "z")
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert_same(target, sd)
    assert reader.stats.compressed == 2 and reader.stats.fallback == 0


def test_a_non_contiguous_stored_layout_goes_through_dcps_reader(tmp_path: Path) -> None:
    base = random_tensor((24, 40), torch.float32)
    sd = {"t": base.t(), "plain": base}  # stock stores the transpose with its strides
    dcp.save(sd, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    stats = ReadStats()
    assert_same(parallel_dcp.load(tmp_path / "ckpt", stats=stats), sd)
    assert stats.fallback_keys == {"t"} and stats.fallback == 1 and stats.fast == 1


def test_into_mismatches_name_the_key_and_both_sides(tmp_path: Path) -> None:
    parallel_dcp.save({"m": {"w": torch.ones(4, 3)}}, tmp_path / "ckpt", workers=1)
    with pytest.raises(InvalidStateDictError, match=r"into\['m\.w'\] has dtype float16 .* holds float32"):
        parallel_dcp.load(tmp_path / "ckpt", into={"m": {"w": torch.empty(4, 3, dtype=torch.float16)}})
    with pytest.raises(InvalidStateDictError, match=r"into\['m\.w'\] has shape \[3, 4\] .* holds \[4, 3\]"):
        parallel_dcp.load(tmp_path / "ckpt", into={"m": {"w": torch.empty(3, 4)}})
    with pytest.raises(KeyError, match=r"m\.x"):
        parallel_dcp.load(tmp_path / "ckpt", into={"m": {"x": torch.empty(4, 3)}})
    untouched = torch.full((4, 3), 7.0)
    with pytest.raises(InvalidStateDictError):
        parallel_dcp.load(tmp_path / "ckpt", into={"m": {"w": untouched.to(torch.float64)}})
    assert torch.equal(untouched, torch.full((4, 3), 7.0))


def _rewrite_metadata(path: Path, change: Any) -> None:
    meta_file = path / ".metadata"
    metadata = pickle.loads(meta_file.read_bytes())  # our own test checkpoint: trusted
    change(metadata)
    meta_file.write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("name", ["../outside.distcp", "/etc/passwd", "sub/x.distcp", ".."])
def test_shard_names_outside_the_checkpoint_are_refused(tmp_path: Path, name: str) -> None:
    parallel_dcp.save({"w": torch.ones(4)}, tmp_path / "ckpt", workers=1)

    def point_away(metadata: Any) -> None:
        for info in metadata.storage_data.values():
            info.relative_path = name

    _rewrite_metadata(tmp_path / "ckpt", point_away)
    with pytest.raises(CorruptCheckpointError, match="not a plain file name"):
        parallel_dcp.load(tmp_path / "ckpt")
    with pytest.raises(CheckpointException, match="not a plain file name"):  # stock wraps every error
        dcp.load({"w": torch.empty(4)}, storage_reader=parallel_dcp.FastReader(tmp_path / "ckpt"), no_dist=True)


def test_a_damaged_record_is_a_clear_error(tmp_path: Path) -> None:
    parallel_dcp.save({"w": torch.ones(64)}, tmp_path / "ckpt", workers=1)
    metadata = pickle.loads((tmp_path / "ckpt" / ".metadata").read_bytes())
    info = next(iter(metadata.storage_data.values()))
    shard = tmp_path / "ckpt" / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length - 22 : info.offset + info.length - 18] = b"XXXX"  # the zip end record
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"record of 'w' at byte \d+ is damaged"):
        parallel_dcp.load(tmp_path / "ckpt")


def test_a_record_that_contradicts_the_metadata_is_refused(tmp_path: Path) -> None:
    parallel_dcp.save({"w": torch.ones(8, 8)}, tmp_path / "ckpt", workers=1)

    def claim_other_shape(metadata: Any) -> None:
        meta = metadata.state_dict_metadata["w"]
        meta.size = torch.Size([4, 16])
        meta.chunks[0].sizes = torch.Size([4, 16])

    _rewrite_metadata(tmp_path / "ckpt", claim_other_shape)
    with pytest.raises(CorruptCheckpointError, match=r"holds float32 \[8, 8\] but \.metadata says .*\[4, 16\]"):
        parallel_dcp.load(tmp_path / "ckpt")


def test_pickled_values_need_weights_only_unless_trusted(tmp_path: Path) -> None:
    sd = {"w": torch.ones(2), "extra": Opaque(5)}
    dcp.save(sd, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    with pytest.raises(UnsafeCheckpointError, match="'extra'"):
        parallel_dcp.load(tmp_path / "ckpt")
    with pytest.raises(CheckpointException, match="the value of 'extra' needs code to run"):
        dcp.load(
            {"w": torch.empty(2), "extra": None},
            storage_reader=parallel_dcp.FastReader(tmp_path / "ckpt"),
            no_dist=True,
        )
    assert_same(parallel_dcp.load(tmp_path / "ckpt", trust_pickle=True), sd)


def test_load_stays_under_the_memory_limit(tmp_path: Path) -> None:
    sd = {f"w{i}": random_tensor((1024, 1024), torch.float32, seed=i) for i in range(16)}  # 64 MiB
    parallel_dcp.save(sd, tmp_path / "ckpt", workers=2)
    nbytes = 64 * MiB
    with PeakSampler() as sampler:
        loaded = parallel_dcp.load(tmp_path / "ckpt", workers=2, memory_limit=nbytes + 24 * MiB)
    assert sampler.peak < nbytes + 24 * MiB, f"added {sampler.peak / MiB:.1f} MiB"
    assert sampler.peak < nbytes + 2 * thread_memory() + 8 * MiB  # the output, buffers and slack
    assert_same(loaded, sd)
    into = {k: torch.zeros_like(v) for k, v in sd.items()}  # touched: its pages exist before the load
    del loaded
    with PeakSampler() as sampler:
        parallel_dcp.load(tmp_path / "ckpt", workers=2, into=into, memory_limit="24MiB")
    assert sampler.peak < 24 * MiB, f"added {sampler.peak / MiB:.1f} MiB"
    assert_same(into, sd)


def test_large_regions_are_read_in_pieces_by_several_threads(
    written: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from parallel_dcp.formats import fast_read

    # Buffered: a fresh tensor read direct stays whole, its own pages read in place with several
    # reads in flight (test_seated_read.py); the caller's tensors (FastReader below) are cut.
    path, sd = written
    whole = ReadStats()
    parallel_dcp.load(path, workers=2, stats=whole, io="buffered")
    monkeypatch.setattr(fast_read, "PIECE_BYTES", 64 * 1024)  # the 1.1 MiB tensors become ~9 pieces each
    stats = ReadStats()
    assert_same(parallel_dcp.load(path, workers=2, stats=stats, io="buffered"), sd)
    assert stats.fallback == 0 and stats.fast == whole.fast  # pieces count once per read item
    assert stats.reads > whole.reads  # the pieces were read apart
    reader = parallel_dcp.FastReader(path, workers=2)
    target = empty_like_state(sd)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert_same(target, sd)


def test_fast_reader_keeps_stock_semantics_for_another_dtype_and_checkpoint_id(tmp_path: Path) -> None:
    w = random_tensor((30, 4), torch.float32)
    dcp.save({"w": w}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    wider = {"w": torch.empty(30, 4, dtype=torch.float64)}
    reader = parallel_dcp.FastReader(tmp_path / "ckpt")
    dcp.load(wider, storage_reader=reader, no_dist=True)  # stock casts; its reader does that copy
    assert_same(wider["w"], w.double())
    assert reader.stats.fallback == 1 and reader.stats.fast == 0
    same = {"w": torch.empty(30, 4)}
    reader = parallel_dcp.FastReader(tmp_path / "elsewhere")
    dcp.load(same, checkpoint_id=str(tmp_path / "ckpt"), storage_reader=reader, no_dist=True)  # reset() moves it
    assert_same(same["w"], w)
    assert reader.stats.fast == 1


def test_load_into_with_a_progress_bar_counts_the_tensors_bytes(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    sd = {f"w{i}": torch.full((128 * 1024,), float(i)) for i in range(4)} | {"step": 7, "names": ["a", "b"]}
    parallel_dcp.save(sd, tmp_path / "ckpt", workers=2)
    capfd.readouterr()
    into = {k: torch.zeros_like(v) if torch.is_tensor(v) else None for k, v in sd.items()}
    parallel_dcp.load(tmp_path / "ckpt", into=into, workers=2, progress=True)
    err = capfd.readouterr().err
    assert "load: " in err and "2.0 MiB / 2.0 MiB" in err  # the four tensors' bytes, not the values
    assert all(torch.equal(into[k], sd[k]) for k in sd if torch.is_tensor(sd[k]))
    assert (into["step"], into["names"]) == (7, ["a", "b"])
