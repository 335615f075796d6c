"""io="auto" for reads: direct or buffered as measured on the file system, once per process.

The device is faked where a test needs one mode to win: the probe's reads are real (ShardFile on
the job's own file) but its clock advances by the bytes each read moved over the rate the test
gives that mode. No test asserts a wall-clock time.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

import parallel_dcp
from parallel_dcp.errors import InvalidDestinationError
from parallel_dcp.formats import read_units
from parallel_dcp.storage import direct_read, io_mode, read_choice, read_probe
from parallel_dcp.storage.direct_read import ShardFile

MiB = 1 << 20


@pytest.fixture(autouse=True)
def fresh_choices() -> Iterator[None]:
    read_choice.forget_read_choices()
    yield
    read_choice.forget_read_choices()


@pytest.fixture
def shm() -> Iterator[Path]:
    if io_mode.file_system_type("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    path = Path(tempfile.mkdtemp(prefix="pdcp-readchoice-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probe slices and the direct-read threshold scaled down, so a checkpoint of a few MiB is
    measured like one of gigabytes."""
    monkeypatch.setattr(read_probe, "PROBE_SLICE", 256 << 10)
    monkeypatch.setattr(read_probe, "MIN_SLICE", 64 << 10)
    monkeypatch.setattr(read_probe, "readahead_bytes", lambda device: 64 << 10)
    monkeypatch.setattr(io_mode, "DIRECT_MIN_BYTES", 1 * MiB)


class FakeDevice:
    """A device where direct and buffered reads move ``rates[mode]`` bytes per second; records
    every read the probe makes (file, offset, bytes, mode) and every round (mode, offset, bytes,
    its readers' descriptors)."""

    def __init__(self, direct: float, buffered: float) -> None:
        self.rates = {True: direct, False: buffered}
        self.now = 0.0
        self.reads: list[tuple[Path, int, int, bool]] = []
        self.rounds: list[tuple[bool, int, int, set[int]]] = []
        self.lock = threading.Lock()

    def clock(self) -> float:
        with self.lock:
            return self.now

    def read(self, shard: ShardFile, offset: int, view: memoryview) -> None:
        shard.read(offset, [view])  # the real read: the probe's plan is exercised on a real file
        with self.lock:
            self.reads.append((shard.path, offset, view.nbytes, shard.direct))
            self.now += view.nbytes / self.rates[shard.direct]


def install(monkeypatch: pytest.MonkeyPatch, device: FakeDevice) -> FakeDevice:
    real_round = read_probe._round
    real_read = device.read

    def counted_round(pool: object, shards: list[ShardFile], offset: int, buffer: memoryview) -> float:
        device.rounds.append((shards[0].direct, offset, buffer.nbytes, {shard.fd for shard in shards}))
        return real_round(pool, shards, offset, buffer)  # type: ignore[arg-type]

    def counted_read(shard: ShardFile, offset: int, view: memoryview) -> None:
        assert shard.fd in device.rounds[-1][3]  # read through one of the round's readers
        real_read(shard, offset, view)

    monkeypatch.setattr(read_probe, "_clock", device.clock)
    monkeypatch.setattr(read_probe, "_round", counted_round)
    monkeypatch.setattr(read_probe, "_read_slice", counted_read)
    return device


def fake(monkeypatch: pytest.MonkeyPatch, direct: float, buffered: float) -> FakeDevice:
    return install(monkeypatch, FakeDevice(direct, buffered))


def sparse_file(path: Path, nbytes: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(nbytes)
    return path


def shard_modes(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each shard the job's reading threads open is read with O_DIRECT."""
    opened: list[bool] = []

    class Spy(ShardFile):
        def __init__(self, path: str | os.PathLike[str], *, io: str = "buffered") -> None:
            super().__init__(path, io=io)
            opened.append(self.direct)

    monkeypatch.setattr(read_units, "ShardFile", Spy)
    return opened


@pytest.mark.parametrize(
    ("direct", "buffered", "reads", "resolved"),
    [(1.5e9, 1.0e9, "direct", "auto"), (1.0e9, 1.4e9, "buffered", "buffered")],
    ids=["direct-wins", "buffered-wins"],
)
def test_auto_follows_the_measurement(
    disk: Path, monkeypatch: pytest.MonkeyPatch, direct: float, buffered: float, reads: str, resolved: str
) -> None:
    device = fake(monkeypatch, direct, buffered)
    sample = sparse_file(disk / "shard.distcp", 256 * MiB)
    choice = read_choice.read_choice("auto", disk, [sample], streams=2)
    assert (choice.reads, choice.io, choice.reason) == (reads, resolved, "measured")
    assert choice.direct_bytes_per_s == pytest.approx(direct)
    assert choice.buffered_bytes_per_s == pytest.approx(buffered)
    assert choice.probed == str(sample)
    assert {mode for *_, mode in device.reads} == {True, False}  # both modes really read


@pytest.mark.parametrize(
    ("buffered", "reads", "reason"),
    [
        (1.05e9, "direct", "measured (buffered ahead by less than 10%: direct)"),
        (1.10e9, "direct", "measured (buffered ahead by less than 10%: direct)"),
        (1.2e9, "buffered", "measured"),
    ],
    ids=["ahead-5%", "ahead-10%", "ahead-20%"],
)
def test_buffered_must_lead_by_more_than_the_margin_for_every_reader(
    disk: Path, monkeypatch: pytest.MonkeyPatch, small_probe: None, buffered: float, reads: str, reason: str
) -> None:
    """A buffered read's time here depends on the memory its page cache lands in (direct's does
    not: bench/read-memory-state.txt), and the probe sees only its first pages: buffered is chosen
    only when measured ahead by more than BUFFERED_MARGIN, for load, FastReader and verify alike;
    the measured rates are reported as they were."""
    sd = {"w": torch.randn(1024, 1024), "b": torch.randn(16)}  # a 4 MiB shard
    parallel_dcp.save(sd, disk / "ckpt", workers=1, io="buffered")
    fake(monkeypatch, 1.0e9, buffered)
    opened = shard_modes(monkeypatch)
    stats = parallel_dcp.ReadStats()
    out = parallel_dcp.load(disk / "ckpt", workers=2, stats=stats)
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"])
    choice = stats.read_choice
    assert choice is not None and (choice.reads, choice.reason) == (reads, reason)
    assert choice.io == ("auto" if reads == "direct" else "buffered")
    assert choice.buffered_bytes_per_s == pytest.approx(buffered) and choice.direct_bytes_per_s == pytest.approx(1e9)
    # (the small record "b" is scattered into its tensor through the page cache whatever was measured)
    assert opened and set(opened) == ({True, False} if reads == "direct" else {False})
    reader = parallel_dcp.FastReader(disk / "ckpt", workers=2)
    targets = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp_load(targets, storage_reader=reader, no_dist=True)
    assert torch.equal(targets["w"], sd["w"])
    assert reader.read_choice == choice  # the same measurement, the same rule
    report = parallel_dcp.verify(disk / "ckpt", workers=2)
    assert report.read_choice is not None and report.read_choice.reads == reads


class NoisyFirstBlock(FakeDevice):
    """Direct reads slowed to a third for the first ``slow`` of them (a neighbour's burst on a
    busy machine), then at their own rate."""

    def __init__(self, direct: float, buffered: float, slow: int) -> None:
        super().__init__(direct, buffered)
        self.slow = slow

    def read(self, shard: ShardFile, offset: int, view: memoryview) -> None:
        with self.lock:
            slowed = shard.direct and self.slow > 0
            self.slow -= slowed
            if slowed:
                self.now += 2 * view.nbytes / self.rates[True]
        super().read(shard, offset, view)


def test_one_noisy_block_does_not_choose_buffered(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Direct 1.5 GB/s, buffered 1.0, but the first block's first direct round read at a third:
    that block has buffered ahead (0.75 against 1.0), so a second block runs, has direct ahead,
    and the medians over both choose direct."""
    sample = sparse_file(disk / "shard.distcp", 1 << 30)  # rounds of 16 MiB: 1/64 of it
    device = install(monkeypatch, NoisyFirstBlock(1.5e9, 1.0e9, slow=16 * MiB // direct_read.REQUEST_BYTES))
    choice = read_choice.read_choice("auto", disk, [sample], streams=2)
    assert (choice.reads, choice.reason) == ("direct", "measured")
    assert choice.probe_blocks == 2 and len(device.rounds) == 2 * 4
    assert choice.direct_bytes_per_s == pytest.approx((0.75e9 + 1.5e9) / 2)
    assert choice.buffered_bytes_per_s == pytest.approx(1.0e9)


@pytest.mark.parametrize(("direct", "buffered", "blocks"), [(1.5e9, 1.0e9, 1), (1.0e9, 1.4e9, 3)])
def test_a_second_block_runs_only_where_buffered_led(
    disk: Path, monkeypatch: pytest.MonkeyPatch, direct: float, buffered: float, blocks: int
) -> None:
    device = fake(monkeypatch, direct, buffered)
    sample = sparse_file(disk / "shard.distcp", 1 << 30)
    choice = read_choice.read_choice("auto", disk, [sample], streams=2)
    assert choice.probe_blocks == blocks and len(device.rounds) == blocks * 4
    assert choice.reads == ("direct" if direct > buffered else "buffered")


@pytest.mark.parametrize(("direct", "buffered", "expect_direct"), [(3e9, 1e9, True), (1e9, 3e9, False)])
def test_load_and_fast_reader_read_as_measured(
    disk: Path,
    monkeypatch: pytest.MonkeyPatch,
    small_probe: None,
    direct: float,
    buffered: float,
    expect_direct: bool,
) -> None:
    sd = {"w": torch.randn(1024, 1024), "b": torch.randn(16)}  # a 4 MiB shard
    parallel_dcp.save(sd, disk / "ckpt", workers=1, io="buffered")
    fake(monkeypatch, direct, buffered)
    opened = shard_modes(monkeypatch)
    before = read_choice.read_probe_count()

    stats = parallel_dcp.ReadStats()
    out = parallel_dcp.load(disk / "ckpt", workers=2, stats=stats)
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"])
    assert stats.read_choice is not None and stats.read_choice.reason == "measured"
    assert stats.read_choice.reads == ("direct" if expect_direct else "buffered")
    # (the small record "b" is scattered into its tensor through the page cache whatever was measured)
    assert opened and set(opened) == ({True, False} if expect_direct else {False})

    opened.clear()
    targets = {k: torch.zeros_like(v) for k, v in sd.items()}
    reader = parallel_dcp.FastReader(disk / "ckpt", workers=2)
    dcp_load(targets, storage_reader=reader, no_dist=True)
    assert torch.equal(targets["w"], sd["w"])
    assert reader.read_choice is not None and reader.read_choice.reads == stats.read_choice.reads
    assert reader.stats.read_choice == reader.read_choice
    assert opened and set(opened) == {expect_direct}
    assert read_choice.read_probe_count() == before + 1  # the reader reused the load's measurement


def test_probe_runs_once_per_file_system_and_process(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake(monkeypatch, 1e9, 2e9)
    first = sparse_file(disk / "a.distcp", 160 * MiB)
    second = sparse_file(disk / "b.distcp", 200 * MiB)
    before = read_choice.read_probe_count()
    choices = [read_choice.read_choice("auto", disk, [first, second]) for _ in range(3)]
    choices.append(read_choice.read_choice("auto", disk, [first]))
    assert read_choice.read_probe_count() == before + 1
    assert {c.reads for c in choices} == {"buffered"}
    assert choices[0].probed == str(second)  # the largest file the job reads

    # another file system (another st_dev) is measured on its own
    real = read_choice._largest
    monkeypatch.setattr(read_choice, "_largest", lambda files: [(n, size, -12345) for n, size, _ in real(files)])
    read_choice.read_choice("auto", disk, [first])
    read_choice.read_choice("auto", disk, [first])
    assert read_choice.read_probe_count() == before + 2


def test_the_probe_reads_only_the_file_the_job_reads(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device = fake(monkeypatch, 2e9, 1e9)
    other = disk / "other.distcp"
    other.write_bytes(b"not to be read")
    sample = sparse_file(disk / "__0_0.distcp", 100 * MiB + 12345)  # not a multiple of anything
    opened: list[str] = []
    real_open = direct_read.open_source

    def spy(name: str | os.PathLike[str]) -> int:
        opened.append(os.fspath(name))
        return real_open(name)

    monkeypatch.setattr(direct_read, "open_source", spy)
    before = sorted(os.listdir(disk))
    choice = read_choice.read_choice("auto", disk, [sample], streams=4)
    assert choice.reason == "measured"
    assert set(opened) == {str(sample)}
    assert device.reads and all(path == sample for path, *_ in device.reads)
    size = sample.stat().st_size
    assert all(offset >= 0 and offset + n <= size for _, offset, n, _ in device.reads)
    assert sorted(os.listdir(disk)) == before  # nothing written beside it


@pytest.mark.parametrize(
    "sizes",
    [[8 * MiB], [64 * MiB], [100 * MiB], [1 << 30], [2 << 30], [40 * MiB, 30 * MiB, 20 * MiB], [70 * MiB, 70 * MiB]],
)
def test_probe_plan_stays_inside_the_files_and_reads_each_place_once(sizes: list[int]) -> None:
    plan = read_probe.slices(sizes, readahead=8 * MiB)
    if plan is None:
        assert sum(size // (read_probe.MIN_SLICE + 16 * MiB) for size in sizes) < 4
        return
    step = plan.length + plan.gap
    slots = [slot for round_ in plan.rounds for slot in round_]
    assert len(set(slots)) == len(slots) and plan.gap >= 16 * MiB  # twice the read-ahead after every slice
    for file, offset in slots:
        assert offset >= 0 and offset % step == 0 and offset + step <= sizes[file]
    # within a file every round reads below every round before it: read-ahead never runs into a later round
    for earlier, later in zip(plan.rounds, plan.rounds[1:], strict=False):
        for f, low in later:
            assert all(low < high for g, high in earlier if g == f)
    # one run per round (the job reads one file's requests in order), at most 1/64 of the bytes
    assert all(len(round_) == 1 for round_ in plan.rounds)
    assert plan.length == read_probe.MIN_SLICE or plan.length * read_probe.PROBE_FRACTION <= sum(sizes)
    if sizes == [2 << 30]:
        assert plan.length == read_probe.PROBE_SLICE == 32 * MiB  # four read-ahead windows of 8 MiB


def test_small_shards_are_probed_across_files_with_full_slices(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device = fake(monkeypatch, 1e9, 2e9)
    monkeypatch.setattr(read_probe, "readahead_bytes", lambda dev: 8 * MiB)
    files = [sparse_file(disk / f"__{i}_0.distcp", 60 * MiB) for i in range(6)]  # none holds 4 rounds alone
    choice = read_choice.read_choice("auto", disk, files, streams=2)
    assert choice.reason == "measured" and choice.reads == "buffered"
    assert {n for _, _, n, _ in device.rounds} == {4 * MiB}  # 360 MiB / 64, rounded down to a power of 2
    assert len({path for path, *_ in device.reads}) > 1 and {p for p, *_ in device.reads} <= set(files)


def test_the_probe_reads_each_run_as_the_job_reads_it(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round is one run of the file, read in the job's requests (REQUEST_BYTES, in order)
    by as many readers as the job runs (4 per reading thread), each through its own descriptor."""
    device = fake(monkeypatch, 1e9, 2e9)
    sample = sparse_file(disk / "shard.distcp", 1 << 30)
    read_choice.read_choice("auto", disk, [sample], streams=2)
    assert device.rounds
    request = direct_read.REQUEST_BYTES
    for direct, offset, nbytes, descriptors in device.rounds:
        run = sorted((o, n) for _, o, n, mode in device.reads if mode == direct and offset <= o < offset + nbytes)
        assert run == [(offset + k, request) for k in range(0, nbytes, request)]
        assert len(descriptors) == read_probe.probe_readers(2) == 8


class ReadAheadRamp(FakeDevice):
    """A device whose buffered reads are slow for the first ``window`` bytes of a run (the
    kernel's read-ahead not yet ahead of the readers) and fast after; direct reads keep one rate."""

    def __init__(self, direct: float, slow: float, fast: float, window: int) -> None:
        super().__init__(direct, fast)
        self.slow, self.window = slow, window

    def read(self, shard: ShardFile, offset: int, view: memoryview) -> None:
        with self.lock:
            start = self.rounds[-1][1]
            if not shard.direct and offset - start < self.window:
                self.now += view.nbytes / self.slow - view.nbytes / self.rates[False]
        super().read(shard, offset, view)


def test_buffered_reads_are_measured_past_the_read_ahead_ramp(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffered reads 0.8 GB/s for the first 8 MiB of a run, 2.4 GB/s after; direct 1.2 GB/s: a
    whole load reads buffered faster, and so does the probe's 32 MiB run of a 2 GiB folder (an
    8 MiB slice, as the probe read before, saw only the ramp and chose direct)."""
    device = install(monkeypatch, ReadAheadRamp(1.2e9, slow=0.8e9, fast=2.4e9, window=8 * MiB))
    files = [sparse_file(disk / f"model-0000{i}.safetensors", 1 << 30) for i in range(2)]
    choice = read_choice.read_choice("auto", disk, files, streams=2)
    assert {n for _, _, n, _ in device.rounds} == {32 * MiB}
    assert (choice.reads, choice.reason) == ("buffered", "measured")
    assert choice.buffered_bytes_per_s is not None and choice.direct_bytes_per_s is not None
    assert choice.buffered_bytes_per_s > choice.direct_bytes_per_s


def test_tmpfs_reads_buffered_without_probing(shm: Path) -> None:
    sample = sparse_file(shm / "shard.distcp", 256 * MiB)
    before = read_choice.read_probe_count()
    choice = read_choice.read_choice("auto", shm, [sample])
    assert (choice.io, choice.reads) == ("buffered", "buffered") and "tmpfs" in choice.reason
    with pytest.raises(InvalidDestinationError, match=r"io='direct': cannot read .* tmpfs"):
        read_choice.read_choice("direct", shm, [sample])
    assert read_choice.read_probe_count() == before

    sd = {"w": torch.randn(64, 64)}
    parallel_dcp.save(sd, shm / "ckpt", workers=1)
    stats = parallel_dcp.ReadStats()
    parallel_dcp.load(shm / "ckpt", workers=1, stats=stats)
    assert stats.read_choice is not None and stats.read_choice.reads == "buffered"
    assert "tmpfs" in stats.read_choice.reason and not stats.read_choice.measured
    assert read_choice.read_probe_count() == before


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_direct_and_buffered_skip_the_probe(
    disk: Path, monkeypatch: pytest.MonkeyPatch, small_probe: None, io: str
) -> None:
    fake(monkeypatch, 1e9, 1e9)
    sd = {"w": torch.randn(1024, 1024)}
    parallel_dcp.save(sd, disk / "ckpt", workers=1)
    opened = shard_modes(monkeypatch)
    before = read_choice.read_probe_count()
    stats = parallel_dcp.ReadStats()
    assert torch.equal(parallel_dcp.load(disk / "ckpt", workers=2, io=io, stats=stats)["w"], sd["w"])
    assert stats.read_choice is not None and stats.read_choice.reads == io and not stats.read_choice.measured
    assert set(opened) == {io == "direct"}
    reader = parallel_dcp.FastReader(disk / "ckpt", workers=2, io=io)
    dcp_load({"w": torch.zeros_like(sd["w"])}, storage_reader=reader, no_dist=True)
    assert reader.read_choice is not None and reader.read_choice.reads == io
    assert read_choice.read_probe_count() == before


def test_small_files_are_read_buffered_without_probing(disk: Path) -> None:
    sd = {"w": torch.randn(256, 256)}
    parallel_dcp.save(sd, disk / "ckpt", workers=1)
    before = read_choice.read_probe_count()
    stats = parallel_dcp.ReadStats()
    parallel_dcp.load(disk / "ckpt", workers=1, stats=stats)
    assert stats.read_choice is not None and stats.read_choice.reads == "buffered"
    assert read_choice.read_probe_count() == before


def test_a_file_system_that_refuses_o_direct_is_remembered_as_buffered(
    disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = fcntl.fcntl

    def refuse(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(direct_read.fcntl, "fcntl", refuse)
    sample = sparse_file(disk / "shard.distcp", 256 * MiB)
    before = read_choice.read_probe_count()
    first = read_choice.read_choice("auto", disk, [sample])
    again = read_choice.read_choice("auto", disk, [sample])
    assert first == again and (first.io, first.reads) == ("buffered", "buffered")
    assert "refuses O_DIRECT" in first.reason
    assert read_choice.read_probe_count() == before + 1


@pytest.mark.parametrize(("direct", "buffered", "reads"), [(3e9, 1e9, "direct"), (1e9, 3e9, "buffered")])
def test_verify_reads_as_measured(
    disk: Path, monkeypatch: pytest.MonkeyPatch, small_probe: None, direct: float, buffered: float, reads: str
) -> None:
    parallel_dcp.save({"w": torch.randn(1024, 1024)}, disk / "ckpt", workers=1, io="buffered")
    fake(monkeypatch, direct, buffered)
    report = parallel_dcp.verify(disk / "ckpt", workers=1)
    assert report.ok, report.problems
    assert report.read_choice is not None and report.read_choice.reads == reads
    assert report.read_choice.measured and report.as_dict()["read_io"] == reads
