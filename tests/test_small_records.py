"""Many small records read in bulk (formats/record_batch.py): one record of each shape parsed, the
rest checked byte for byte against it and copied; bit for bit equal to stock dcp.load, for
checkpoints written by stock dcp.save (records differ in their CRC-32s and serialization ids) and
by parallel_dcp; a record unlike its template is parsed on its own (and refused when damaged)."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

import parallel_dcp
from parallel_dcp import CorruptCheckpointError
from parallel_dcp.formats import dcp_records, read_units, small_reads
from parallel_dcp.formats.dcp_records import parse_record, varying_spans
from parallel_dcp.formats.record_batch import SpanTable, Template, check_batch, make_template
from parallel_dcp.storage import metadata_check
from parallel_dcp.storage.metadata import read_metadata_columns
from tests.conftest import assert_same, empty_like_state

SHAPES = [(16,), (4, 8), (33,), (2, 3, 5)]
COUNT = 240


def optimizer_like() -> dict[str, Any]:
    """COUNT small tensors of a few shapes and dtypes, each with its own values."""
    g = torch.Generator().manual_seed(3)
    state: dict[str, Any] = {}
    for i in range(COUNT):
        shape = SHAPES[i % len(SHAPES)]
        dtype = torch.float32 if i % 3 else torch.bfloat16
        state[f"{i}"] = {"exp_avg": torch.randn(shape, generator=g).to(dtype), "step": torch.tensor(float(i))}
    return {"optimizer": {"state": state}}


def write(kind: str, sd: Any, path: Path) -> None:
    if kind == "stock":
        dcp.save(sd, storage_writer=FileSystemWriter(str(path), thread_count=2), no_dist=True)
    else:
        parallel_dcp.save(sd, path, workers=2)


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many records the reading threads parsed on their own."""
    count = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return parse_record(*args, **kwargs)

    monkeypatch.setattr(read_units, "parse_record", counted)
    return count


def stock_load(sd: Any, path: Path) -> Any:
    expected = empty_like_state(sd)
    dcp.load(expected, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return expected


@pytest.mark.parametrize("kind", ["stock", "pdcp"])
def test_many_small_records_load_bit_for_bit_with_one_parse_per_shape(
    tmp_path: Path, kind: str, parses: list[int]
) -> None:
    sd = optimizer_like()
    write(kind, sd, tmp_path / "ckpt")
    expected = stock_load(sd, tmp_path / "ckpt")
    into = empty_like_state(sd)
    stats = parallel_dcp.ReadStats()
    parallel_dcp.load(tmp_path / "ckpt", into=into, workers=2, stats=stats)
    assert_same(into, expected)
    assert stats.fast == 2 * COUNT and stats.fallback == 0
    # a record of each (length, dtype, shape) parsed once, not one per record (was 480)
    shapes = {(tuple(t.shape), t.dtype) for v in sd["optimizer"]["state"].values() for t in v.values()}
    assert parses[0] <= 2 * len(shapes)  # each of the two threads may parse a shape before the other shows it
    parses[0] = 0
    loaded = parallel_dcp.load(tmp_path / "ckpt", workers=1)  # allocating
    assert_same(loaded, expected)
    parses[0] = 0
    reader = parallel_dcp.FastReader(tmp_path / "ckpt", workers=2)
    through = empty_like_state(sd)
    dcp.load(through, storage_reader=reader, no_dist=True)
    assert_same(through, expected)
    assert parses[0] <= 2 * len(shapes)


def _records(path: Path) -> list[tuple[str, Any]]:
    metadata = pickle.loads((path / ".metadata").read_bytes())
    return sorted(
        ((index.fqn, info) for index, info in metadata.storage_data.items()),
        key=lambda r: (r[1].relative_path, r[1].offset),
    )


def _damage(path: Path, key: str, change: Any) -> None:
    info = next(info for fqn, info in _records(path) if fqn == key)
    shard = path / info.relative_path
    data = bytearray(shard.read_bytes())
    record = data[info.offset : info.offset + info.length]
    change(record)
    data[info.offset : info.offset + info.length] = record
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["stock", "pdcp"])
def test_a_record_unlike_its_template_is_parsed_on_its_own_and_refused(tmp_path: Path, kind: str) -> None:
    """The shape in one record's pickle changed (33 -> 34 elements of the same bytes would not fit
    its .metadata): the bulk check must not copy it as its neighbours' layout."""
    sd = optimizer_like()
    write(kind, sd, tmp_path / "ckpt")
    victim = "optimizer.state.2.exp_avg"  # (33,) float32, one of many records of that shape

    def other_shape(record: bytearray) -> None:
        at = record.find(b"K!")  # the pickle's BININT1 33 (the size)
        assert at > 0
        record[at + 1] = 34

    _damage(tmp_path / "ckpt", victim, other_shape)
    with pytest.raises(CorruptCheckpointError, match=r"optimizer\.state\.2\.exp_avg"):
        parallel_dcp.load(tmp_path / "ckpt", into=empty_like_state(sd))


def test_a_record_whose_directory_differs_is_not_taken_for_its_template(tmp_path: Path) -> None:
    """A byte of one record's zip directory changed (an entry's name): the bulk check must not
    copy it as its neighbours' layout; parsed on its own, DCP's reader refuses it, by name."""
    sd = optimizer_like()
    write("stock", sd, tmp_path / "ckpt")
    victim = "optimizer.state.6.exp_avg"

    def rename_pickle(record: bytearray) -> None:
        at = record.rfind(b"archive/data.pkl")  # the central directory's entry
        record[at : at + 7] = b"archivX"

    _damage(tmp_path / "ckpt", victim, rename_pickle)
    with pytest.raises(CorruptCheckpointError, match=r"optimizer\.state\.6\.exp_avg"):
        parallel_dcp.load(tmp_path / "ckpt", into=empty_like_state(sd))


def test_a_record_unlike_its_template_is_parsed_from_its_bytes_as_in_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bulk check zeroes every checked record's varying spans in the window buffer and leaves
    them zeroed; a record that then differs from its template is parsed on its own from its bytes
    as they are in the shard (read again), never from the zeroed copy."""
    sd = optimizer_like()
    write("stock", sd, tmp_path / "ckpt")
    victim = "optimizer.state.14.exp_avg"

    def other_shape(record: bytearray) -> None:
        record[record.find(b"K!") + 1] = 34

    _damage(tmp_path / "ckpt", victim, other_shape)
    info = next(info for fqn, info in _records(tmp_path / "ckpt") if fqn == victim)
    on_disk = (tmp_path / "ckpt" / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    seen: dict[str, bytes] = {}
    real = small_reads.checked_layout

    def spy(where: Any, key: str, offset: int, record: memoryview, *args: Any) -> Any:
        seen.setdefault(key, bytes(record))
        seen[key] = bytes(record)  # the last parse of the key: the one that decides
        return real(where, key, offset, record, *args)

    monkeypatch.setattr(small_reads, "checked_layout", spy)
    with pytest.raises(CorruptCheckpointError, match=r"optimizer\.state\.14\.exp_avg"):
        parallel_dcp.load(tmp_path / "ckpt", into=empty_like_state(sd), workers=1)
    assert seen[victim] == on_disk


def test_span_table_zeroes_the_varying_spans_of_every_record_at_once() -> None:
    """SpanTable zeroes exactly each record's own template's spans (rows of different widths)."""
    a, b = _torch_record(torch.arange(16.0)), _torch_record(torch.arange(8, dtype=torch.int64))
    templates = []
    for record in (a, b):
        layout = parse_record(memoryview(record), memoryview(record), len(record))
        assert layout is not None
        template = make_template(memoryview(record), layout, layout.data_bytes // layout.dtype.itemsize)
        assert template is not None
        templates.append(template)
    batch = bytearray(a + b + a)
    starts = [0, len(a), len(a) + len(b)]
    rows = [0, 1, 0]
    expected = bytearray(batch)
    for at, row in zip(starts, rows, strict=True):
        for p in templates[row].spans:
            expected[at + int(p)] = 0
    table = SpanTable(templates)
    table.zero(numpy.frombuffer(batch, dtype=numpy.uint8), numpy.array(starts), numpy.array(rows))
    assert batch == expected and batch != bytearray(a + b + a)


def _torch_record(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def test_varying_spans_cover_exactly_what_differs_between_two_saves() -> None:
    one, two = _torch_record(torch.arange(40.0)), _torch_record(torch.arange(40.0) + 1)
    assert len(one) == len(two)
    layout = parse_record(memoryview(one), memoryview(one), len(one))
    assert layout is not None
    spans = varying_spans(memoryview(one), layout)
    assert spans is not None
    data = range(layout.data_offset, layout.data_offset + layout.data_bytes)
    free = {p for a, b in spans for p in range(a, b)} | set(data)
    differ = {p for p in range(len(one)) if one[p] != two[p]}
    assert differ - free == set()
    assert differ - set(data)  # the CRC-32s (and torch's serialization id) do differ
    # whatever the free bytes hold (data aside), the record parses to the same layout
    scrambled = bytearray(one)
    for p in free - set(data):
        scrambled[p] ^= 0x5A
    assert parse_record(memoryview(scrambled), memoryview(scrambled), len(one)) == layout


def test_check_batch_takes_equal_records_and_refuses_a_changed_byte() -> None:
    record = _torch_record(torch.arange(40.0))
    layout = parse_record(memoryview(record), memoryview(record), len(record))
    assert layout is not None
    template = make_template(memoryview(record), layout, 40)
    assert isinstance(template, Template)
    others = [_torch_record(torch.arange(40.0) * k) for k in range(1, 5)]
    changed = bytearray(others[2])
    changed[layout.data_offset - 70] ^= 1  # inside the header before the data
    others[2] = bytes(changed)
    batch = bytearray(b"".join(others))
    before = bytes(batch)
    starts = [i * len(record) for i in range(len(others))]
    assert check_batch(batch, starts, [template] * 4) == [True, True, False, True]
    assert bytes(batch) == before  # the zeroed spans are put back
    assert dcp_records.varying_spans(memoryview(b"PK" + record[2:]), layout) is not None


def test_a_directory_pointing_a_descriptor_into_the_pickle_gets_no_template() -> None:
    """A crafted directory entry (.format_version's local header moved onto data.pkl's) would put
    its data descriptor's CRC-32 inside the pickle: records differing there must not pass as equal,
    so such a record gets no template (each record is parsed on its own)."""
    record = bytearray(_torch_record(torch.arange(40.0)))
    layout = parse_record(memoryview(record), memoryview(record), len(record))
    assert layout is not None
    at = record.rfind(b"archive/.format_version") - 46  # its central directory entry
    assert record[at : at + 4] == b"PK\x01\x02"
    record[at + 42 : at + 46] = (0).to_bytes(4, "little")  # its local header: data.pkl's
    assert parse_record(memoryview(record), memoryview(record), len(record)) == layout  # still parses alike
    assert varying_spans(memoryview(record), layout) is None


def test_when_the_templates_fill_their_room_records_are_parsed_one_by_one(
    tmp_path: Path, parses: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The templates a read keeps are bounded (CACHE_BYTES, counted in each thread's memory): past
    it, records of keys without a template are parsed on their own, with the same result."""
    from parallel_dcp.formats import record_batch

    monkeypatch.setattr(record_batch, "CACHE_BYTES", 0)
    sd = optimizer_like()
    write("pdcp", sd, tmp_path / "ckpt")
    into = empty_like_state(sd)
    stats = parallel_dcp.ReadStats()
    parallel_dcp.load(tmp_path / "ckpt", into=into, workers=2, stats=stats)
    assert_same(into, stock_load(sd, tmp_path / "ckpt"))
    assert stats.fast == 2 * COUNT
    assert parses[0] >= 2 * COUNT  # every record parsed on its own


# --- read as columns (formats/small_reads.py) and .metadata checked in columns (storage/metadata_check.py)


@pytest.mark.parametrize("kind", ["stock", "pdcp"])
def test_whole_small_records_build_no_read_item_per_key(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load(into=) of many whole small records plans them as plain columns: no read item and no
    request object per key (each cost more than reading the record); the result is stock's."""
    from parallel_dcp.jobs import load_plan as load_job

    sd = optimizer_like()
    write(kind, sd, tmp_path / "ckpt")
    expected = stock_load(sd, tmp_path / "ckpt")
    built = [0]
    real_item, real_request = load_job.ReadItem, load_job.fast_read.Request

    def item(*args: Any, **kwargs: Any) -> Any:
        built[0] += 1
        return real_item(*args, **kwargs)

    def request(*args: Any, **kwargs: Any) -> Any:
        built[0] += 1
        return real_request(*args, **kwargs)

    monkeypatch.setattr(load_job, "ReadItem", item)
    monkeypatch.setattr(load_job.fast_read, "Request", request)
    into = empty_like_state(sd)
    stats = parallel_dcp.ReadStats()
    parallel_dcp.load(tmp_path / "ckpt", into=into, workers=2, stats=stats)
    assert_same(into, expected)
    assert stats.fast == 2 * COUNT and stats.fallback == 0
    # only the pickled values of param-free state (none here) would need one: was 2 per key (960)
    assert built[0] == 0


def test_records_read_in_many_windows_through_one_reused_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parses: list[int]
) -> None:
    """Windows of a few records each (a tiny BATCH_BYTES), read one after another into one buffer
    that still holds the last window's bytes: every record lands whole and equal, and a record of
    each shape is still parsed once, not once per window."""
    from parallel_dcp.formats import small_reads

    sd = optimizer_like()
    write("stock", sd, tmp_path / "ckpt")
    expected = stock_load(sd, tmp_path / "ckpt")
    windows: list[int] = []
    real_read = small_reads._File.read

    def read(self: Any, offset: int, views: list[memoryview]) -> None:
        windows.append(offset)
        real_read(self, offset, views)

    monkeypatch.setattr(small_reads, "BATCH_BYTES", 4096)
    monkeypatch.setattr(small_reads, "SCATTER", False)  # the windows object storage is read in
    monkeypatch.setattr(small_reads._File, "read", read)
    into = empty_like_state(sd)
    parallel_dcp.load(tmp_path / "ckpt", into=into, workers=1)
    assert_same(into, expected)
    assert len(windows) > 2 * COUNT // 4  # a few records a window
    shapes = {(tuple(t.shape), t.dtype) for v in sd["optimizer"]["state"].values() for t in v.values()}
    assert parses[0] <= len(shapes)


def test_a_record_past_its_files_end_is_refused_before_any_copy(tmp_path: Path) -> None:
    """A shard cut short: the small-record path refuses it, naming the file, and leaves the
    caller's tensors as they were (the check runs before the first read)."""
    sd = optimizer_like()
    write("pdcp", sd, tmp_path / "ckpt")
    shard = max((tmp_path / "ckpt").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    into = empty_like_state(sd)
    for v in into["optimizer"]["state"].values():
        for t in v.values():
            t.fill_(7)
    with pytest.raises(CorruptCheckpointError, match=rf"{shard.name}.*(truncated|bytes)"):
        parallel_dcp.load(tmp_path / "ckpt", into=into, workers=1)
    assert all(bool((t == 7).all()) for v in into["optimizer"]["state"].values() for t in v.values())


def test_metadata_of_whole_chunks_is_checked_without_the_general_geometry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key of one whole chunk is checked inline (dtype, sizes, the chunk at the origin): the
    general chunk geometry runs for none of them; a key split in chunks still goes through it."""
    from parallel_dcp.storage import metadata_check
    from parallel_dcp.storage.metadata import read_metadata

    sd = optimizer_like()
    write("pdcp", sd, tmp_path / "ckpt")
    calls: list[str] = []
    real = metadata_check.check_chunks

    def counted(key: str, *args: Any, **kwargs: Any) -> None:
        calls.append(key)
        real(key, *args, **kwargs)

    monkeypatch.setattr(metadata_check, "check_chunks", counted)
    metadata = read_metadata(tmp_path / "ckpt")
    assert len(metadata.state_dict_metadata) == 2 * COUNT
    assert calls == []
    # the general path still refuses what it refused: a whole chunk of a size that is not the tensor's
    key = "optimizer.state.1.exp_avg"
    meta = metadata.state_dict_metadata[key]
    meta.chunks[0].sizes = torch.Size([s + 1 for s in meta.size])
    with pytest.raises(CorruptCheckpointError, match=r"optimizer\.state\.1\.exp_avg"):
        metadata_check.check_metadata_fields(metadata, "x")
    assert calls == [key]


def test_a_planted_global_in_metadata_is_still_refused(tmp_path: Path) -> None:
    """The allow-list unpickler reads .metadata before the column checks: a global outside the
    list is refused by name, nothing of it run, and no shard is read."""
    from parallel_dcp import UnsafeCheckpointError

    sd = optimizer_like()
    write("pdcp", sd, tmp_path / "ckpt")

    class Planted:
        def __reduce__(self) -> Any:
            return (print, ("ran",))

    metadata = pickle.loads((tmp_path / "ckpt" / ".metadata").read_bytes())
    metadata.storage_meta = Planted()  # type: ignore[assignment]
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match=r"builtins\.print"):
        parallel_dcp.load(tmp_path / "ckpt", into=empty_like_state(sd), workers=1)


class _Planted:
    """A value whose unpickling would call a function (print) if anything let it."""

    def __reduce__(self) -> Any:
        return (print, ("ran",))


def test_a_value_of_builtins_skips_torchs_python_unpickler_and_a_global_is_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An optimizer's param_groups (dicts, numbers, a list of one index per parameter) is read by
    the C unpickler with no global allowed, not by torch's weights_only unpickler (Python, ~2.5 us
    an element); a value that names a global still goes to weights_only=True and is refused."""
    from parallel_dcp import UnsafeCheckpointError
    from parallel_dcp.storage import metadata as metadata_module

    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(5000)), "name": None}]
    sd = {"state": {"0": torch.randn(8)}, "param_groups": groups}
    dcp.save(sd, storage_writer=FileSystemWriter(str(tmp_path / "ckpt")), no_dist=True)
    torch_loads = [0]
    real_load = metadata_module.torch.load

    def counted(*args: Any, **kwargs: Any) -> Any:
        torch_loads[0] += 1
        return real_load(*args, **kwargs)

    monkeypatch.setattr(metadata_module.torch, "load", counted)
    into = {"state": {"0": torch.empty(8)}, "param_groups": [{"lr": 0.0, "betas": (0, 0), "params": [], "name": 1}]}
    parallel_dcp.load(tmp_path / "ckpt", into=into, workers=1)
    assert into["param_groups"] == groups and torch.equal(into["state"]["0"], sd["state"]["0"])
    assert torch_loads[0] == 0  # was 1 per value (4 here)

    dcp.save(
        {"w": torch.ones(2), "x": _Planted()}, storage_writer=FileSystemWriter(str(tmp_path / "bad")), no_dist=True
    )
    capsys.readouterr()
    with pytest.raises(UnsafeCheckpointError, match=r"'x'.*weights_only"):
        parallel_dcp.load(tmp_path / "bad", workers=1)
    assert torch_loads[0] == 1  # torch's weights_only unpickler judged it
    assert "ran" not in capsys.readouterr().out


def test_a_load_reads_no_process_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load(into=) keeps its budget by reservation alone: it never reads this process's memory
    (smaps of a process holding a large state dict: tens of milliseconds), and such a budget
    refuses to sample rather than compare against a baseline it never read."""
    from parallel_dcp.engine import memory, process_memory

    sd = optimizer_like()
    write("pdcp", sd, tmp_path / "ckpt")
    reads = [0]
    real = process_memory.ChargeReader.charge

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        reads[0] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(process_memory.ChargeReader, "charge", counted)
    into = empty_like_state(sd)
    parallel_dcp.load(tmp_path / "ckpt", into=into, workers=2)
    assert_same(into, stock_load(sd, tmp_path / "ckpt"))
    assert reads[0] == 0  # was 1: the governor's baseline
    budget = memory.MemoryGovernor(1 << 30, measure=False)
    budget.reserve(1 << 20, "a tensor")
    with pytest.raises(RuntimeError, match="reservation alone"):
        budget.read([])
    assert reads[0] == 0


@pytest.mark.parametrize("kind", ["stock", "pdcp"])
def test_the_checks_columns_say_what_the_metadata_objects_say(tmp_path: Path, kind: str) -> None:
    """load(into=) plans small records from the columns the .metadata check leaves
    (storage.metadata_check.WholeRecords), not from the objects: they must agree with them, and a
    key whose record is not at the origin (or not one whole chunk) is not in them."""
    sd = optimizer_like()
    sd["split"] = torch.arange(6.0)
    write(kind, sd, tmp_path / "ckpt")
    metadata, columns = read_metadata_columns(tmp_path / "ckpt")
    tensors = {
        key: (meta.properties.dtype, tuple(meta.size))
        for key, meta in metadata.state_dict_metadata.items()
        if hasattr(meta, "chunks") and len(meta.chunks) == 1 and not any(meta.chunks[0].offsets)
    }
    assert columns.tensors == tensors
    records = [
        (index.fqn, info.relative_path, info.offset, info.length, info)
        for index, info in metadata.storage_data.items()
        if index.offset is not None and not any(index.offset)
    ]
    assert columns.records == records
    # a record moved off the origin in the index: no longer a whole record of its key
    index = next(i for i in metadata.storage_data if i.fqn == "split")
    moved = type(index)(index.fqn, torch.Size([1]), index.index)
    metadata.storage_data[moved] = metadata.storage_data.pop(index)
    again = metadata_check.check_metadata_fields(metadata, "x")
    assert "split" not in {record[0] for record in again.records}
