"""Compressed (zstd) checkpoints: stock's format both ways, round trips, and hostile records.

Written records must be what stock's ``ZStandard`` extension writes (stock ``dcp.load`` and
``dcp_to_torch_save`` read them); stock-written ones must load and convert bit for bit; a
truncated record, a damaged frame and a decompression bomb are each a ``CorruptCheckpointError``
naming the key, with the process tree's memory (sampled independently) far below the bomb's size.
"""

from __future__ import annotations

import io
import json
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zstandard
from safetensors.torch import load_file
from torch.distributed.checkpoint._extension import ZStandard

import parallel_dcp
from parallel_dcp import cli
from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.storage.compression import CompressionUnavailableError, parse_compress
from parallel_dcp.storage.metadata import read_metadata
from tests.conftest import assert_same
from tests.memory_probe import PeakSampler
from tests.test_roundtrip import DTYPES, nested_state, odd_shapes, random_tensor, stock_load, stock_torch_save

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _records(path: Path) -> list[Any]:
    return list((read_metadata(path).storage_data or {}).values())


def _assert_compressed(path: Path) -> None:
    infos = _records(path)
    assert infos and all(list(i.transform_descriptors) == ["stream.zstd/1"] for i in infos)
    for info in infos:  # every record is one zstd frame starting at its offset
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            assert f.read(4) == ZSTD_MAGIC


@pytest.mark.parametrize("executor", ["processes", "threads"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_compressed(dtype: torch.dtype, executor: str, tmp_path: Path) -> None:
    # small records (lean templates) and records past the 4 KiB head (streamed into the target)
    sd = {f"t{i}": random_tensor((7, 5 + i), dtype, seed=i) for i in range(4)}
    sd["large"] = random_tensor((64, 300), dtype, seed=7)
    sd["scalar"] = random_tensor((), dtype, seed=99)
    ckpt = tmp_path / "ckpt"
    parallel_dcp.save(sd, ckpt, workers=2, executor=executor, compress="zstd")
    _assert_compressed(ckpt)
    assert_same(stock_load(sd, ckpt), sd)
    assert_same(stock_torch_save(ckpt, tmp_path), sd)
    stats = parallel_dcp.ReadStats()
    assert_same(parallel_dcp.load(ckpt, workers=2, stats=stats), sd)
    assert stats.compressed == len(sd) and stats.fallback == 0
    assert_same(parallel_dcp.load(ckpt, workers=2, retries=1), sd)  # the process path: BoundedReader
    report = parallel_dcp.verify(ckpt, workers=2)
    assert report.ok and report.keys_checked == len(sd), report.problems


def test_large_records_stream_into_their_targets(tmp_path: Path) -> None:
    sd = {"f32": torch.randn(1100, 1024), "bf16": torch.randn(2200, 1024).to(torch.bfloat16), "v": 1}
    ckpt = tmp_path / "ckpt"
    parallel_dcp.save(sd, ckpt, workers=2, compress="zstd:1")
    assert_same(stock_load(sd, ckpt), sd)
    assert_same(parallel_dcp.load(ckpt, workers=2), sd)
    into = {"f32": torch.empty(1100, 1024), "bf16": torch.empty(2200, 1024, dtype=torch.bfloat16), "v": 0}
    assert parallel_dcp.load(ckpt, into=into) is into
    assert_same(into, sd)
    assert_same(parallel_dcp.load(ckpt, retries=1), sd)
    # stock-written large records (no content size in the frame) stream as well
    stock = tmp_path / "stock"
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(stock), _extensions=[ZStandard()]), no_dist=True)
    assert_same(parallel_dcp.load(stock, workers=2), sd)


@pytest.mark.parametrize("level", ["zstd:1", "zstd:9"])
def test_shapes_views_and_nesting_round_trip_compressed(level: str, tmp_path: Path) -> None:
    sd: dict[str, Any] = {"shapes": odd_shapes(), "nested": nested_state()}
    ckpt = tmp_path / "ckpt"
    parallel_dcp.save(sd, ckpt, workers=2, compress=level)
    _assert_compressed(ckpt)
    assert_same(stock_torch_save(ckpt, tmp_path), sd)
    assert_same(parallel_dcp.load(ckpt, workers=2), sd)
    assert parallel_dcp.verify(ckpt).ok


def test_chunked_keys_and_convert_into_compressed_dcp(tmp_path: Path) -> None:
    sd = {"w": torch.randn(256, 512), "b": torch.arange(1000, dtype=torch.int32), "step": 7}
    plain = tmp_path / "plain"
    parallel_dcp.save(sd, plain, workers=2)
    packed = tmp_path / "packed"
    parallel_dcp.convert(plain, packed, workers=2, chunk_size="64KiB", compress="zstd:3")
    _assert_compressed(packed)
    meta = read_metadata(packed).state_dict_metadata["w"]
    assert len(meta.chunks) > 1  # split into chunks, each its own compressed record
    assert_same(stock_load(sd, packed), sd)
    assert_same(parallel_dcp.load(packed, workers=2), sd)
    # chunked compressed source read in row ranges (staged region copies) into safetensors
    parallel_dcp.convert(packed, tmp_path / "out.safetensors", keys=["w", "b"], workers=2, memory_limit="200MiB")
    out = load_file(tmp_path / "out.safetensors")
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"])
    report = parallel_dcp.verify(packed, against=plain)
    assert report.ok, report.problems


def test_stock_written_compressed_checkpoint_converts_bit_for_bit(tmp_path: Path) -> None:
    sd = {
        "emb": torch.randn(300, 64).to(torch.bfloat16),
        "w": random_tensor((128, 96), torch.float16),
        "ids": torch.arange(5000, dtype=torch.int64),
        "flag": torch.tensor(True),
        "meta": {"epoch": 3, "name": "run"},
    }
    stock = tmp_path / "stock"
    writer = dcp.FileSystemWriter(str(stock), thread_count=2, _extensions=[ZStandard()])
    dcp.save(sd, storage_writer=writer, no_dist=True)
    _assert_compressed(stock)
    parallel_dcp.convert(stock, tmp_path / "model.safetensors", keys=["emb", "w", "ids", "flag"], workers=2)
    out = load_file(tmp_path / "model.safetensors")
    for key in ("emb", "w", "ids", "flag"):
        assert out[key].dtype == sd[key].dtype and torch.equal(out[key].view(torch.uint8), sd[key].view(torch.uint8))
    assert_same(parallel_dcp.load(stock, workers=2), sd)
    assert parallel_dcp.verify(stock, workers=2).ok


def test_fast_reader_serves_compressed_records_to_stock_load(tmp_path: Path) -> None:
    sd = {"a": torch.randn(100, 100), "b": torch.arange(10, dtype=torch.int16), "v": [1, 2]}
    parallel_dcp.save(sd, tmp_path / "c", compress="zstd")
    target = {"a": torch.empty(100, 100), "b": torch.empty(10, dtype=torch.int16), "v": None}
    reader = parallel_dcp.FastReader(tmp_path / "c", workers=2)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert_same(target, sd)
    assert reader.stats.compressed == 2 and reader.stats.fallback == 0


def test_inspect_reports_stored_and_logical_bytes(tmp_path: Path) -> None:
    sd = {"zeros": torch.zeros(1024, 1024), "noise": torch.randn(256, 256)}
    parallel_dcp.save(sd, tmp_path / "z", compress="zstd")
    parallel_dcp.save(sd, tmp_path / "p")
    packed, plain = parallel_dcp.inspect(tmp_path / "z"), parallel_dcp.inspect(tmp_path / "p")
    logical = sum(t.nbytes for t in sd.values())
    assert packed["total_bytes"] == plain["total_bytes"] == logical
    assert packed["compressed_records"] == packed["records"] == 2 and plain["compressed_records"] == 0
    assert packed["stored_bytes"] < 0.3 * logical < plain["stored_bytes"]
    assert packed["ratio"] == pytest.approx(packed["stored_bytes"] / logical, abs=1e-3)


def test_manifest_checksums_the_stored_bytes(tmp_path: Path) -> None:
    sd = {"w": torch.randn(200, 200)}
    ckpt = tmp_path / "c"
    parallel_dcp.save(sd, ckpt, compress="zstd")
    manifest = json.loads((ckpt / ".parallel_dcp.json").read_text())
    shard = next(ckpt.glob("*.distcp"))
    recorded = json.dumps(manifest)
    assert str(shard.stat().st_size) in recorded  # the stored (compressed) size, not the logical one
    shallow_ok = parallel_dcp.verify(ckpt, deep=False)
    assert shallow_ok.ok and shallow_ok.manifest and shallow_ok.keys_checked == 0  # nothing decompressed
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    shallow = parallel_dcp.verify(ckpt, deep=False)  # found without decompressing anything
    assert not shallow.ok and any(shard.name in p for p in shallow.problems)


# A record read whole (small) and one streamed into its target (past SMALL_DECOMPRESSED, 4 MiB).
VICTIMS = {"small": (64, 128), "streamed": (1100, 1024)}


@pytest.fixture(params=list(VICTIMS))
def victim(request: Any) -> tuple[int, int]:
    return VICTIMS[request.param]


def _save_one(tmp_path: Path, shape: tuple[int, int] = VICTIMS["small"]) -> tuple[Path, Any, Path]:
    sd = {"victim": torch.randn(*shape), "other": torch.ones(3)}
    ckpt = tmp_path / "c"
    parallel_dcp.save(sd, ckpt, workers=1, compress="zstd")
    metadata = read_metadata(ckpt)
    (index, info) = next((i, v) for i, v in (metadata.storage_data or {}).items() if i.fqn == "victim")
    return ckpt, (metadata, index, info), ckpt / info.relative_path


def _rewrite_metadata(ckpt: Path, metadata: Any) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def _all_readers_refuse(ckpt: Path, key: str, tmp_path: Path) -> None:
    for read in (
        lambda: parallel_dcp.load(ckpt, workers=2),
        lambda: parallel_dcp.load(ckpt, workers=2, retries=1),
        lambda: parallel_dcp.convert(ckpt, tmp_path / "out.safetensors", overwrite=True, workers=2),
    ):
        with pytest.raises(Exception) as caught:
            read()
        text = f"{caught.value} {caught.value.__cause__}"
        assert isinstance(caught.value, CorruptCheckpointError) or "CorruptCheckpointError" in text, text
        assert key in text, text
    report = parallel_dcp.verify(ckpt, workers=2)
    assert not report.ok and any(key in p and "compressed record" in p for p in report.problems), report.problems


def test_truncated_compressed_record_is_corrupt_naming_the_key(tmp_path: Path, victim: tuple[int, int]) -> None:
    ckpt, (metadata, index, info), _ = _save_one(tmp_path, victim)
    metadata.storage_data[index] = type(info)(
        info.relative_path, info.offset, info.length // 2, transform_descriptors=info.transform_descriptors
    )
    _rewrite_metadata(ckpt, metadata)
    _all_readers_refuse(ckpt, "victim", tmp_path)


def test_damaged_frame_is_corrupt_naming_the_key(tmp_path: Path, victim: tuple[int, int]) -> None:
    ckpt, (_, _, info), shard = _save_one(tmp_path, victim)
    data = bytearray(shard.read_bytes())
    data[info.offset : info.offset + 4] = b"\x00\x01\x02\x03"  # not a zstd frame
    mid = info.offset + info.length // 2
    data[mid : mid + 64] = bytes(64)
    shard.write_bytes(bytes(data))
    _all_readers_refuse(ckpt, "victim", tmp_path)


def _bomb_frame(record: bytes, extra: int) -> bytes:
    """A valid record followed by ``extra`` zero bytes, in one zstd frame (a few KiB stored)."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=1).stream_writer(out, closefd=False) as writer:
        writer.write(record)
        zeros = bytes(1 << 20)
        for _ in range(extra >> 20):
            writer.write(zeros)
    return out.getvalue()


def _plant(shard: Path, info: Any, frame: bytes, metadata: Any, index: Any, ckpt: Path) -> None:
    with open(shard, "ab") as f:
        offset = f.tell()
        f.write(frame)
    metadata.storage_data[index] = type(info)(
        info.relative_path, offset, len(frame), transform_descriptors=info.transform_descriptors
    )
    _rewrite_metadata(ckpt, metadata)
    manifest = ckpt / ".parallel_dcp.json"
    manifest.unlink()  # the shard grew: no stale manifest in the way of the readers


@pytest.mark.timeout(240)
def test_decompression_bomb_is_corrupt_under_the_memory_limit(tmp_path: Path, victim: tuple[int, int]) -> None:
    ckpt, (metadata, index, info), shard = _save_one(tmp_path, victim)
    record = io.BytesIO()
    torch.save(torch.zeros(*victim), record)  # the record .metadata announces, then the bomb
    bomb = 1 << 30  # 1 GiB of zeros behind a valid record; stores as ~40 KiB
    frame = _bomb_frame(record.getvalue(), bomb)
    assert len(frame) < 1 << 20
    _plant(shard, info, frame, metadata, index, ckpt)
    with PeakSampler() as sampler:
        _all_readers_refuse(ckpt, "victim", tmp_path)
    assert sampler.peak < 256 << 20, f"the tree grew by {sampler.peak >> 20} MiB reading a bomb"


@pytest.mark.timeout(240)
def test_value_bomb_is_corrupt(tmp_path: Path) -> None:
    sd = {"w": torch.ones(4), "note": {"a": 1}}
    ckpt = tmp_path / "c"
    parallel_dcp.save(sd, ckpt, compress="zstd")
    metadata = read_metadata(ckpt)
    index, info = next((i, v) for i, v in (metadata.storage_data or {}).items() if i.fqn == "note.a")
    value = io.BytesIO()
    torch.save(1, value)
    _plant(ckpt / info.relative_path, info, _bomb_frame(value.getvalue(), 256 << 20), metadata, index, ckpt)
    with PeakSampler() as sampler, pytest.raises(CorruptCheckpointError, match=r"note\.a"):
        parallel_dcp.load(ckpt)
    assert sampler.peak < 192 << 20


def test_bad_compress_values_fail_before_anything_is_written(tmp_path: Path, monkeypatch: Any) -> None:
    sd = {"w": torch.ones(3)}
    for bad in ("gzip", "zstd:0", "zstd:23", "zstd:x", 3):
        with pytest.raises(ValueError):
            parallel_dcp.save(sd, tmp_path / "a", compress=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "a").exists()
    parallel_dcp.save(sd, tmp_path / "src")
    with pytest.raises(ValueError, match="DCP outputs only"):
        parallel_dcp.convert(tmp_path / "src", tmp_path / "x.safetensors", compress="zstd")
    assert not (tmp_path / "x.safetensors").exists()
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(CompressionUnavailableError, match="zstandard"):
        parse_compress("zstd")
    with pytest.raises(CompressionUnavailableError, match=r"pip install '\.\[zstd\]'"):
        parallel_dcp.save(sd, tmp_path / "b", compress="zstd:3")
    assert not (tmp_path / "b").exists()


def test_compressor_memory_is_counted_by_the_plan(tmp_path: Path) -> None:
    sd = {f"k{i}": torch.randn(64, 64) for i in range(8)}
    plain = parallel_dcp.save(sd, tmp_path / "a", workers=2, dry_run=True)
    high = parallel_dcp.save(sd, tmp_path / "a", workers=2, dry_run=True, compress="zstd:19")
    low = parallel_dcp.save(sd, tmp_path / "a", workers=2, dry_run=True, compress="zstd:1")
    assert plain.predicted_peak_memory < low.predicted_peak_memory < high.predicted_peak_memory


def test_cli_convert_compress_and_verify_no_deep(tmp_path: Path, capsys: Any) -> None:
    sd = {"w": torch.zeros(512, 512), "b": torch.arange(10)}
    parallel_dcp.save(sd, tmp_path / "src")
    assert cli.main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--compress", "zstd:5", "-q"]) == 0
    _assert_compressed(tmp_path / "dst")
    assert cli.main(["verify", str(tmp_path / "dst"), "--no-deep", "-q"]) == 0
    assert cli.main(["verify", str(tmp_path / "dst"), "--deep", "--against", str(tmp_path / "src"), "-q"]) == 0
    capsys.readouterr()
    assert cli.main(["inspect", str(tmp_path / "dst")]) == 0
    assert "stored/logical" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["convert", str(tmp_path / "src"), str(tmp_path / "e"), "--compress", "lz4"])
