"""The columnar side index (storage/side_index.py): written by our DCP writers beside ``.metadata``,
read by ``load(into=)`` in place of unpickling it, and never changing what is loaded."""

from __future__ import annotations

import json
import os
import pickle
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.filesystem import FileSystemWriter

import parallel_dcp
from parallel_dcp.errors import CorruptCheckpointError, InvalidStateDictError, KeyNotFoundError
from parallel_dcp.storage import local_staging, side_index
from parallel_dcp.storage.metadata import read_index_or_metadata, read_metadata
from parallel_dcp.storage.ownership import find_leftovers, owner_name
from parallel_dcp.storage.safe_reader import open_bounded
from parallel_dcp.storage.side_index import HEADER, INDEX_FILE
from parallel_dcp.storage.side_index_read import INDEX_MEMORY_FACTOR, parse_index, read_index

_SAVE_ID = "0123456789ab"


def _state() -> dict[str, Any]:
    """Every kind of entry the index describes: tensors of several dtypes and ranks (a scalar, a
    zero-size one, one that requires grad), pickled values, nesting."""
    g = torch.Generator().manual_seed(3)
    return {
        "model": {
            "w": torch.randn(3, 4, generator=g),
            "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "p": torch.nn.Parameter(torch.randn(2, 2, generator=g)),
            "empty": torch.zeros(0, 3),
            "mask": torch.rand(7, generator=g) > 0.5,
            "step": torch.tensor(11, dtype=torch.int64),
            "h": torch.randn(2, 3, 4, generator=g).to(torch.float16),
        },
        "optimizer": {
            "state": {
                str(i): {"exp_avg": torch.randn(6, generator=g), "step": torch.tensor(float(i))} for i in range(40)
            },
            "param_groups": [{"lr": 0.1, "name": "all", "params": list(range(40))}],
        },
        "epoch": 4,
        "note": "text",
    }


def _empty_like(state: Any) -> Any:
    if isinstance(state, torch.nn.Parameter):
        return torch.nn.Parameter(torch.empty_like(state), requires_grad=state.requires_grad)
    if isinstance(state, torch.Tensor):
        return torch.full_like(state, 7) if state.dtype != torch.bool else torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _empty_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_empty_like(v) for v in state]
    return None if not isinstance(state, (int, float, str)) else type(state)()


def _same(a: Any, b: Any) -> None:
    """Equal bit for bit (tensors: dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert a.detach().reshape(-1).view(torch.uint8).equal(b.detach().reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


def _loaded(path: Path, state: Any, **kwargs: Any) -> Any:
    into = _empty_like(state)
    return parallel_dcp.load(path, into=into, workers=2, **kwargs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("side") / "ckpt"
    parallel_dcp.save(_state(), path, workers=2)
    return path


def _copy(saved: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ckpt"
    out.mkdir()
    for p in saved.iterdir():
        (out / p.name).write_bytes(p.read_bytes())
    return out


def test_the_index_describes_exactly_what_metadata_says(saved: Path) -> None:
    assert (saved / INDEX_FILE).is_file()
    metadata = read_metadata(saved)
    found, columns, index = read_index_or_metadata(saved)
    assert found is None and index is not None
    described = index.metadata_for(list(index.names))
    assert list(described.state_dict_metadata) == list(metadata.state_dict_metadata)
    assert described.state_dict_metadata == metadata.state_dict_metadata
    assert described.storage_data == metadata.storage_data
    # the columns a load reads are those the .metadata check finds
    _, from_metadata, none = read_index_or_metadata(_without_index(saved))
    assert none is None
    assert columns.tensors == from_metadata.tensors
    assert [r[:4] for r in columns.records] == [r[:4] for r in from_metadata.records]


def _without_index(saved: Path) -> Path:
    out = saved.parent / "no-index"
    if not out.exists():
        out.mkdir()
        for p in saved.iterdir():
            if p.name != INDEX_FILE:
                (out / p.name).write_bytes(p.read_bytes())
    return out


def test_index_loaded_equals_metadata_loaded_equals_stock(saved: Path) -> None:
    state = _state()
    by_index = _loaded(saved, state)
    by_metadata = _loaded(_without_index(saved), state)
    stock = _empty_like(state)
    dcp.load(stock, checkpoint_id=str(saved), no_dist=True)
    _same(by_index, state)
    _same(by_metadata, by_index)
    _same(stock["model"], by_index["model"])
    _same(stock["optimizer"]["state"], by_index["optimizer"]["state"])
    # a subset of the keys
    subset = _loaded(saved, state, keys=["model.w", "epoch"])
    _same(subset["model"]["w"], state["model"]["w"])
    assert subset["epoch"] == 4 and torch.all(subset["model"]["b"] == 7)


def _error(call: Callable[[], Any]) -> str:
    with pytest.raises((KeyNotFoundError, InvalidStateDictError)) as caught:
        call()
    return f"{type(caught.value).__name__}: {caught.value}"


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda into: into["model"].update(extra=torch.zeros(2)), id="a key not in the checkpoint"),
        pytest.param(lambda into: into["model"].update(w=torch.zeros(4, 3)), id="wrong shape"),
        pytest.param(lambda into: into["model"].update(w=torch.zeros(3, 4, dtype=torch.float64)), id="wrong dtype"),
        pytest.param(lambda into: into["model"].update(w=[1, 2]), id="not a tensor"),
        pytest.param(lambda into: into["model"].update(h=torch.zeros(4, 3, 2).transpose(0, 2)), id="not dense"),
    ],
)
def test_into_errors_are_the_same_with_the_index(saved: Path, change: Callable[[Any], None]) -> None:
    def attempt(path: Path) -> Callable[[], Any]:
        into = _empty_like(_state())
        change(into)
        return lambda: parallel_dcp.load(path, into=into, workers=2)

    plain = _without_index(saved)
    assert _error(attempt(saved)).replace(str(saved), "X") == _error(attempt(plain)).replace(str(plain), "X")


def test_a_non_dense_target_that_fits_loads_the_same(saved: Path, tmp_path: Path) -> None:
    """A transposed target of the right shape is filled through the general path, from the index's entries."""
    state = _state()
    into = _empty_like(state)
    into["model"]["w"] = torch.zeros(4, 3).t()
    parallel_dcp.load(saved, into=into, workers=2)
    _same(into["model"]["w"].contiguous(), state["model"]["w"])


def test_stock_rewriting_the_checkpoint_makes_the_index_unused(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    other = _state()
    other["model"]["w"] = torch.arange(12.0).view(3, 4)
    dcp.save(other, storage_writer=FileSystemWriter(str(path), thread_count=2), no_dist=True)
    assert (path / INDEX_FILE).is_file()  # stock leaves it, stale
    found, _, index = read_index_or_metadata(path)
    assert index is None and found is not None
    _same(_loaded(path, other)["model"], other["model"])


def test_what_cannot_be_described_gets_no_index(tmp_path: Path) -> None:
    """Split tensors (chunks from several tasks) and compressed records: no index; loads as before."""
    state = {"big": torch.randn(4099, 96), "small": torch.randn(3)}
    parallel_dcp.save(state, tmp_path / "chunks", workers=2, chunk_size=200_000)
    assert not (tmp_path / "chunks" / INDEX_FILE).exists()
    _same(_loaded(tmp_path / "chunks", state), state)
    parallel_dcp.save(state, tmp_path / "zstd", workers=2, compress="zstd")
    assert not (tmp_path / "zstd" / INDEX_FILE).exists()
    _same(_loaded(tmp_path / "zstd", state), state)


def test_the_saver_and_convert_write_it(tmp_path: Path) -> None:
    state = _state()
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(state, tmp_path / "saver")
    assert read_index_or_metadata(tmp_path / "saver")[2] is not None
    _same(_loaded(tmp_path / "saver", state), state)
    from safetensors.torch import save_file

    tensors = {"a": torch.randn(4, 4), "b": torch.arange(6, dtype=torch.int32)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    parallel_dcp.convert(tmp_path / "model.safetensors", tmp_path / "dcp", workers=2)
    _, _, index = read_index_or_metadata(tmp_path / "dcp")
    assert index is not None
    metadata = read_metadata(tmp_path / "dcp")
    assert index.metadata_for(list(index.names)).storage_data == metadata.storage_data
    _same(_loaded(tmp_path / "dcp", tensors), tensors)


def test_the_index_is_renamed_in_before_metadata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    real = local_staging.rename_name

    def recording(directory: int, source: str, target: str, *, replace: bool) -> None:
        order.append(target)
        real(directory, source, target, replace=replace)

    monkeypatch.setattr(local_staging, "rename_name", recording)
    parallel_dcp.save({"w": torch.ones(3)}, tmp_path / "ckpt", workers=1)
    assert order.index(INDEX_FILE) < order.index(".metadata") < order.index(".parallel_dcp.json")


def test_a_save_stopped_before_metadata_leaves_no_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = local_staging.rename_name

    def failing(directory: int, source: str, target: str, *, replace: bool) -> None:
        if target == ".metadata":
            raise OSError(5, "the disk went away")
        real(directory, source, target, replace=replace)

    monkeypatch.setattr(local_staging, "rename_name", failing)
    with pytest.raises(OSError, match="disk went away"):
        parallel_dcp.save({"w": torch.ones(3)}, tmp_path / "ckpt", workers=1)
    monkeypatch.undo()
    assert not (tmp_path / "ckpt" / INDEX_FILE).exists()
    parallel_dcp.save({"w": torch.ones(3)}, tmp_path / "ckpt", workers=1)  # nothing in the way


def test_an_index_left_by_a_killed_save_is_its_leftover(saved: Path, tmp_path: Path) -> None:
    """A save killed between the index's rename and .metadata's: the index is that save's, and
    the next save to the directory removes it with the rest."""
    out = tmp_path / "ckpt"
    out.mkdir()
    data = bytearray((saved / INDEX_FILE).read_bytes())
    assert HEADER.unpack_from(data)[10] == len(_SAVE_ID)
    data[-len(_SAVE_ID) :] = _SAVE_ID.encode()
    (out / INDEX_FILE).write_bytes(bytes(data))
    (out / owner_name(_SAVE_ID)).write_text(json.dumps({"save_id": _SAVE_ID, "host": "elsewhere", "pid": 1}))
    (out / owner_name("ba9876543210")).write_text(json.dumps({"save_id": "ba9876543210", "host": "x", "pid": 1}))
    files = {left["save_id"]: left["files"] for left in find_leftovers(out)}
    assert INDEX_FILE in files[_SAVE_ID] and INDEX_FILE not in files["ba9876543210"]


def test_the_index_joins_runs_of_every_column_kind_in_order() -> None:
    """Each run's columns reach the coordinator as arrays, raw bytes, views, pickle buffers, or
    (from another rank) big-endian or strided arrays; the file's sections are their values joined
    in the runs' order, little-endian, each run's keys pointing at its own file."""
    rng = numpy.random.default_rng(3)
    kinds: list[Callable[[Any], Any]] = [
        lambda a: a,
        lambda a: a.tobytes(),
        lambda a: memoryview(a.tobytes()),
        lambda a: pickle.PickleBuffer(a.tobytes()),
        lambda a: a.astype(">i8"),
        lambda a: numpy.repeat(a, 2)[::2],
    ]
    pieces, expected = [], {"offset": [], "length": [], "dims": [], "file": [], "ndim": [], "names": b""}
    for run in range(30):
        count = int(rng.integers(0, 4))
        ndim = rng.integers(0, 3, count).astype(numpy.uint8)
        dims, offsets, lengths = (rng.integers(0, 1 << 50, n) for n in (int(ndim.sum()), count, count))
        names = b"".join(f"run{run}.key{i}".encode() + b"\0" for i in range(count))
        wrap = kinds[run % len(kinds)]
        column = bytes(count)
        pieces.append(
            (
                f"__{run % 3}_0.distcp",
                (names, column, column, column, ndim.tobytes(), *map(wrap, (dims, offsets, lengths))),
            )
        )
        for name, values in (
            ("dims", dims),
            ("offset", offsets),
            ("length", lengths),
            ("ndim", ndim),
            ("file", [run % 3] * count),
        ):
            expected[name] += list(values)
        expected["names"] += names
    data = bytearray(side_index.index_for(pieces, 7, 9, _SAVE_ID))
    for name in ("offset", "length", "dims", "file", "ndim"):
        assert _column(data, name).tolist() == [int(v) for v in expected[name]], name
    start, end, _ = _sections(bytes(data))["names"]
    assert bytes(data[start:end]) == expected["names"]
    start, end, _ = _sections(bytes(data))["file_names"]
    assert bytes(data[start:end]) == b"__0_0.distcp\0__1_0.distcp\0__2_0.distcp\0"
    assert HEADER.unpack_from(data)[11] == xxhash.xxh3_64_intdigest(bytes(data[HEADER.size :]))


# --- crafted indexes: each an error or a fallback, never a wrong load ---------------------------


def _sections(data: bytes) -> dict[str, tuple[int, int, Any]]:
    head = HEADER.unpack_from(data)
    keys, _, dims, names, files, tag = head[5:11]
    layout = [
        ("offset", keys, "<i8"),
        ("length", keys, "<i8"),
        ("dims", dims, "<i8"),
        ("file", keys, "<u4"),
        ("kind", keys, "u1"),
        ("dtype", keys, "u1"),
        ("flags", keys, "u1"),
        ("ndim", keys, "u1"),
        ("file_names", files, "u1"),
        ("names", names, "u1"),
        ("tag", tag, "u1"),
    ]
    out: dict[str, tuple[int, int, Any]] = {}
    at = HEADER.size
    for name, count, dtype in layout:
        size = count * numpy.dtype(dtype).itemsize
        out[name] = (at, at + size, dtype)
        at += size
    return out


def _column(data: bytearray, name: str) -> Any:
    start, end, dtype = _sections(bytes(data))[name]
    return numpy.frombuffer(data, dtype=dtype, count=(end - start) // numpy.dtype(dtype).itemsize, offset=start)


def _set_header(data: bytearray, field: int, value: int) -> None:
    head = list(HEADER.unpack_from(data))
    head[field] = value
    data[: HEADER.size] = HEADER.pack(*head)


def _splice(data: bytearray, name: str, new: bytes, field: int) -> bytearray:
    start, end, _ = _sections(bytes(data))[name]
    out = bytearray(data[:start] + new + data[end:])
    _set_header(out, field, len(new))
    return out


def _sealed(data: bytearray) -> bytearray:
    """``data`` with its body's hash made right again: what a hostile writer does."""
    _set_header(data, 11, xxhash.xxh3_64_intdigest(bytes(data[HEADER.size :])))
    return data


def _tensor_row(data: bytearray) -> int:
    return int(numpy.flatnonzero(_column(data, "kind") == 0)[0])


def _offset_past_end(data: bytearray) -> bytearray:
    _column(data, "offset")[_tensor_row(data)] = 10**12
    return data


def _length_overflow(data: bytearray) -> bytearray:
    _column(data, "length")[_tensor_row(data)] = 2**62
    return data


def _too_short(data: bytearray) -> bytearray:
    _column(data, "length")[_tensor_row(data)] = 1
    return data


def _shared_record(data: bytearray) -> bytearray:
    offset, file = _column(data, "offset"), _column(data, "file")
    rows = numpy.flatnonzero(file == file[0])
    offset[rows[1]] = offset[rows[0]]
    return data


def _file_name(name: bytes) -> Callable[[bytearray], bytearray]:
    def craft(data: bytearray) -> bytearray:
        start, end, _ = _sections(bytes(data))["file_names"]
        names = bytes(data[start:end]).split(b"\0")[:-1]
        return _splice(data, "file_names", b"".join(n + b"\0" for n in [name, *names[1:]]), 9)

    return craft


def _unknown_dtype(data: bytearray) -> bytearray:
    _column(data, "dtype")[_tensor_row(data)] = 250
    return data


def _value_with_a_shape(data: bytearray) -> bytearray:
    _column(data, "kind")[_tensor_row(data)] = 1
    return data


def _twice(data: bytearray) -> bytearray:
    start, end, _ = _sections(bytes(data))["names"]
    names = bytes(data[start:end]).split(b"\0")[:-1]
    names[1] = names[0]
    return _splice(data, "names", b"".join(n + b"\0" for n in names), 8)


def _truncated(data: bytearray) -> bytearray:
    return data[:-7]


def _wrong_hash(data: bytearray) -> bytearray:
    _set_header(data, 4, HEADER.unpack_from(data)[4] ^ 1)
    return data


def _huge_count(data: bytearray) -> bytearray:
    _set_header(data, 5, 2**60)
    return data


def _old_version(data: bytearray) -> bytearray:
    _set_header(data, 1, 99)
    return data


def _garbage(data: bytearray) -> bytearray:
    return bytearray(os.urandom(len(data)))


def _swapped(data: bytearray) -> bytearray:
    """Damage no check over the columns can see: two records of one shape swapped between their
    keys (each still whole, in range, unshared). Without the body's hash it would load each key
    with the other's values; with it, .metadata is read."""
    start, end, _ = _sections(bytes(data))["names"]
    names = bytes(data[start:end]).split(b"\0")[:-1]
    first, second = [n for n, name in enumerate(names) if name.endswith(b".exp_avg")][:2]
    offset, length = _column(data, "offset"), _column(data, "length")
    offset[[first, second]] = offset[[second, first]]
    length[[first, second]] = length[[second, first]]
    return data


CHECKED = [  # the hash matches: the checks over the columns refuse it (and the load reads .metadata)
    _length_overflow,
    _too_short,
    _shared_record,
    _file_name(b"../escape.distcp"),
    _file_name(b"sub/dir.distcp"),
    _unknown_dtype,
    _value_with_a_shape,
    _twice,
]
UNREAD = [_truncated, _wrong_hash, _huge_count, _old_version, _garbage, _swapped]  # .metadata is read


@pytest.mark.parametrize("craft", CHECKED + UNREAD, ids=lambda f: f.__qualname__.split(".")[0].strip("_"))
def test_a_crafted_index_is_refused_and_metadata_read(
    saved: Path, tmp_path: Path, craft: Callable[[bytearray], bytearray]
) -> None:
    path = _copy(saved, tmp_path)
    data = craft(bytearray((saved / INDEX_FILE).read_bytes()))
    if craft in CHECKED:
        data = _sealed(data)
    (path / INDEX_FILE).write_bytes(bytes(data))
    if craft in CHECKED:
        with pytest.raises(CorruptCheckpointError):
            parse_index(HEADER.unpack_from(data), bytes(data[HEADER.size :]), path / INDEX_FILE)
    found, _, index = read_index_or_metadata(path)
    assert index is None and found is not None
    _same(_loaded(path, _state()), _state())


def test_a_crafted_index_pointing_past_a_shard_is_an_error(saved: Path, tmp_path: Path) -> None:
    """Offsets in range but past the file: the shard sizes are checked before anything is read."""
    path = _copy(saved, tmp_path)
    (path / INDEX_FILE).write_bytes(bytes(_sealed(_offset_past_end(bytearray((saved / INDEX_FILE).read_bytes())))))
    with pytest.raises(CorruptCheckpointError, match=r"truncated|has .* bytes"):
        _loaded(path, _state())


def test_a_planted_symlink_or_fifo_is_never_followed(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    (path / INDEX_FILE).rename(tmp_path / "elsewhere")
    (path / INDEX_FILE).symlink_to(tmp_path / "elsewhere")
    assert read_index_or_metadata(path)[2] is None
    _same(_loaded(path, _state()), _state())
    (path / INDEX_FILE).unlink()
    os.mkfifo(path / INDEX_FILE)
    assert read_index_or_metadata(path)[2] is None  # (a FIFO opened blocking would hang here)


def test_an_index_over_the_memory_limit_is_not_read(saved: Path) -> None:
    """Budgeted like .metadata: its size times INDEX_MEMORY_FACTOR must fit under the limit."""
    size = (saved / INDEX_FILE).stat().st_size
    assert size < (saved / ".metadata").stat().st_size  # (and .metadata's own budget is larger)
    with open_bounded(saved / ".metadata") as stream:
        metadata_size = stream.raw.size  # type: ignore[attr-defined]
        assert read_index(saved, stream, metadata_size, size * INDEX_MEMORY_FACTOR) is not None
        assert read_index(saved, stream, metadata_size, size * INDEX_MEMORY_FACTOR - 1) is None
        assert stream.tell() == 0  # rewound for the unpickler


def test_the_header_is_little_endian_and_versioned(saved: Path) -> None:
    data = (saved / INDEX_FILE).read_bytes()
    assert data[:8] == b"PDCPCOL1" and struct.unpack_from("<I", data, 8)[0] == 1
    assert b"\x80\x02" not in data[:16]  # no pickle
