"""How ``load`` and ``FastReader`` read file formats (safetensors, torch.save): the measured read
choice (mmap-free: direct or buffered, as the probe finds on this file system), whole tensors read
where they live (formats/span_read), and regions that are not whole rows read from the rows they
span under the memory limit.

The device is faked as in tests/test_read_choice.py: the probe's reads are real, its clock
advances by the bytes each read moved over the rate the test gives that mode.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

import parallel_dcp
from parallel_dcp.errors import MemoryLimitExceeded
from parallel_dcp.formats import bounced_read, range_read, span_read
from parallel_dcp.storage import io_mode, read_choice, read_probe
from parallel_dcp.storage.direct_read import ShardFile
from tests.conftest import assert_same
from tests.test_load_any_format import RegionPlanner
from tests.test_read_choice import fake

MiB = 1 << 20
ALIGN = io_mode.ALIGN


@pytest.fixture(autouse=True)
def fresh_choices() -> Iterator[None]:
    read_choice.forget_read_choices()
    yield
    read_choice.forget_read_choices()


@pytest.fixture
def small_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probe slices and the direct-read threshold scaled down: files of a few MiB are measured
    and read like files of gigabytes."""
    monkeypatch.setattr(read_probe, "PROBE_SLICE", 256 << 10)
    monkeypatch.setattr(read_probe, "MIN_SLICE", 64 << 10)
    monkeypatch.setattr(read_probe, "readahead_bytes", lambda device: 64 << 10)
    monkeypatch.setattr(io_mode, "DIRECT_MIN_BYTES", 1 * MiB)


@pytest.fixture
def small_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spans and requests scaled down: a tensor of 64 KiB owns its span, requests of 64 KiB."""
    monkeypatch.setattr(span_read, "OWN_BYTES", 64 << 10)
    monkeypatch.setattr(span_read, "SHARED_BYTES", 128 << 10)
    monkeypatch.setattr(span_read, "REQUEST_BYTES", 64 << 10)


@pytest.fixture
def in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """No huge pages for the bounce buffers: whole tensors are read straight into place
    (formats/span_read; where huge pages are given they are bounced: tests/test_bounced_read.py)."""
    monkeypatch.setattr(bounced_read, "huge_pages", lambda: False)


def release(seed: int = 0) -> dict[str, torch.Tensor]:
    """Large tensors between small ones of odd sizes: most tensors start off a page boundary."""
    g = torch.Generator().manual_seed(seed)
    return {
        "a.embed": torch.randn(1024, 513, generator=g).to(torch.bfloat16),
        "a.odd": torch.randint(-100, 100, (4097,), dtype=torch.int8, generator=g),
        "a.norm": torch.randn(77, generator=g).to(torch.float16),
        "b.proj": torch.randn(700, 300, generator=g),
        "b.ids": torch.arange(-3, 1000, dtype=torch.int64),
        "b.scalar": torch.tensor(1.25, dtype=torch.float64),
        "c.head": torch.randn(3, 200_001, generator=g).to(torch.bfloat16),
        "c.empty": torch.zeros(0, 7),
    }


def folder(directory: Path, state: dict[str, torch.Tensor]) -> Path:
    """Two shards of a few MiB each (no index)."""
    directory.mkdir()
    keys = list(state)
    save_file({k: state[k] for k in keys[:4]}, str(directory / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in keys[4:]}, str(directory / "model-00002-of-00002.safetensors"))
    return directory


def stock(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        out |= load_file(str(shard))
    return out


def opened_modes(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each file the reading threads open (spans and pieces) is read with O_DIRECT."""
    opened: list[bool] = []

    class Spy(ShardFile):
        def __init__(self, path: str | os.PathLike[str], *, io: str = "buffered") -> None:
            super().__init__(path, io=io)
            opened.append(self.direct)

    monkeypatch.setattr(span_read, "ShardFile", Spy)
    monkeypatch.setattr(bounced_read, "ShardFile", Spy)
    monkeypatch.setattr(range_read, "ShardFile", Spy)
    return opened


@pytest.mark.parametrize(
    ("direct", "buffered", "expect_direct"), [(3e9, 1e9, True), (1e9, 3e9, False)], ids=["direct-wins", "buffered-wins"]
)
def test_a_hf_folder_is_read_as_measured(
    disk: Path,
    monkeypatch: pytest.MonkeyPatch,
    small_probe: None,
    small_spans: None,
    direct: float,
    buffered: float,
    expect_direct: bool,
) -> None:
    src = folder(disk / "hf", release())
    device = fake(monkeypatch, direct, buffered)
    opened = opened_modes(monkeypatch)
    before = read_choice.read_probe_count()

    stats = parallel_dcp.ReadStats()
    assert_same(parallel_dcp.load(src, workers=2, stats=stats), stock(src))
    choice = stats.read_choice
    assert choice is not None and choice.reason == "measured" and choice.measured
    assert choice.reads == ("direct" if expect_direct else "buffered")
    assert (choice.direct_bytes_per_s, choice.buffered_bytes_per_s) == (pytest.approx(direct), pytest.approx(buffered))
    assert {mode for *_, mode in device.reads} == {True, False}  # the probe really read both ways
    assert opened and set(opened) == {expect_direct}

    # into= (the caller's memory: read through pieces) and FastReader follow the same measurement
    opened.clear()
    into = {k: torch.zeros_like(v) for k, v in stock(src).items()}
    assert_same(parallel_dcp.load(src, workers=2, into=into), stock(src))
    assert opened and set(opened) == {expect_direct}
    opened.clear()
    reader = parallel_dcp.FastReader(src, workers=2)
    targets = {k: torch.zeros_like(v) for k, v in stock(src).items()}
    dcp.load(targets, storage_reader=reader, no_dist=True)
    assert_same(targets, stock(src))
    assert reader.read_choice is not None and reader.read_choice.reads == choice.reads
    assert reader.stats.read_choice == reader.read_choice
    assert opened and set(opened) == {expect_direct}
    assert read_choice.read_probe_count() == before + 1  # measured once for the file system


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_io_asked_for_is_used_without_measuring(
    disk: Path, monkeypatch: pytest.MonkeyPatch, small_probe: None, io: str
) -> None:
    src = folder(disk / "hf", release())
    opened = opened_modes(monkeypatch)
    before = read_choice.read_probe_count()
    stats = parallel_dcp.ReadStats()
    assert_same(parallel_dcp.load(src, workers=2, io=io, stats=stats), stock(src))
    assert stats.read_choice is not None and stats.read_choice.reads == io and not stats.read_choice.measured
    assert set(opened) == {io == "direct"}
    assert read_choice.read_probe_count() == before


def test_the_measurement_is_budgeted_under_the_memory_limit(
    disk: Path, monkeypatch: pytest.MonkeyPatch, small_probe: None
) -> None:
    src = folder(disk / "hf", release())
    fake(monkeypatch, 1e9, 3e9)
    monkeypatch.setattr(read_probe, "PROBE_SLICE", 16 << 20)  # the buffer it sets aside: more than the output
    need = read_probe.probe_memory(2)
    before = read_choice.read_probe_count()
    stats = parallel_dcp.ReadStats()
    # room for the output but not for the probe's buffers: auto keeps its rule, measures nothing
    assert_same(parallel_dcp.load(src, workers=2, stats=stats, memory_limit=need // 2), stock(src))
    assert stats.read_choice is not None and not stats.read_choice.measured
    assert "memory limit" in stats.read_choice.reason
    assert read_choice.read_probe_count() == before
    # with room for them it measures
    stats = parallel_dcp.ReadStats()
    assert_same(parallel_dcp.load(src, workers=2, stats=stats, memory_limit=4 * need), stock(src))
    assert stats.read_choice is not None and stats.read_choice.measured and stats.read_choice.reads == "buffered"


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_whole_tensors_are_read_where_they_live(
    disk: Path, monkeypatch: pytest.MonkeyPatch, small_probe: None, small_spans: None, in_place: None, io: str
) -> None:
    src = folder(disk / "hf", release())
    reads: list[tuple[int, list[tuple[int, int]]]] = []
    real = ShardFile.read_into

    def spy(self: ShardFile, views: list[memoryview], offset: int) -> int:
        import numpy

        reads.append((offset, [(numpy.frombuffer(v, dtype=numpy.uint8).ctypes.data, v.nbytes) for v in views]))
        return real(self, views, offset)

    monkeypatch.setattr(ShardFile, "read_into", spy)
    loaded = parallel_dcp.load(src, workers=2, io=io)
    assert_same(loaded, stock(src))
    # every read lands in its destinations with the alignment O_DIRECT needs (no bounce buffer)
    assert reads and [r for r in reads if r[0] % ALIGN or any(a % ALIGN or n % ALIGN for a, n in r[1])] == []
    assert max(sum(n for _, n in views) for _, views in reads) <= span_read.REQUEST_BYTES
    # a large tensor owns its memory (freed with it), at most a page either side more than it holds
    for key in ("a.embed", "b.proj", "c.head"):
        storage = loaded[key].untyped_storage()
        assert storage.nbytes() <= loaded[key].nbytes + 3 * ALIGN
    storages = {loaded[k].untyped_storage().data_ptr() for k in ("a.embed", "b.proj", "c.head")}
    assert len(storages) == 3
    # a small tensor holds its own bytes, not its neighbours' (torch.save of it alone writes it alone)
    for key in ("a.odd", "a.norm", "b.ids", "b.scalar"):
        assert loaded[key].untyped_storage().nbytes() == loaded[key].nbytes, key


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_each_file_is_read_as_it_lies_in_full_requests_each_byte_once(
    disk: Path, monkeypatch: pytest.MonkeyPatch, small_spans: None, in_place: None, io: str
) -> None:
    """Requests run on across span boundaries (small tensors between large ones cost no read of
    their own), and a page two spans share is read once and copied, not read twice."""
    src = folder(disk / "hf", release())
    reads: dict[str, list[tuple[int, int]]] = {}
    real = ShardFile.read_into

    def spy(self: ShardFile, views: list[memoryview], offset: int) -> int:
        reads.setdefault(self.path.name, []).append((offset, sum(v.nbytes for v in views)))
        return real(self, views, offset)

    monkeypatch.setattr(ShardFile, "read_into", spy)
    assert_same(parallel_dcp.load(src, workers=2, io=io), stock(src))
    assert len(reads) == 2
    for name, requests in reads.items():
        requests.sort()
        first, end = requests[0][0], requests[-1][0] + requests[-1][1]
        # one run from the first tensor's page to the last tensor's page, each byte read once
        assert [o for o, _ in requests] == list(range(first, end, span_read.REQUEST_BYTES)), name
        assert all(n == span_read.REQUEST_BYTES for _, n in requests[:-1]), name
        header = (src / name).stat().st_size - sum(t.nbytes for t in load_file(str(src / name)).values())
        assert first == header // ALIGN * ALIGN and end == -(-(src / name).stat().st_size // ALIGN) * ALIGN, name


def test_a_file_truncated_after_its_header_is_refused_before_any_span_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_spans: None
) -> None:
    src = folder(tmp_path / "hf", release())
    shard = src / "model-00002-of-00002.safetensors"
    source_size = shard.stat().st_size
    reads: list[int] = []
    monkeypatch.setattr(ShardFile, "read_into", lambda self, views, offset: reads.append(offset) or 0)
    real_plan = span_read.plan_spans

    def truncate_then_plan(tensors: list[tuple[str, str, int, torch.dtype, tuple[int, ...]]]) -> list[span_read.Span]:
        os.truncate(shard, source_size - 10)  # after the header was read and checked
        return real_plan(tensors)

    monkeypatch.setattr(span_read, "plan_spans", truncate_then_plan)
    monkeypatch.setattr("parallel_dcp.jobs.load_files.plan_spans", truncate_then_plan)
    with pytest.raises(parallel_dcp.CorruptCheckpointError, match=r"model-00002-of-00002.safetensors has .*truncated"):
        parallel_dcp.load(src, workers=2, io="buffered")
    assert reads == []


# ---- FastReader: a region that is not whole rows (issue 33, item 3 of the hfread task) ----


def region_items(reader: parallel_dcp.FastReader, key: str, offsets: list[int], sizes: list[int]) -> LoadPlan:
    metadata: Metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    return LoadPlan(create_read_items_for_chunk_list(key, metadata.state_dict_metadata[key], [chunk]))  # type: ignore[arg-type]


def test_a_region_of_columns_reads_only_the_rows_it_spans_in_bounded_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(range_read, "PIECE_BYTES", 8192)
    state = {"w": torch.randn(400, 100), "x": torch.randn(10)}
    save_file(state, str(tmp_path / "model.safetensors"))
    reader = parallel_dcp.FastReader(tmp_path / "model.safetensors", workers=2, io="buffered", memory_limit="64KiB")
    plan = region_items(reader, "w", [50, 10], [120, 30])
    assert reader._source is not None
    monkeypatch.setattr(type(reader._source), "read", lambda *a: pytest.fail("a whole-tensor read"))
    reads: list[int] = []
    real = range_read.ShardFile.read

    def spy(self: ShardFile, offset: int, views: list[memoryview]) -> None:
        reads.append(sum(v.nbytes for v in views))
        real(self, offset, views)

    monkeypatch.setattr(range_read.ShardFile, "read", spy)
    shard = torch.empty(120, 30)
    reader.read_data(plan, RegionPlanner({"w": shard})).wait()  # type: ignore[arg-type]
    assert torch.equal(shard, state["w"][50:170, 10:40])
    row = 100 * 4
    assert sum(reads) == 120 * row  # the rows the region spans, nothing more
    assert max(reads) <= 8192  # each through a staging buffer of at most one piece
    assert (reader.stats.fast, reader.stats.fallback) == (1, 0)


def test_a_region_whose_rows_cannot_fit_under_the_memory_limit_is_refused_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {"w": torch.randn(4, 20_000)}  # one row: 80,000 bytes
    save_file(state, str(tmp_path / "model.safetensors"))
    reader = parallel_dcp.FastReader(tmp_path / "model.safetensors", workers=2, io="buffered", memory_limit="32KiB")
    plan = region_items(reader, "w", [1, 5], [2, 100])
    monkeypatch.setattr(range_read.ShardFile, "read", lambda *a: pytest.fail("read before the check"))
    with pytest.raises(MemoryLimitExceeded, match=r"'w'.*memory limit"):
        reader.read_data(plan, RegionPlanner({"w": torch.empty(2, 100)}))  # type: ignore[arg-type]


def test_a_computed_tensor_is_admitted_under_the_memory_limit(tmp_path: Path) -> None:
    base = torch.randn(300, 200)
    torch.save({"t": base.t()}, tmp_path / "model.pt")  # a strided view: read by Source.read, whole
    tight = parallel_dcp.FastReader(tmp_path / "model.pt", workers=2, io="buffered", memory_limit="64KiB")
    with pytest.raises(MemoryLimitExceeded, match=r"'t'.*memory limit"):
        tight.read_data(region_items(tight, "t", [0, 0], [200, 300]), RegionPlanner({"t": torch.empty(200, 300)}))  # type: ignore[arg-type]
    roomy = parallel_dcp.FastReader(tmp_path / "model.pt", workers=2, io="buffered", memory_limit="1MiB")
    out = torch.empty(50, 300)
    roomy.read_data(region_items(roomy, "t", [100, 0], [50, 300]), RegionPlanner({"t": out})).wait()  # type: ignore[arg-type]
    assert torch.equal(out, base.t()[100:150])


def test_keys_read_only_the_spans_of_the_selected_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_spans: None
) -> None:
    src = folder(tmp_path / "hf", release())
    reads: list[int] = []
    real = ShardFile.read_into

    def spy(self: ShardFile, views: list[memoryview], offset: int) -> int:
        reads.append(sum(v.nbytes for v in views))
        return real(self, views, offset)

    monkeypatch.setattr(ShardFile, "read_into", spy)
    loaded = parallel_dcp.load(src, keys=["b.proj"], workers=2, io="buffered")
    assert list(loaded) == ["b.proj"] and torch.equal(loaded["b.proj"], stock(src)["b.proj"])
    assert loaded["b.proj"].nbytes <= sum(reads) <= loaded["b.proj"].nbytes + 2 * ALIGN


def test_a_tensor_its_dtype_does_not_align_is_read_through_pieces(tmp_path: Path) -> None:
    """safetensors does not require offsets that are multiples of the dtype's size: such a
    tensor cannot be a view of a span (it is read into memory of its own)."""
    import json
    import struct

    odd = torch.tensor([1, -2, 3], dtype=torch.int8)
    wide = torch.arange(1000, dtype=torch.float32)
    header = {
        "odd": {"dtype": "I8", "shape": [3], "data_offsets": [0, 3]},
        "wide": {"dtype": "F32", "shape": [1000], "data_offsets": [3, 4003]},
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + odd.numpy().tobytes() + wide.numpy().tobytes())
    loaded = parallel_dcp.load(path, workers=2)
    assert torch.equal(loaded["odd"], odd) and torch.equal(loaded["wide"], wide)


@pytest.mark.parametrize(
    ("direct", "buffered", "reads"),
    [(1.0e9, 1.05e9, "direct"), (1.0e9, 1.2e9, "buffered")],
    ids=["a-tie-goes-to-direct", "buffered-clearly-faster"],
)
def test_whole_tensors_are_read_buffered_only_when_clearly_faster(
    disk: Path, monkeypatch: pytest.MonkeyPatch, small_probe: None, direct: float, buffered: float, reads: str
) -> None:
    src = folder(disk / "hf", release())
    fake(monkeypatch, direct, buffered)
    stats = parallel_dcp.ReadStats()
    assert_same(parallel_dcp.load(src, workers=2, stats=stats), stock(src))
    assert stats.read_choice is not None and stats.read_choice.measured and stats.read_choice.reads == reads
    # the margin is the file system's measurement's own: the DCP path and into= follow it too
    measured = read_choice.read_choice("auto", src, list(src.glob("*.safetensors")), streams=2)
    assert measured.reads == reads
