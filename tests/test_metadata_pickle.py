""".metadata spliced from fragments pickled in the workers (formats/metadata_pickle.py) reads back
as the Metadata that DCP's own FileSystemWriter.finish writes."""

from __future__ import annotations

import json
import math
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

import parallel_dcp
from parallel_dcp.formats.metadata_pickle import assemble, dict_fragment
from parallel_dcp.storage.metadata import read_metadata
from parallel_dcp.storage.ownership import MANIFEST_FILE
from tests.test_roundtrip import assert_same, nested_state, odd_shapes


def tensor_meta(shape: tuple[int, ...], props: TensorProperties) -> TensorStorageMetadata:
    size = torch.Size(shape)
    return TensorStorageMetadata(props, size, [ChunkStorageMetadata(torch.Size([0] * len(shape)), size)])


def test_fragments_with_colliding_memo_slots_read_back_as_their_own_objects() -> None:
    # Each fragment memoizes its shared TensorProperties and sizes in slots 1, 2, ...: the
    # second fragment overwrites the first's, and each must still read back its own objects.
    floats = TensorProperties(dtype=torch.float32)
    ints = TensorProperties(dtype=torch.int64)
    first = {f"a{i}": tensor_meta((i + 1, 2), floats) for i in range(300)}  # > 255 slots: LONG_BINPUT
    second = {f"b{i}": tensor_meta((3,), ints) for i in range(5)}
    triples = [
        (dict_fragment(first), dict_fragment({k: ("m", k) for k in first}), dict_fragment({k: len(k) for k in first})),
        (dict_fragment(second), b"", dict_fragment({k: [k] for k in second})),
    ]
    meta = StorageMeta(checkpoint_id="/ckpt", save_id="abc")
    loaded = pickle.loads(assemble(triples, meta, "1.0.0"))
    assert isinstance(loaded, Metadata)
    assert loaded.state_dict_metadata == first | second
    assert list(loaded.state_dict_metadata) == [*first, *second]
    assert loaded.planner_data == {k: ("m", k) for k in first}
    assert loaded.storage_data == {k: len(k) for k in first} | {k: [k] for k in second}
    assert loaded.storage_meta == meta and loaded.version == "1.0.0"
    assert all(m.properties.dtype == torch.int64 for k, m in loaded.state_dict_metadata.items() if k[0] == "b")


def test_no_fragments_is_an_empty_metadata() -> None:
    loaded = pickle.loads(assemble([], None, "1.0.0"))
    assert loaded == Metadata(state_dict_metadata={}, planner_data={}, storage_data={}, version="1.0.0")


def stock_save(sd: dict[str, Any], path: Path) -> Metadata:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group
        dcp.save(sd, storage_writer=FileSystemWriter(str(path), thread_count=1), no_dist=True)
    return FileSystemReader(str(path)).read_metadata()


def test_a_save_with_split_tensors_writes_what_stock_writes(tmp_path: Path) -> None:
    sd = nested_state() | {"odd": odd_shapes(), "big": torch.randn(64, 32), "big2": torch.arange(4096.0)}
    result = parallel_dcp.save(sd, tmp_path / "ours", workers=3, executor="processes", chunk_size=4096)
    assert result.tasks >= 3
    ours = FileSystemReader(str(tmp_path / "ours")).read_metadata()  # stock's reader: plain pickle.load
    assert len(ours.state_dict_metadata["big"].chunks) > 1  # split, its chunks from several parts
    stock = stock_save(sd, tmp_path / "stock")
    assert list(ours.state_dict_metadata) == list(stock.state_dict_metadata)  # stock's order, split keys too
    split = {k for k, v in ours.state_dict_metadata.items() if len(getattr(v, "chunks", [])) > 1}
    assert {"big", "big2"} <= split
    whole = {k: v for k, v in ours.state_dict_metadata.items() if k not in split}
    assert whole == {k: v for k, v in stock.state_dict_metadata.items() if k not in split}
    for key in split:  # the same tensor, its chunks covering it
        ours_meta, stock_meta = ours.state_dict_metadata[key], stock.state_dict_metadata[key]
        assert (ours_meta.properties, ours_meta.size) == (stock_meta.properties, stock_meta.size)
        assert sum(math.prod(c.sizes) for c in ours_meta.chunks) == math.prod(ours_meta.size)
    assert ours.planner_data == stock.planner_data
    assert ours.version == stock.version
    assert (
        ours.storage_meta is not None
        and ours.storage_meta.save_id == json.loads((tmp_path / "ours" / MANIFEST_FILE).read_text())["save_id"]
    )
    assert str(ours.storage_meta.checkpoint_id) == str(tmp_path / "ours")
    # Every record is where storage_data says: every chunk and value reads back bit for bit.
    for index, info in ours.storage_data.items():
        assert (tmp_path / "ours" / info.relative_path).stat().st_size >= info.offset + info.length, index
    assert read_metadata(tmp_path / "ours").state_dict_metadata == ours.state_dict_metadata  # the safe reader
    assert_same(parallel_dcp.load(tmp_path / "ours"), sd)


def test_many_keys_over_many_tasks_keep_the_state_dicts_order(tmp_path: Path) -> None:
    # Interleaved sizes so that a largest-first partition would scatter the keys over tasks.
    sd = {f"layers.{i}.w": torch.full((1 + (i * 7) % 13,), float(i)) for i in range(3000)}
    sd["step"] = 7  # a value in the middle of the order
    sd |= {f"tail.{i}": torch.ones(2) for i in range(10)}
    result = parallel_dcp.save(sd, tmp_path / "ours", workers=3, executor="processes")
    assert result.tasks >= 3
    ours = FileSystemReader(str(tmp_path / "ours")).read_metadata()
    assert list(ours.state_dict_metadata) == list(sd)
    assert list(ours.planner_data) == list(sd)
    assert [index.fqn for index in ours.storage_data] == list(sd)
    assert_same(parallel_dcp.load(tmp_path / "ours"), sd)
    # A few tensors of very different sizes: spread largest first, still in order.
    few = {f"t{i}": torch.ones(2 ** (i % 9) * 64) for i in range(20)} | {"big": torch.ones(2**20), "lr": 0.1}
    few |= {f"u{i}": torch.ones(2 ** (i % 9) * 64) for i in range(20)}
    # (the largest item is over an eighth of a task: not cut into runs)
    assert torch.ones(2**20).nbytes * 8 > sum(t.nbytes + 64 * 2**10 for t in few.values() if torch.is_tensor(t)) / 3
    parallel_dcp.save(few, tmp_path / "few", workers=3, executor="processes")
    assert list(FileSystemReader(str(tmp_path / "few")).read_metadata().state_dict_metadata) == list(few)


def test_entries_are_written_as_calls_and_read_back_equal_in_stock_pickle_and_the_safe_unpickler() -> None:
    # A tensor entry, its chunk and a plain record are written as a call of their class
    # (REDUCE: fields inline, no state dict kept); a compressed record and an index as pickle
    # writes them. Both stock's plain pickle and the allow-list unpickler read back equal objects.
    import io
    import pickletools

    from torch.distributed.checkpoint.metadata import MetadataIndex

    from parallel_dcp import _compat
    from parallel_dcp.formats.metadata_pickle import _PREFIX
    from parallel_dcp.storage.metadata import _SafeUnpickler

    floats = TensorProperties(dtype=torch.float32)
    tensors = {f"t{i}": tensor_meta((i + 1, 3), floats) for i in range(3)}
    plain = _compat.storage_info("__0_0.distcp", 10, 20)
    packed = _compat.storage_info("__0_0.distcp", 30, 7, ["stream.zstd/1"])
    records = {MetadataIndex("t0", torch.Size([0, 0]), 0): plain, MetadataIndex("t1", torch.Size([0, 0]), 0): packed}
    for entries in (tensors, records):
        data = _PREFIX + dict_fragment(entries) + pickle.STOP
        for loaded in (pickle.loads(data), _SafeUnpickler(io.BytesIO(data)).load()):
            assert loaded == entries
            assert list(loaded) == list(entries)
    ops = [op.name for op, _, _ in pickletools.genops(_PREFIX + dict_fragment(tensors) + pickle.STOP)]
    # only the one shared TensorProperties is an empty object filled by BUILD (as pickle writes it)
    assert (ops.count("NEWOBJ"), ops.count("BUILD")) == (1, 1)
    loaded = pickle.loads(_PREFIX + dict_fragment(records) + pickle.STOP)
    assert loaded[MetadataIndex("t1", torch.Size([0, 0]), 0)].transform_descriptors == ["stream.zstd/1"]
    assert loaded[MetadataIndex("t0", torch.Size([0, 0]), 0)].transform_descriptors is None


def test_stock_dcp_load_reads_a_checkpoint_of_many_small_tensors_we_wrote(tmp_path: Path) -> None:
    sd = {f"layers.{i}.w": torch.full((1 + i % 7, 2), float(i)) for i in range(600)} | {"step": 3}
    parallel_dcp.save(sd, tmp_path / "ours", workers=2, executor="processes")
    stock = stock_save(sd, tmp_path / "stock")
    ours = FileSystemReader(str(tmp_path / "ours")).read_metadata()  # plain pickle.load, as stock reads it
    assert ours.state_dict_metadata == stock.state_dict_metadata
    assert set(ours.storage_data) == set(stock.storage_data)
    into = {k: torch.zeros_like(v) if torch.is_tensor(v) else None for k, v in sd.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group
        dcp.load(into, storage_reader=FileSystemReader(str(tmp_path / "ours")), no_dist=True)
    assert_same(into, sd)
