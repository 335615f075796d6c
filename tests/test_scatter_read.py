"""Whole small records read straight into their tensors (formats/scatter_read.py): one preadv per
run of records, the data into the tensors and each head and tail into a frame row checked in bulk
against its template; bit for bit equal to stock dcp.load for checkpoints written by stock
dcp.save and by parallel_dcp; a record unlike its template is parsed from its own bytes (its
tensor ends up with its data, or the load fails naming it); a short or shrunk shard is refused
naming the file; what the path does not take goes the general way."""

from __future__ import annotations

import ctypes
import io
import itertools
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import parallel_dcp
from parallel_dcp import CorruptCheckpointError
from parallel_dcp.formats import read_units, scatter_read, small_reads
from parallel_dcp.formats.record_batch import TemplateCache
from tests.conftest import assert_same, empty_like_state
from tests.test_small_records import COUNT, SHAPES, _damage, _records, optimizer_like, stock_load, write


@pytest.fixture
def scattered(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The vectored reads of the scatter path (calls, iovecs) and the window reads of the records
    it left (each a read of the small-record window path)."""
    seen = {"calls": 0, "iovecs": 0, "windows": 0}
    real_preadv, real_window = scatter_read._preadv, small_reads.SmallUnit._window

    def preadv(file: Any, iov: Any, offset: int) -> None:
        seen["calls"] += 1
        seen["iovecs"] += len(iov)
        real_preadv(file, iov, offset)

    def window(self: Any, *args: Any) -> None:
        seen["windows"] += 1
        real_window(self, *args)

    monkeypatch.setattr(scatter_read, "_preadv", preadv)
    monkeypatch.setattr(small_reads.SmallUnit, "_window", window)
    return seen


@pytest.mark.parametrize("kind", ["stock", "pdcp"])
def test_records_land_straight_in_their_tensors_equal_to_stock(
    tmp_path: Path, kind: str, scattered: dict[str, int]
) -> None:
    """Every record read by the scatter path (a handful of vectored reads, no window), the bytes
    those of stock dcp.load, for checkpoints written by stock dcp.save and by parallel_dcp."""
    sd = optimizer_like()
    write(kind, sd, tmp_path / "ckpt")
    expected = stock_load(sd, tmp_path / "ckpt")
    into = empty_like_state(sd)
    stats = parallel_dcp.ReadStats()
    parallel_dcp.load(tmp_path / "ckpt", into=into, workers=2, stats=stats)
    assert_same(into, expected)
    assert stats.fast == 2 * COUNT and stats.fallback == 0
    assert scattered["windows"] == 0
    # three iovecs a record (head, data, tail), up to 1024 a call: a few calls per unit
    assert scattered["iovecs"] == 3 * 2 * COUNT
    assert 0 < scattered["calls"] <= 16


@pytest.mark.parametrize(
    ("iov_max", "chunk_records", "frame_bytes"),
    [(5, 4096, 4 << 20), (1024, 7, 4 << 20), (1024, 4096, 6000), (4, 3, 3000), (1024, 4096, 1000)],
)
def test_many_chunks_and_calls_still_land_every_record(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    scattered: dict[str, int],
    iov_max: int,
    chunk_records: int,
    frame_bytes: int,
) -> None:
    """Calls cut at IOV_MAX iovecs, chunks cut by record count and by frame bytes (a chunk's
    frame rows reuse the last chunk's scratch), a frame larger than the scratch (left to the
    windows): the same bytes."""
    monkeypatch.setattr(scatter_read, "IOV_MAX", iov_max)
    monkeypatch.setattr(scatter_read, "CHUNK_RECORDS", chunk_records)
    monkeypatch.setattr(scatter_read, "FRAME_BYTES", frame_bytes)
    sd = optimizer_like()
    write("stock", sd, tmp_path / "ckpt")
    into = empty_like_state(sd)
    parallel_dcp.load(tmp_path / "ckpt", into=into, workers=1)
    assert_same(into, stock_load(sd, tmp_path / "ckpt"))
    if frame_bytes < 1500:  # smaller than every record's frame: none is scattered
        assert scattered["calls"] == 0 and scattered["windows"] > 0
        return
    assert scattered["windows"] == 0
    assert scattered["calls"] >= 3 * 2 * COUNT // max(iov_max, 3 * chunk_records)


def test_a_short_read_goes_on_where_it_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scattered: dict[str, int]
) -> None:
    """preadv may return fewer bytes than asked (a signal, a file system's own limit): the read
    goes on from the byte where it stopped, inside a buffer or between two."""
    real = scatter_read.preadv_function()
    assert real is not None
    short = [0]

    def at_most_a_few_bytes(fd: int, iov: int, count: int, offset: int) -> int:
        first = (ctypes.c_int64 * 2).from_address(iov)
        one = (ctypes.c_int64 * 2)(first[0], max(1, min(first[1], 1000) // 3))
        short[0] += 1
        return int(real(fd, ctypes.addressof(one), 1, offset))

    monkeypatch.setattr(small_reads, "preadv_function", lambda: at_most_a_few_bytes)
    monkeypatch.setattr(scatter_read, "preadv_function", lambda: at_most_a_few_bytes)
    sd = optimizer_like()
    write("pdcp", sd, tmp_path / "ckpt")
    into = empty_like_state(sd)
    parallel_dcp.load(tmp_path / "ckpt", into=into, workers=2)
    assert_same(into, stock_load(sd, tmp_path / "ckpt"))
    assert short[0] > 3 * 2 * COUNT and scattered["windows"] == 0


def test_a_shard_that_shrinks_after_its_size_was_checked_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shard is cut short between the check of its size and its read: the read that comes up
    short names the file and the key whose record it was reading."""
    sd = optimizer_like()
    write("pdcp", sd, tmp_path / "ckpt")
    real = small_reads.read_scattered

    def shrink_first(file: Any, *args: Any) -> Any:
        os.truncate(file.where, file.size // 2)
        return real(file, *args)

    monkeypatch.setattr(small_reads, "read_scattered", shrink_first)
    with pytest.raises(
        CorruptCheckpointError, match=r"\.distcp ends at byte \d+, inside the record of 'optimizer\.state\."
    ):
        parallel_dcp.load(tmp_path / "ckpt", into=empty_like_state(sd), workers=1)


def test_a_truncated_shard_is_refused_before_anything_is_read(tmp_path: Path, scattered: dict[str, int]) -> None:
    """A shard shorter than .metadata says: refused naming the file before any vectored read."""
    sd = optimizer_like()
    write("pdcp", sd, tmp_path / "ckpt")
    shard = max((tmp_path / "ckpt").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match=rf"{shard.name}.*truncated"):
        parallel_dcp.load(tmp_path / "ckpt", into=empty_like_state(sd), workers=1)
    assert scattered["calls"] == 0


@pytest.mark.parametrize("kind", ["stock", "pdcp"])
def test_a_damaged_record_unlike_its_template_is_refused_naming_its_key(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The size in one record's pickle changed: its frame is unlike its template's, so the scatter
    leaves it to be parsed from its own bytes, and that refuses it, by key."""
    sd = optimizer_like()
    write(kind, sd, tmp_path / "ckpt")
    victim = "optimizer.state.238.exp_avg"  # (33,) float32, late in its shard: not its shape's first

    def other_shape(record: bytearray) -> None:
        record[record.find(b"K!") + 1] = 34

    _damage(tmp_path / "ckpt", victim, other_shape)
    left: list[str] = []
    real = small_reads.read_scattered

    def spy(*args: Any) -> Any:
        out = real(*args)
        left.extend(entry[2] for entry in out)
        return out

    monkeypatch.setattr(small_reads, "read_scattered", spy)
    with pytest.raises(CorruptCheckpointError, match=r"optimizer\.state\.238\.exp_avg"):
        parallel_dcp.load(tmp_path / "ckpt", into=empty_like_state(sd), workers=1)
    assert left == [victim]


def _record(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def test_a_valid_record_unlike_its_template_ends_with_its_own_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three records of one (length, dtype, shape): the first two views at storage offset 0, the
    third at offset 1 of its 17 elements. The template comes from the first; the scatter reads the
    third's bytes at the template's data offset into its tensor (the wrong elements), its frame
    differs (the pickle's storage offset), and its own parse puts its right elements there."""
    storages = [torch.arange(17, dtype=torch.float32) + 100 * k for k in range(3)]
    tensors = [storages[0][:16], storages[1][:16], storages[2][1:]]
    records = [_record(t) for t in tensors]
    assert len({len(r) for r in records}) == 1
    (tmp_path / "shard.distcp").write_bytes(b"".join(records))
    targets = [torch.full((16,), -1.0) for _ in tensors]
    entries = [
        (i * len(records[0]), len(records[0]), f"key{i}", t, None, torch.float32, (16,), t.data_ptr())
        for i, t in enumerate(targets)
    ]
    after_scatter: list[torch.Tensor] = []
    real = small_reads.read_scattered

    def spy(*args: Any) -> Any:
        left = real(*args)
        after_scatter.append(targets[2].clone())
        assert [entry[2] for entry in left] == ["key2"]
        return left

    monkeypatch.setattr(small_reads, "read_scattered", spy)
    unit = small_reads.SmallUnit("shard.distcp", entries, TemplateCache())
    stats, fallback = unit.run(tmp_path, threading.Event())
    assert not fallback and stats.fast == 3
    assert torch.equal(after_scatter[0], storages[2][:16])  # the scatter's bytes: the wrong elements
    for target, tensor in zip(targets, tensors, strict=True):
        assert torch.equal(target, tensor)


def test_records_apart_are_read_across_small_gaps_and_split_at_large_ones(
    tmp_path: Path, scattered: dict[str, int]
) -> None:
    """Keys not asked for lie between the records: small gaps are read into a junk buffer within
    one call, a gap past GAP_BYTES starts a new call; every asked record lands, nothing else."""
    g = torch.Generator().manual_seed(5)
    state: dict[str, Any] = {}
    for i in range(60):
        state[f"{i}"] = {
            "exp_avg": torch.randn(SHAPES[i % len(SHAPES)], generator=g),
            "big": torch.randn(read_units.GAP_BYTES // 4 + 100 if i % 10 == 0 else 8, generator=g),
        }
    sd = {"optimizer": {"state": state}}
    write("pdcp", sd, tmp_path / "ckpt")
    expected = stock_load(sd, tmp_path / "ckpt")
    into = {"optimizer": {"state": {k: {"exp_avg": torch.zeros_like(v["exp_avg"])} for k, v in state.items()}}}
    parallel_dcp.load(tmp_path / "ckpt", into=into, workers=1)
    for k, v in into["optimizer"]["state"].items():
        assert torch.equal(v["exp_avg"], expected["optimizer"]["state"][k]["exp_avg"]), k
    assert scattered["windows"] == 0
    asked = {f"optimizer.state.{k}.exp_avg" for k in state}
    by_file: dict[str, list[tuple[int, int]]] = {}
    for key, info in _records(tmp_path / "ckpt"):
        if key in asked:
            by_file.setdefault(info.relative_path, []).append((info.offset, info.length))
    gaps = [b[0] - (a[0] + a[1]) for spans in by_file.values() for a, b in itertools.pairwise(spans)]
    small, large = sum(0 < g <= read_units.GAP_BYTES for g in gaps), sum(g > read_units.GAP_BYTES for g in gaps)
    assert small and large
    assert scattered["iovecs"] == 3 * 60 + small  # each small gap one iovec into the junk buffer
    assert scattered["calls"] >= len(by_file) + large


def test_targets_that_are_not_dense_tensors_of_the_stored_layout_go_the_general_way(
    tmp_path: Path, scattered: dict[str, int]
) -> None:
    """A transposed view is not scattered into (its record goes the general way); the rest are;
    all equal to stock dcp.load into the same targets."""
    sd = optimizer_like()
    write("stock", sd, tmp_path / "ckpt")
    state = sd["optimizer"]["state"]
    transposed = "1"  # (4, 8)
    assert tuple(state[transposed]["exp_avg"].shape) == (4, 8)

    def targets() -> Any:
        into = empty_like_state(sd)
        into["optimizer"]["state"][transposed]["exp_avg"] = torch.empty(8, 4, dtype=state["1"]["exp_avg"].dtype).T
        return into

    expected = targets()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    dcp.load(expected, storage_reader=FileSystemReader(str(tmp_path / "ckpt")), no_dist=True)
    into = targets()
    stats = parallel_dcp.ReadStats()
    parallel_dcp.load(tmp_path / "ckpt", into=into, workers=1, stats=stats)
    assert_same(into, expected)
    assert not into["optimizer"]["state"][transposed]["exp_avg"].is_contiguous()
    # every record but the transposed one's, whose bytes (between two others) may be a gap's iovec
    assert scattered["iovecs"] in (3 * (2 * COUNT - 1), 3 * (2 * COUNT - 1) + 1)


def test_without_preadv_every_record_goes_through_the_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scattered: dict[str, int]
) -> None:
    """Where libc has no preadv this module can call (or on object storage), the records are read
    in windows as before, with the same bytes."""
    monkeypatch.setattr(small_reads, "preadv_function", lambda: None)
    sd = optimizer_like()
    write("stock", sd, tmp_path / "ckpt")
    into = empty_like_state(sd)
    parallel_dcp.load(tmp_path / "ckpt", into=into, workers=1)
    assert_same(into, stock_load(sd, tmp_path / "ckpt"))
    assert scattered["calls"] == 0 and scattered["windows"] > 0


def test_direct_reads_scatter_through_a_buffered_descriptor(disk: Path, scattered: dict[str, int]) -> None:
    """io="direct": O_DIRECT cannot read into a tensor's unaligned memory, so the small records'
    shards are opened buffered for the scatter; the same bytes."""
    sd = optimizer_like()
    write("pdcp", sd, disk / "ckpt")
    into = empty_like_state(sd)
    parallel_dcp.load(disk / "ckpt", into=into, workers=2, io="direct")
    assert_same(into, stock_load(sd, disk / "ckpt"))
    assert scattered["iovecs"] == 3 * 2 * COUNT and scattered["windows"] == 0


def test_the_scatter_holds_no_more_than_a_reading_thread_has_reserved() -> None:
    """What one thread holds on the scatter path is inside what the load reserves per thread."""
    assert read_units.thread_memory() >= scatter_read.SCATTER_MEMORY
