"""io="auto" for a safetensors -> DCP conversion: the source read through the O_DIRECT ring or the
mmap, as measured beside the conversion's own writes (storage.copy_probe, storage.copy_choice).

The device is faked where a test needs one read path to win: the probe's copies are real (the
job's own source read through the ring or a mapping, written into the destination's staging
directory) but its clock advances by the bytes each copy moved over the rate the test gives that
path. No test asserts a wall-clock time.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import parallel_dcp
from parallel_dcp import cli
from parallel_dcp.errors import CheckpointExistsError
from parallel_dcp.storage import copy_choice, copy_probe, io_mode, ownership, read_choice
from parallel_dcp.storage.read_ahead import ReadAhead

MiB = 1 << 20


@pytest.fixture(autouse=True)
def fresh_choices() -> Iterator[None]:
    copy_choice.forget_copy_choices()
    read_choice.forget_read_choices()
    yield
    copy_choice.forget_copy_choices()
    read_choice.forget_read_choices()


@pytest.fixture
def small_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs and the direct-read threshold scaled down, so a source of a few MiB is measured like
    one of gigabytes."""
    monkeypatch.setattr(copy_probe, "PROBE_RUN", 256 << 10)
    monkeypatch.setattr(copy_probe, "MIN_RUN", 64 << 10)
    monkeypatch.setattr(copy_probe.read_probe, "readahead_bytes", lambda device: 64 << 10)
    monkeypatch.setattr(io_mode, "DIRECT_MIN_BYTES", 1 * MiB)


class FakeDevice:
    """Where the ring and the mmap move ``rates[ring]`` bytes per second beside the writes; records
    every copy the probe makes (source, offset, bytes, ring?, the scratch file's directory)."""

    def __init__(self, ring: float, mmap: float) -> None:
        self.rates = {True: ring, False: mmap}
        self.now = 0.0
        self.copies: list[tuple[Path, int, int, bool, Path]] = []
        self.direct_writes: set[bool] = set()
        self.lock = threading.Lock()

    def clock(self) -> float:
        with self.lock:
            return self.now


def fake(monkeypatch: pytest.MonkeyPatch, ring: float, mmap: float) -> FakeDevice:
    device = FakeDevice(ring, mmap)
    real_copy = copy_probe._copy

    def counted_copy(
        path: Path, offset: int, length: int, directory: Path, name: str, ring: bool, direct_writes: bool
    ) -> None:
        real_copy(path, offset, length, directory, name, ring, direct_writes)  # the real copy
        assert (directory / name).exists()  # written where the conversion writes, still there
        # named as a temporary file of the save staged there: a leftover the next save removes
        (owner,) = [n for n in os.listdir(directory) if n.startswith(".parallel_dcp.owner.")]
        assert ownership.is_of_save(name, owner.removeprefix(".parallel_dcp.owner."))
        with device.lock:
            device.copies.append((path, offset, length, ring, directory))
            device.direct_writes.add(direct_writes)
            device.now += length / device.rates[ring]

    monkeypatch.setattr(copy_probe, "_clock", device.clock)
    monkeypatch.setattr(copy_probe, "_copy", counted_copy)
    return device


def rings_made(monkeypatch: pytest.MonkeyPatch, log: Path) -> None:
    """Log each ring a conversion's forked workers read through (not the probe's, here)."""
    enter = ReadAhead.__enter__
    here = os.getpid()

    def logged_enter(self: ReadAhead) -> ReadAhead:
        if os.getpid() != here:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                os.write(fd, f"{os.getpid()} ring\n".encode())
            finally:
                os.close(fd)
        return enter(self)

    monkeypatch.setattr(ReadAhead, "__enter__", logged_enter)


def source(path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = {f"w{i}": torch.randn(256, 1024) for i in range(12)} | {"bias": torch.arange(7.0)}  # 12 MiB
    file = path / "model.safetensors"
    save_file(tensors, file)
    return file, tensors


def loads_as(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    got = {k: torch.empty_like(v) for k, v in tensors.items()}
    dcp.load(got, checkpoint_id=str(out), no_dist=True)  # stock DCP reads what was written
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


def shards(path: Path) -> list[bytes]:
    names = sorted((n for n in os.listdir(path) if n.endswith(".distcp")), key=lambda n: int(n.split("_")[2]))
    return [(path / n).read_bytes() for n in names]


@pytest.mark.parametrize(
    ("ring", "mmap", "reads"),
    [(2.0e9, 1.0e9, "direct"), (1.0e9, 1.5e9, "buffered"), (1.05e9, 1.0e9, "buffered")],
    ids=["ring-wins", "mmap-wins", "ring-within-the-margin"],
)
def test_auto_follows_the_measurement_beside_the_writes(
    disk: Path, small_probe: None, monkeypatch: pytest.MonkeyPatch, ring: float, mmap: float, reads: str
) -> None:
    src, tensors = source(disk)
    device = fake(monkeypatch, ring, mmap)
    log = disk / "rings"
    rings_made(monkeypatch, log)
    result = parallel_dcp.convert(src, disk / "out", workers=2)
    assert isinstance(result, parallel_dcp.SaveResult)
    choice = result.read_choice
    assert choice is not None and choice.reads == reads and choice.beside_writes is not None
    assert choice.direct_bytes_per_s == pytest.approx(ring) and choice.buffered_bytes_per_s == pytest.approx(mmap)
    assert f"{ring / 2**30:.2f} GiB/s" in choice.summary()
    # the workers read as chosen: through the ring only where it won
    assert (log.exists() and "ring" in log.read_text()) == (reads == "direct")
    # both paths measured, ABBA, two runs (the workers) a round, into the destination's staging
    modes = [c[3] for c in device.copies]
    assert modes.count(True) == modes.count(False) == 4
    assert {c[4] for c in device.copies} == {disk / "out"}
    assert device.direct_writes == {True} and result.io == "direct"  # written as the shards are
    assert not [n for n in os.listdir(disk / "out") if copy_probe.SCRATCH_NAME in n]
    loads_as(disk / "out", tensors)


def test_the_output_is_the_same_bytes_whichever_path_was_measured_faster(
    disk: Path, small_probe: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, tensors = source(disk)
    fake(monkeypatch, 2e9, 1e9)
    ring = parallel_dcp.convert(src, disk / "ring", workers=2)
    copy_choice.forget_copy_choices()
    fake(monkeypatch, 1e9, 2e9)
    mapped = parallel_dcp.convert(src, disk / "mmap", workers=2)
    assert isinstance(ring, parallel_dcp.SaveResult) and isinstance(mapped, parallel_dcp.SaveResult)
    assert ring.read_choice is not None and ring.read_choice.reads == "direct"
    assert mapped.read_choice is not None and mapped.read_choice.reads == "buffered"
    assert shards(disk / "ring") == shards(disk / "mmap")
    loads_as(disk / "ring", tensors)


def test_the_probe_runs_once_per_source_and_destination_file_system_and_process(
    disk: Path, small_probe: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, _ = source(disk)
    device = fake(monkeypatch, 2e9, 1e9)
    before = copy_choice.copy_probe_count()
    first = parallel_dcp.convert(src, disk / "a", workers=2)
    copies = len(device.copies)
    second = parallel_dcp.convert(src, disk / "b", workers=2)
    assert copy_choice.copy_probe_count() == before + 1 and len(device.copies) == copies
    assert isinstance(first, parallel_dcp.SaveResult) and isinstance(second, parallel_dcp.SaveResult)
    assert second.read_choice == first.read_choice


def test_the_probe_reads_only_the_source_and_each_place_once(
    disk: Path, small_probe: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, _ = source(disk)
    device = fake(monkeypatch, 1e9, 2e9)
    parallel_dcp.convert(src, disk / "out", workers=2)
    assert {c[0] for c in device.copies} == {src}
    runs = sorted((offset, length) for _, offset, length, _, _ in device.copies)
    assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(runs))  # no byte read twice
    assert runs[-1][0] + runs[-1][1] <= src.stat().st_size


@pytest.mark.parametrize("streams", [1, 2, 5])
def test_a_plan_keeps_its_runs_inside_the_files_with_gaps_past_the_read_ahead(streams: int) -> None:
    sizes = [3000 * MiB, 400 * MiB, 70 * MiB]
    plan = copy_probe.plan(sizes, streams, 8 * MiB)
    assert plan is not None and len(plan.rounds) == 4 and all(len(r) == streams for r in plan.rounds)
    assert plan.gap >= 2 * 8 * MiB and plan.length >= copy_probe.MIN_RUN
    assert 4 * streams * plan.length * copy_probe.PROBE_FRACTION <= sum(sizes)
    places = [(f, o) for r in plan.rounds for f, o in r]
    assert len(set(places)) == len(places)
    assert all(o + plan.length + plan.gap <= sizes[f] for f, o in places)
    for earlier, later in itertools.pairwise(places):  # within a file, each run below every earlier one
        if earlier[0] == later[0]:
            assert later[1] < earlier[1]
    assert copy_probe.plan([500 * MiB], 2, 8 * MiB) is None  # MIN_RUN runs would be more than the share


def test_a_source_too_small_to_measure_converts_through_the_mmap_unmeasured(
    disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(io_mode, "DIRECT_MIN_BYTES", 1 * MiB)  # large enough for O_DIRECT, not to measure
    src, tensors = source(disk)
    device = fake(monkeypatch, 2e9, 1e9)
    result = parallel_dcp.convert(src, disk / "out", workers=2)
    assert isinstance(result, parallel_dcp.SaveResult) and result.read_choice is not None
    assert result.read_choice.reads == "buffered" and "too small" in result.read_choice.reason
    assert device.copies == []
    loads_as(disk / "out", tensors)


def test_a_probe_that_fails_keeps_the_mmap_and_the_conversion_goes_on(
    disk: Path, small_probe: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, tensors = source(disk)

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(copy_probe, "measure_copies", broken)
    result = parallel_dcp.convert(src, disk / "out", workers=2)
    assert isinstance(result, parallel_dcp.SaveResult) and result.read_choice is not None
    assert result.read_choice.reads == "buffered" and "could not measure" in result.read_choice.reason
    loads_as(disk / "out", tensors)


def test_no_room_under_the_memory_limit_keeps_the_mmap_unmeasured(
    disk: Path, small_probe: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, tensors = source(disk)
    device = fake(monkeypatch, 2e9, 1e9)
    monkeypatch.setattr(copy_probe, "probe_memory", lambda streams, direct_writes: 1 << 50)
    result = parallel_dcp.convert(src, disk / "out", workers=2)
    assert isinstance(result, parallel_dcp.SaveResult) and result.read_choice is not None
    assert result.read_choice.reads == "buffered" and "no room" in result.read_choice.reason
    assert device.copies == []
    loads_as(disk / "out", tensors)


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_direct_and_buffered_are_as_asked_without_the_probe(
    disk: Path, small_probe: None, monkeypatch: pytest.MonkeyPatch, io: str
) -> None:
    src, tensors = source(disk)
    device = fake(monkeypatch, 1e9, 2e9)
    log = disk / "rings"
    rings_made(monkeypatch, log)
    parallel_dcp.convert(src, disk / "out", workers=2, io=io)
    assert device.copies == []
    assert log.exists() == (io == "direct")
    loads_as(disk / "out", tensors)


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("keys select nothing", ValueError),
        ("destination is a checkpoint", CheckpointExistsError),
        ("source is the destination", ValueError),
        ("destination parent missing", parallel_dcp.InvalidDestinationError),
    ],
)
def test_nothing_is_written_or_measured_before_bad_input_is_refused(
    disk: Path, small_probe: None, monkeypatch: pytest.MonkeyPatch, case: str, error: type[Exception]
) -> None:
    src, _ = source(disk)
    kwargs: dict[str, object] = {}
    dst = disk / "out"
    if case == "keys select nothing":
        kwargs["keys"] = "nothing.*"
    elif case == "destination is a checkpoint":
        parallel_dcp.convert(src, dst, workers=1, io="buffered")  # no probe: io asked
    elif case == "source is the destination":
        dst = src
    else:
        dst = disk / "missing" / "out"
    before = {p: p.stat().st_mtime_ns for p in disk.rglob("*") if p.is_file()}
    device = fake(monkeypatch, 2e9, 1e9)
    with pytest.raises(error):
        parallel_dcp.convert(src, dst, workers=2, **kwargs)  # type: ignore[arg-type]
    assert device.copies == [] and copy_choice._choices == {}
    assert {p: p.stat().st_mtime_ns for p in disk.rglob("*") if p.is_file()} == before  # nothing new, nothing changed


def test_the_cli_reports_the_choice_and_its_rates(
    disk: Path, small_probe: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    src, _ = source(disk)
    fake(monkeypatch, 2e9, 1e9)
    assert cli.main(["convert", str(src), str(disk / "out"), "--workers", "2", "--json"]) == 0
    (reported,) = json.loads(capsys.readouterr().out)
    assert reported["read_io"] == "direct"
    assert "ring 1.86 GiB/s" in reported["read_choice"] and "mmap 0.93 GiB/s" in reported["read_choice"]


def test_a_destination_without_o_direct_is_measured_with_buffered_writes(
    disk: Path, small_probe: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if io_mode.file_system_type("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    src, tensors = source(disk)
    device = fake(monkeypatch, 1e9, 2e9)
    shm = Path(tempfile.mkdtemp(prefix="pdcp-copychoice-", dir="/dev/shm"))
    try:
        result = parallel_dcp.convert(src, shm / "out", workers=2)
        assert isinstance(result, parallel_dcp.SaveResult) and result.io == "buffered"
        assert result.read_choice is not None and result.read_choice.reads == "buffered"
        assert "buffered writes" in result.read_choice.summary()
        assert device.direct_writes == {False} and {c[4] for c in device.copies} == {shm / "out"}
        loads_as(shm / "out", tensors)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
