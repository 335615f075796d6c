"""A conversion to DCP reads the next unit while it writes the current one (storage.read_ahead,
jobs/streamed.py): the read-ahead happens, its ring fits in what the plan admitted, and the
output is the same bytes as the path that reads each unit as a tensor."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import parallel_dcp
from parallel_dcp.engine.partition import Task
from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.formats import open_source
from parallel_dcp.formats.safetensors_format import SafetensorsSource
from parallel_dcp.jobs import streamed
from parallel_dcp.jobs.targets import DcpTarget, Job
from parallel_dcp.storage import copy_choice, copy_probe, io_mode, read_ahead, read_choice, records
from parallel_dcp.storage.read_ahead import ReadAhead, Ring, Span, StreamedTensor, ring_for

MiB = 1 << 20


@pytest.fixture(autouse=True)
def crc_off() -> Iterator[None]:
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)  # what every job's workers run with by default
    read_choice.forget_read_choices()
    copy_choice.forget_copy_choices()
    yield
    torch.serialization.set_crc32_options(before)
    read_choice.forget_read_choices()
    copy_choice.forget_copy_choices()


def _shards(path: Path) -> list[bytes]:
    """The checkpoint's shard files' bytes, in the order of their task (names carry a save id)."""
    names = sorted((n for n in os.listdir(path) if n.endswith(".distcp")), key=lambda n: int(n.split("_")[2]))
    return [(path / n).read_bytes() for n in names]


def _source(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    file = path / "model.safetensors"
    save_file(tensors, file)
    return file


def _measured(monkeypatch: pytest.MonkeyPatch, *, direct: float, buffered: float) -> None:
    """io="auto" finds these rates of the ring (``direct``) and the mmap (``buffered``) beside the
    conversion's writes on every file system (as storage.copy_probe measures them); the source's
    files count as large enough to measure."""

    def rates(files: object, destination: object, streams: int, **kwargs: bool) -> copy_probe.CopyRates:
        return copy_probe.CopyRates(direct, buffered, 64 * MiB, 32 * MiB, streams, bool(kwargs["direct_writes"]))

    monkeypatch.setattr(copy_probe, "measure_copies", rates)
    monkeypatch.setattr(io_mode, "DIRECT_MIN_BYTES", 64 << 10)


def _events(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()]


def _instrument(monkeypatch: pytest.MonkeyPatch, log: Path) -> None:
    """Log, from the forked workers too, each ring made, each piece's read as it is issued (handed
    to a reading thread), and each record as its write ends (one line each, appended whole: the
    lines of two processes never mix)."""

    def note(line: str) -> None:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, f"{os.getpid()} {line}\n".encode())
        finally:
            os.close(fd)

    submit, write_record, enter = ReadAhead._submit, StreamedTensor.write_record, ReadAhead.__enter__

    def logged_submit(self: ReadAhead, k: int) -> None:
        note(f"read {self._pieces[k].span}")
        submit(self, k)

    def logged_write(self: StreamedTensor, stream: object) -> None:
        write_record(self, stream)
        note(f"wrote {self.index}")

    def logged_enter(self: ReadAhead) -> ReadAhead:
        note(f"ring {self.ring.depth} {self.ring.piece} {len(self.spans)}")
        return enter(self)

    monkeypatch.setattr(ReadAhead, "_submit", logged_submit)
    monkeypatch.setattr(StreamedTensor, "write_record", logged_write)
    monkeypatch.setattr(ReadAhead, "__enter__", logged_enter)


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        (torch.float32, (300, 7)),  # a small record: the writer's cached template
        (torch.bfloat16, (3, 1500, 1100)),  # above LEAN_MAX_BYTES: torch.save's own record
        (torch.float8_e4m3fn, (5000, 1000)),
        (torch.int64, (0, 3)),
    ],
)
def test_a_class_template_is_the_record_the_writer_writes_for_the_tensor(dtype: torch.dtype, shape: tuple) -> None:
    tensor = torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.randint(0, 9, shape, dtype=dtype)
    template = records.class_template(dtype, shape)
    assert template is not None
    small = records.template_for(tensor)
    if small is not None:
        want = small.prefix + records.storage_bytes(tensor).tobytes() + small.suffix
    else:
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        want = buffer.getvalue()
    assert template.prefix + records.storage_bytes(tensor).tobytes() + template.suffix == want


def test_no_class_template_while_the_crc_is_on() -> None:
    torch.serialization.set_crc32_options(True)
    assert records.class_template(torch.float32, (2048, 1024)) is None


def test_the_next_units_read_starts_before_the_current_units_write_ends(
    disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = {f"layer{i}": torch.randn(1024, 1024 + 64 * i) for i in range(6)}  # 4-5.5 MiB each
    src = _source(disk, tensors)
    log = disk / "events"
    _instrument(monkeypatch, log)
    monkeypatch.setattr(read_ahead, "PIECE_BYTES", 1 * MiB)  # several pieces per unit
    parallel_dcp.convert(src, disk / "out", workers=2, io="direct")
    events = _events(log)
    pids = {pid for pid, *_ in events}
    checked = 0
    for pid in pids:
        mine = [event for p, *event in events if p == pid]
        rings = [i for i, e in enumerate(mine) if e[0] == "ring"]
        for at, start in enumerate(rings):
            task = mine[start : rings[at + 1] if at + 1 < len(rings) else len(mine)]
            assert int(task[0][1]) >= 2  # a ring that reads ahead
            spans = int(task[0][3])
            for unit in range(spans - 1):
                wrote = task.index(["wrote", str(unit)])
                first_read_of_next = task.index(["read", str(unit + 1)])
                assert first_read_of_next < wrote, task
                checked += 1
    assert checked >= 2  # at least two tasks of several units each were seen
    got = {k: torch.empty_like(v) for k, v in tensors.items()}
    dcp.load(got, checkpoint_id=str(disk / "out"), no_dist=True)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


def test_read_ahead_outputs_are_the_bytes_of_the_tensor_path(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = {
        "embed": torch.randn(3000, 1100).to(torch.bfloat16),  # above LEAN_MAX_BYTES
        "norm": torch.randn(1100),
        "ids": torch.arange(5000, dtype=torch.int64),
        "fp8": torch.randn(2048, 2100).to(torch.float8_e4m3fn),
        "empty": torch.empty(0, 4),
    } | {f"w{i}": torch.randn(700 + i, 900) for i in range(5)}
    src = _source(disk, tensors)
    log = disk / "events"
    _instrument(monkeypatch, log)
    # chunk_size splits the large tensors into row chunks: those are streamed too
    parallel_dcp.convert(src, disk / "ahead", workers=2, io="direct", chunk_size="2MiB")
    assert any(e[0] == "ring" for _, *e in _events(log))
    monkeypatch.setattr(SafetensorsSource, "stream_reads", lambda self, io: None)
    log.unlink()
    parallel_dcp.convert(src, disk / "tensors", workers=2, io="direct", chunk_size="2MiB")
    assert not log.exists()  # the old path: no ring
    assert _shards(disk / "ahead") == _shards(disk / "tensors")
    got = {k: torch.empty_like(v) for k, v in tensors.items()}
    dcp.load(got, checkpoint_id=str(disk / "ahead"), no_dist=True)
    assert all(torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)) for k, v in tensors.items())


def test_the_ring_is_fitted_into_the_room_and_reads_ahead_only_where_two_pieces_fit() -> None:
    assert ring_for(100 * MiB, 50 * MiB) == Ring(4, 4 * MiB)  # the full ring, far less than one unit
    assert ring_for(9 * MiB, 50 * MiB) == Ring(2, 4 * MiB)
    small = ring_for(700 << 10, 600 << 10)  # two pieces of 256 KiB or more fit in 700 KiB
    assert small is not None and small.reads_ahead and small.memory <= 700 << 10
    alone = ring_for(200 << 10, 200 << 10)  # a room of one small unit: one piece, no read-ahead
    assert alone is not None and not alone.reads_ahead and alone.memory <= 200 << 10
    assert ring_for(64 << 10, 1000) is None
    for room in (80 << 10, 300 << 10, 3 * MiB, 17 * MiB):
        ring = ring_for(room, 40 * MiB)
        assert ring is not None and ring.memory <= room


def test_a_task_admitted_for_one_small_unit_converts_without_read_ahead(
    disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = {"only": torch.randn(50, 1024)}  # 200 KiB: the task's room is this unit's read
    src = _source(disk, tensors)
    source = open_source(str(src))
    try:
        assert isinstance(source, SafetensorsSource)
        source.stream_reads("direct")
        job = Job(source, ("only",))
        target = DcpTarget(disk / "unused")
        plan = streamed.streamed_plan(job, target, Task(0, ("only",), 200 << 10, job.memory("only")))
        assert plan is not None and not plan.ring.reads_ahead and plan.ring.memory <= job.memory("only")
    finally:
        source.close()
    log = disk / "events"
    _instrument(monkeypatch, log)
    _measured(monkeypatch, direct=2e9, buffered=1e9)
    parallel_dcp.convert(src, disk / "out", workers=1)
    (ring,) = [e for _, *e in _events(log) if e[0] == "ring"]
    assert ring[1] == "1"  # one piece: read, then written, then the next
    monkeypatch.setattr(SafetensorsSource, "stream_reads", lambda self, io: None)
    parallel_dcp.convert(src, disk / "tensors", workers=1)
    assert _shards(disk / "out") == _shards(disk / "tensors")


def test_a_span_past_the_end_of_its_file_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "short"
    file.write_bytes(b"x" * 10000)
    with ReadAhead([Span(str(file), 4000, 5000), Span(str(file), 9000, 5000)], Ring(2, 8192), "buffered") as reader:
        seen: list[bytes] = []
        reader.read_span(0, lambda view: seen.append(bytes(view)))
        assert b"".join(seen) == b"x" * 5000
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            reader.read_span(1, lambda view: None)


@pytest.mark.parametrize(
    ("direct", "buffered", "ring"),
    [(2e9, 1e9, True), (1.05e9, 1e9, False), (1e9, 1.5e9, False)],
)
def test_auto_reads_ahead_through_the_direct_ring_only_where_the_ring_measured_clearly_faster(
    disk: Path, monkeypatch: pytest.MonkeyPatch, direct: float, buffered: float, ring: bool
) -> None:
    tensors = {f"w{i}": torch.randn(512, 1024) for i in range(4)}
    src = _source(disk, tensors)
    log = disk / "events"
    _instrument(monkeypatch, log)
    _measured(monkeypatch, direct=direct, buffered=buffered)
    parallel_dcp.convert(src, disk / "out", workers=2)
    assert (log.exists() and any(e[0] == "ring" for _, *e in _events(log))) == ring
    got = {k: torch.empty_like(v) for k, v in tensors.items()}
    dcp.load(got, checkpoint_id=str(disk / "out"), no_dist=True)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
