"""Attacks on what ``.metadata`` says about where bytes are (issue 24, items 3-7, 9, 16, 17):
each crafts the file or record for real and checks that every reader ends in a ParallelDCPError,
before it reads or allocates what the crafted file asks for, never in wrong data."""

from __future__ import annotations

import io
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

import parallel_dcp
from parallel_dcp import (
    CorruptCheckpointError,
    InvalidStateDictError,
    MemoryLimitExceeded,
    ParallelDCPError,
    cli,
)
from parallel_dcp.storage import geometry
from tests.conftest import assert_same

pytestmark = pytest.mark.timeout(120)


def _state() -> dict[str, Any]:
    return {
        "w": torch.arange(64.0).reshape(8, 8),
        "v": torch.arange(8, dtype=torch.int32),
        "n": {"x": torch.ones(3), "l": [torch.zeros(2), torch.full((2,), 2.0)]},
        "step": 5,
    }


@pytest.fixture
def chunked(tmp_path: Path) -> Path:
    """A checkpoint whose [8, 8] tensor "w" is stored as four chunks of two rows."""
    ckpt = tmp_path / "ckpt"
    parallel_dcp.save(_state(), ckpt, workers=2, chunk_size=64)
    assert len(_metadata(ckpt).state_dict_metadata["w"].chunks) == 4  # type: ignore[union-attr]
    return ckpt


def _metadata(ckpt: Path) -> Metadata:
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    assert isinstance(metadata, Metadata)
    return metadata


def _rewrite(ckpt: Path, change: Any) -> None:
    metadata = _metadata(ckpt)
    change(metadata)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def _stock_load(ckpt: Path, state: dict[str, Any], **reader: Any) -> None:
    """Stock ``dcp.load`` through FastReader; the error our reader raised, unwrapped from the
    ``CheckpointException`` stock wraps every error in."""
    try:
        dcp.load(state, storage_reader=parallel_dcp.FastReader(ckpt, workers=2, **reader), no_dist=True)
    except CheckpointException as exc:
        (failure,) = exc.failures.values()
        raise failure[0] if isinstance(failure, tuple) else failure from None


def _readers(ckpt: Path, out: Path) -> list[Any]:
    return [
        lambda: parallel_dcp.load(ckpt, workers=2),
        lambda: parallel_dcp.load(ckpt, workers=2, retries=1),
        lambda: parallel_dcp.convert(ckpt, out / "out.safetensors", workers=1),
        lambda: parallel_dcp.FastReader(ckpt).read_metadata(),  # what stock dcp.load calls first
    ]


# --- item 4: chunks that overlap and leave a hole ----------------------------------------------


def _shift_chunk(metadata: Metadata, old: tuple[int, int], new: tuple[int, int]) -> None:
    meta = metadata.state_dict_metadata["w"]
    for chunk in meta.chunks:  # type: ignore[union-attr]
        if tuple(chunk.offsets) == old:
            chunk.offsets = torch.Size(new)
    storage = metadata.storage_data
    info = storage.pop(MetadataIndex("w", torch.Size(old)))
    storage[MetadataIndex("w", torch.Size(new))] = info


def test_overlapping_chunks_that_leave_a_hole_are_refused(chunked: Path, tmp_path: Path) -> None:
    # rows 6-7 moved to rows 5-6: same element count, row 5 twice, row 7 in no chunk
    _rewrite(chunked, lambda m: _shift_chunk(m, (6, 0), (5, 0)))
    for read in _readers(chunked, tmp_path):
        with pytest.raises(CorruptCheckpointError, match=r"'w' has overlapping chunks"):
            read()
    assert not (tmp_path / "out.safetensors").exists()


def test_a_chunk_missing_is_a_hole_and_refused(chunked: Path) -> None:
    def drop(metadata: Metadata) -> None:
        meta = metadata.state_dict_metadata["w"]
        meta.chunks = meta.chunks[:3]  # type: ignore[union-attr]

    _rewrite(chunked, drop)
    with pytest.raises(CorruptCheckpointError, match=r"leave part of it in no chunk"):
        parallel_dcp.load(chunked, workers=1)


def test_the_untouched_chunked_checkpoint_loads(chunked: Path) -> None:
    assert_same(parallel_dcp.load(chunked, workers=2), _state())


# --- item 3: two keys (or two chunks) on one record -------------------------------------------


def _point(metadata: Metadata, victim: MetadataIndex, source: MetadataIndex) -> None:
    metadata.storage_data[victim] = metadata.storage_data[source]


@pytest.mark.parametrize(
    "victim",
    [
        pytest.param(MetadataIndex("v", torch.Size([0])), id="int32-reads-float-bits"),
        pytest.param(MetadataIndex("w", torch.Size([2, 0])), id="two-chunks-one-record"),
    ],
)
def test_two_entries_on_one_record_are_refused(chunked: Path, tmp_path: Path, victim: MetadataIndex) -> None:
    _rewrite(chunked, lambda m: _point(m, victim, MetadataIndex("n.x", torch.Size([0]))))
    for read in _readers(chunked, tmp_path):
        with pytest.raises(CorruptCheckpointError, match=r"share bytes of"):
            read()


def test_a_longer_shape_on_another_keys_record_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp.save({"a": torch.randn(4), "b": torch.randn(64)}, checkpoint_id=str(ckpt), no_dist=True)
    _rewrite(ckpt, lambda m: _point(m, MetadataIndex("b", torch.Size([0])), MetadataIndex("a", torch.Size([0]))))
    for read in _readers(ckpt, tmp_path)[:3]:
        with pytest.raises(CorruptCheckpointError):
            read()


def test_records_overlapping_without_sharing_an_offset_are_refused(chunked: Path) -> None:
    def overlap(metadata: Metadata) -> None:
        info = metadata.storage_data[MetadataIndex("v", torch.Size([0]))]
        info.offset += 1  # now it starts inside the record that follows it

    _rewrite(chunked, overlap)
    with pytest.raises(CorruptCheckpointError, match=r"share bytes"):
        parallel_dcp.load(chunked, workers=1)


def test_every_key_is_checked_against_its_own_record_even_past_the_metadata_check(
    chunked: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The readers' own check (formats/read_units.py, formats/fast_read.py) holds without
    the records' overlap check: the second key on a record is compared with the record too."""
    _rewrite(chunked, lambda m: _point(m, MetadataIndex("v", torch.Size([0])), MetadataIndex("n.x", torch.Size([0]))))
    monkeypatch.setattr("parallel_dcp.storage.metadata_check._check_records", lambda *args: None)
    with pytest.raises(CorruptCheckpointError, match=r"one record|holds float32"):
        parallel_dcp.load(chunked, workers=2)
    with pytest.raises(CorruptCheckpointError, match=r"one record|holds float32"):
        _stock_load(chunked, {"v": torch.zeros(8, dtype=torch.int32), "n.x": torch.zeros(3)})


def test_two_keys_on_one_compressed_record_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("zstandard")
    ckpt = tmp_path / "ckpt"
    parallel_dcp.save(
        {"a": torch.randn(16), "b": torch.arange(16, dtype=torch.int32)}, ckpt, workers=1, compress="zstd"
    )
    _rewrite(ckpt, lambda m: _point(m, MetadataIndex("b", torch.Size([0])), MetadataIndex("a", torch.Size([0]))))
    with pytest.raises(CorruptCheckpointError, match=r"share bytes"):
        parallel_dcp.load(ckpt, workers=1)
    # and past the metadata check, the compressed read path refuses it too (never a silent cast)
    monkeypatch.setattr("parallel_dcp.storage.metadata_check._check_records", lambda *args: None)
    with pytest.raises(CorruptCheckpointError, match=r"one record|holds float32"):
        parallel_dcp.load(ckpt, workers=1)
    # DCP's reader path (BoundedReader), in a worker: its CorruptCheckpointError, as the pool reports it
    with pytest.raises(ParallelDCPError, match=r"CorruptCheckpointError.*(one record|holds float32)"):
        parallel_dcp.convert(ckpt, tmp_path / "out.safetensors", workers=1)


# --- item 5: planner_data ---------------------------------------------------------------------

PLANNER_DATA = {
    "huge-index": ({"w": ("w", 10**8)}, r"list indices need"),
    "two-keys-one-path": ({"w": ("w",), "v": ("w",)}, r"the same path"),
    "none-in-path": ({"w": ("w", None)}, r"a path with None"),
    "negative-index": ({"w": ("w", -1)}, r"a path with -1"),
    "int-first": ({"w": (0,)}, r"a path with 0 at depth 0"),
    "value-and-level": ({"w": ("a",), "v": ("a", "b")}, r"has a level of the nesting"),
    "dict-and-list": ({"w": ("a", 0), "v": ("a", "b")}, r"both a dict and a list"),
    "empty-path": ({"w": ()}, r"impossible path"),
    "too-deep": ({"w": ("w",) * 100}, r"impossible path"),
    "not-a-mapping": (["w"], r"not a mapping"),
    "key-missing": ({"w": ("w",)}, r"no path for key 'v'"),
}


@pytest.mark.parametrize("case", list(PLANNER_DATA))
def test_impossible_planner_data_is_refused_before_anything_is_built(case: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(4), "v": torch.zeros(2)}, checkpoint_id=str(ckpt), no_dist=True)
    planner_data, pattern = PLANNER_DATA[case]
    if isinstance(planner_data, dict) and case != "key-missing":
        planner_data = {"w": ("w",), "v": ("v",)} | planner_data
    _rewrite(ckpt, lambda m: setattr(m, "planner_data", planner_data))
    assert (ckpt / ".metadata").stat().st_size < 2048
    for read in (
        lambda: parallel_dcp.load(ckpt, workers=1, memory_limit="64MiB"),
        lambda: parallel_dcp.load(ckpt, workers=1, retries=1),
        lambda: parallel_dcp.convert(ckpt, tmp_path / "out.pt", workers=1),
        lambda: parallel_dcp.inspect(ckpt),
    ):
        with pytest.raises(CorruptCheckpointError, match=pattern):
            read()


def test_real_nesting_with_lists_passes(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    state = {"opt": {"groups": [{"lr": torch.tensor(0.1)}, {"lr": torch.tensor(0.2)}]}, "l": [torch.ones(2)] * 3}
    dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
    assert_same(parallel_dcp.load(ckpt, workers=1), state)


# --- item 6: .metadata admitted by size ---------------------------------------------------------


def test_metadata_padded_to_a_gigabyte_is_refused_before_reading(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(ckpt), no_dist=True)
    with open(ckpt / ".metadata", "r+b") as f:  # a valid pickle, then 1 GiB of sparse zeros
        f.truncate(f.seek(0, 2) + 2**30)
    with pytest.raises(MemoryLimitExceeded, match=r"\.metadata has 1\.0 GiB.*nothing of it was read") as caught:
        parallel_dcp.load(ckpt, workers=1, memory_limit="64MiB")
    assert caught.value.limit == 64 * 2**20


def test_bytes_after_the_metadata_pickle_are_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(ckpt), no_dist=True)
    with open(ckpt / ".metadata", "ab") as f:
        f.write(b"\0" * 100)
    with pytest.raises(CorruptCheckpointError, match=r"bytes after its pickle"):
        parallel_dcp.load(ckpt, workers=1)


# --- item 7: a value record of 1 GiB -----------------------------------------------------------


@pytest.mark.parametrize("retries", [0, 1], ids=["threads", "processes"])
def test_a_huge_value_record_is_refused_by_the_budget_before_reading(tmp_path: Path, retries: int) -> None:
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(4), "blob": b"x" * 100}, checkpoint_id=str(ckpt), no_dist=True)

    def grow(metadata: Metadata) -> None:
        info = metadata.storage_data[MetadataIndex("blob")]
        shard = ckpt / info.relative_path
        info.offset, info.length = shard.stat().st_size, 2**30
        with open(shard, "r+b") as f:  # a sparse shard: the size check passes
            f.truncate(info.offset + info.length)

    _rewrite(ckpt, grow)
    with pytest.raises(MemoryLimitExceeded, match=r"'blob' needs 2\.0 GiB"):
        parallel_dcp.load(ckpt, workers=1, memory_limit="64MiB", retries=retries)
    if not retries:  # stock dcp.load through FastReader, given a limit
        with pytest.raises(MemoryLimitExceeded, match=r"'blob' needs 2\.0 GiB"):
            _stock_load(ckpt, {"w": torch.zeros(4), "blob": b""}, memory_limit="64MiB")


# --- item 16: into= targets load cannot fill -----------------------------------------------------


INTO = {
    "meta-device": (lambda: torch.empty(4, 4, device="meta"), r"meta device"),
    "expanded": (lambda: torch.zeros(1, 4).expand(4, 4), r"share memory"),
    "unfolded": (lambda: torch.zeros(10).unfold(0, 4, 2)[:4], r"share memory"),
    "non-contiguous-parameter": (lambda: torch.nn.Parameter(torch.zeros(4, 4).t()), r"requires grad"),
}


@pytest.mark.parametrize("case", list(INTO))
def test_targets_that_cannot_be_filled_are_refused_before_reading(case: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    parallel_dcp.save({"w": torch.randn(4, 4)}, ckpt, workers=1)
    make, pattern = INTO[case]
    target = make()
    with pytest.raises(InvalidStateDictError, match=pattern):
        parallel_dcp.load(ckpt, workers=1, into={"w": target})


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_parameters_and_strided_targets_that_can_be_filled_are(tmp_path: Path, compress: str | None) -> None:
    if compress:
        pytest.importorskip("zstandard")
    ckpt = tmp_path / "ckpt"
    state = {"p": torch.randn(8, 8), "t": torch.randn(6, 4)}
    parallel_dcp.save(state, ckpt, workers=2, chunk_size=64, compress=compress)
    into = {"p": torch.nn.Parameter(torch.zeros(8, 8)), "t": torch.zeros(4, 6).t()}
    parallel_dcp.load(ckpt, workers=2, into=into)
    assert torch.equal(into["p"].detach(), state["p"]) and torch.equal(into["t"], state["t"])


# --- item 17: a crafted data.pkl; size flags ------------------------------------------------------


def _data_pkl(record: bytes) -> tuple[int, int]:
    """(start, length) of a torch.save record's data.pkl (its first entry, stored)."""
    fields = struct.unpack_from("<4sHHHHHIIIHH", record, 0)
    assert fields[0] == b"PK\x03\x04" and fields[3] == 0
    start = 30 + fields[9] + fields[10]
    end = record.index(b"PK", start)  # the next header (data.pkl is followed by a data descriptor or entry)
    return start, end - start


class _StorageRef:
    """Pickled as torch pickles a storage reference."""


def _crafted_pickle(size: tuple[int, ...], storage_offset: int, tail: bytes = b"") -> bytes:
    buffer = io.BytesIO()

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            if isinstance(obj, _StorageRef):
                return ("storage", torch.FloatStorage, "0", "cpu", 4)
            return None

    class Rebuild:
        def __reduce__(self) -> tuple[Any, ...]:
            from collections import OrderedDict

            return (torch._utils._rebuild_tensor_v2, (_StorageRef(), storage_offset, size, (1,), False, OrderedDict()))

    pickler = Pickler(buffer, protocol=2)
    pickler.fast = True  # no memo: as short as torch's own data.pkl
    pickler.dump(Rebuild())
    data = buffer.getvalue()
    return data[:-1] + tail + b"." if tail else data


CRAFTED = {
    # BUILD {"a": 1} on the rebuilt tensor: our parser's stand-in has no __dict__ (AttributeError)
    "attribute-error": lambda: _crafted_pickle((4,), 0, tail=b"}X\x01\x00\x00\x00aK\x01sb"),
    # an offset no C long holds (OverflowError in torch's rebuild)
    "overflow-error": lambda: _crafted_pickle((4,), 2**70),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_data_pkl_is_a_corrupt_checkpoint_everywhere(case: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(ckpt), no_dist=True)
    info = next(iter(_metadata(ckpt).storage_data.values()))
    shard = ckpt / info.relative_path
    data = bytearray(shard.read_bytes())
    record = bytes(data[info.offset : info.offset + info.length])
    start, length = _data_pkl(record)
    crafted = CRAFTED[case]()
    assert len(crafted) <= length, "the crafted pickle must fit where data.pkl was"
    at = info.offset + start
    data[at : at + length] = crafted + b"\0" * (length - len(crafted))  # unpickling stops at STOP
    shard.write_bytes(bytes(data))

    for read in (
        lambda: parallel_dcp.load(ckpt, workers=1),
        lambda: parallel_dcp.load(ckpt, workers=1, into={"w": torch.zeros(4)}),
        lambda: _stock_load(ckpt, {"w": torch.zeros(4)}),
    ):
        with pytest.raises(CorruptCheckpointError):
            read()
    # the process path: the worker's CorruptCheckpointError, as the pool reports worker errors
    with pytest.raises(ParallelDCPError, match="CorruptCheckpointError"):
        parallel_dcp.load(ckpt, workers=1, retries=1)


@pytest.mark.parametrize(("flag", "name"), [("--shard-size", "the shard size"), ("--chunk-size", "the chunk size")])
def test_a_zero_size_flag_names_the_flag(
    flag: str, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["convert", str(tmp_path / "a"), str(tmp_path / "b"), flag, "0"])
    err = capsys.readouterr().err
    assert f"argument {flag}: {name} must be positive" in err and "memory limit" not in err
    with pytest.raises(ValueError, match=r"(shard|chunk)_size must be positive"):
        parallel_dcp.convert(tmp_path / "a", tmp_path / "b", **{flag[2:].replace("-", "_"): 0})


# --- the geometry checks' own bounds -------------------------------------------------------------


def _chunks(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[ChunkStorageMetadata]:
    return [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]


def test_a_grid_and_an_irregular_tiling_pass_and_a_hostile_layout_is_bounded() -> None:
    grid = [((r, c), (2, 3)) for r in range(0, 8, 2) for c in range(0, 9, 3)]
    geometry.check_chunks("g", (8, 9), _chunks(grid), "m")
    # an irregular (pinwheel) tiling of a 3x3 square: only the pairwise test proves it
    pinwheel = [((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 0), (1, 2)), ((1, 1), (1, 1))]
    geometry.check_chunks("p", (3, 3), _chunks(pinwheel), "m")
    # ~100,000 one-element chunks in an irregular pattern: refused as too costly, not trusted
    many = [((i, 0), (1, 1)) for i in range(50_000)] + [((i, 1), (1, 1)) for i in range(50_000)]
    many[0] = ((0, 0), (1, 2))
    del many[50_000]
    with pytest.raises(ParallelDCPError, match="too irregular"):
        geometry.check_chunks("m", (50_000, 2), _chunks(many), "m", geometry.PairBudget())


# --- item 9: a done record re-sealed with two units' offsets swapped ------------------------------


def test_a_resealed_record_with_swapped_offsets_is_redone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_resume import _fail_midway, _read_output, _source, _tamper_record

    src, sd = _source(tmp_path)
    out = tmp_path / "out"
    _fail_midway(monkeypatch, src, out, "dcp")

    def swap(record: dict[str, Any]) -> None:
        first, second = record["part"][0], record["part"][1]
        assert first[2] == second[2], "two same-shaped units: records of one length"
        first[1], second[1] = second[1], first[1]

    _tamper_record(out, swap)
    result = parallel_dcp.convert(src, out, workers=2, resume=True)
    assert result.resumed
    untouched = parallel_dcp.convert(src, tmp_path / "fresh", workers=4)
    assert 0 < result.bytes_kept < untouched.bytes / 2, "only task 1 is kept; task 0 is redone"
    assert_same(_read_output(out, "dcp", sd), sd)
    assert parallel_dcp.verify(out, workers=1).ok
