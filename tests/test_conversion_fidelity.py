"""What a conversion carries besides the values, judged by the stock path: key order at every
level (``dcp_to_torch_save``, ``torch.load``, ``safetensors.torch.load_file``), a DCP source's
tensor properties (``.metadata`` as ``dcp.save`` writes it), and a safetensors source's own
``__metadata__`` (``safe_open(...).metadata()``)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

import parallel_dcp
from tests.conftest import assert_same


def _metadata(path: Path) -> Metadata:
    return FileSystemReader(str(path)).read_metadata()


def _order(value: Any) -> Any:
    """Every dict's key order, nested (what two state dicts must share to be laid out alike)."""
    if isinstance(value, dict):
        return [(key, _order(item)) for key, item in value.items()]
    if isinstance(value, (list, tuple)):
        return [_order(item) for item in value]
    return None


def _interleaved() -> dict[str, Any]:
    """Values and tensors interleaved at every level; names not in sorted order."""
    g = torch.Generator().manual_seed(0)
    return {
        "z": 1,
        "a": torch.randn(3, 4, generator=g),
        "m": {"y": "text", "b": torch.arange(5), "x": 2.5, "c": {"q": None, "k": torch.ones(2)}},
        "step": 7,
        "t": torch.zeros(2, 2, dtype=torch.bfloat16),
    }


# --- F5: the source's key order -----------------------------------------------------------------


def test_dcp_to_torch_keeps_the_saved_order(tmp_path: Path) -> None:
    sd = _interleaved()
    dcp.save(sd, checkpoint_id=tmp_path / "stock")
    dcp_to_torch_save(tmp_path / "stock", tmp_path / "stock.pt")
    expected = torch.load(tmp_path / "stock.pt", weights_only=False)
    parallel_dcp.convert(tmp_path / "stock", tmp_path / "ours.pt", workers=2)
    got = torch.load(tmp_path / "ours.pt", weights_only=False)
    assert _order(got) == _order(expected) == _order(sd)
    assert_same(got, expected)


def test_torch_to_torch_and_to_dcp_keep_the_file_order(tmp_path: Path) -> None:
    sd = _interleaved()
    torch.save(sd, tmp_path / "src.pt")
    parallel_dcp.convert(tmp_path / "src.pt", tmp_path / "out.pt", workers=2)
    assert _order(torch.load(tmp_path / "out.pt", weights_only=True)) == _order(sd)

    torch_save_to_dcp(tmp_path / "src.pt", tmp_path / "stock")  # stock's route
    parallel_dcp.convert(tmp_path / "src.pt", tmp_path / "ours", workers=2)
    stock, ours = _metadata(tmp_path / "stock"), _metadata(tmp_path / "ours")
    assert list(ours.state_dict_metadata) == list(stock.state_dict_metadata)
    assert list(ours.planner_data) == list(stock.planner_data)
    dcp_to_torch_save(tmp_path / "ours", tmp_path / "back.pt")
    assert _order(torch.load(tmp_path / "back.pt", weights_only=False)) == _order(sd)


def test_dcp_to_dcp_keeps_the_metadata_order(tmp_path: Path) -> None:
    sd = _interleaved()
    dcp.save(sd, checkpoint_id=tmp_path / "stock")
    parallel_dcp.convert(tmp_path / "stock", tmp_path / "ours", workers=2)
    source, out = _metadata(tmp_path / "stock"), _metadata(tmp_path / "ours")
    assert list(out.state_dict_metadata) == list(source.state_dict_metadata)
    assert list(out.planner_data) == list(source.planner_data)


def _offset_order_file(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file whose data order (save_file's: widest dtype first) is not name order."""
    tensors = {"a_int8": torch.arange(4, dtype=torch.int8), "b_f64": torch.ones(3, dtype=torch.float64)}
    tensors |= {"c_f32": torch.full((2,), 2.0), "d_bf16": torch.zeros(2, dtype=torch.bfloat16)}
    st.save_file(tensors, path)
    assert list(st.load_file(path)) != sorted(tensors)  # the case this checks
    return tensors


def test_load_of_safetensors_keeps_load_files_order(tmp_path: Path) -> None:
    _offset_order_file(tmp_path / "one.safetensors")
    expected = st.load_file(tmp_path / "one.safetensors")
    got = parallel_dcp.load(tmp_path / "one.safetensors")
    assert list(got) == list(expected)
    assert_same(got, expected)

    folder = tmp_path / "hf"
    folder.mkdir()
    _offset_order_file(folder / "model-00001-of-00002.safetensors")
    st.save_file({"0_first": torch.ones(1), "y_f64": torch.ones(1, dtype=torch.float64)}, folder / "x.safetensors")
    (folder / "x.safetensors").rename(folder / "model-00002-of-00002.safetensors")
    weight_map: dict[str, str] = {}
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        weight_map |= dict.fromkeys(st.load_file(folder / name), name)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    shards = dict.fromkeys(weight_map.values())
    expected = {k: v for name in shards for k, v in st.load_file(folder / name).items()}
    assert list(parallel_dcp.load(folder)) == list(expected)


def test_safetensors_to_dcp_lists_keys_in_file_order(tmp_path: Path) -> None:
    _offset_order_file(tmp_path / "one.safetensors")
    parallel_dcp.convert(tmp_path / "one.safetensors", tmp_path / "dcp", workers=2)
    assert list(_metadata(tmp_path / "dcp").state_dict_metadata) == list(st.load_file(tmp_path / "one.safetensors"))


# --- F6: a DCP source's tensor properties ---------------------------------------------------------


def _properties(path: Path) -> dict[str, Any]:
    return {
        key: meta.properties
        for key, meta in _metadata(path).state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }


def _parameters() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "model": {
            "w": torch.nn.Parameter(torch.randn(64, 32, generator=g)),
            "b": torch.randn(32, generator=g),
            "frozen": torch.nn.Parameter(torch.randn(8, generator=g), requires_grad=False),
        },
        "step": 3,
    }


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_dcp_to_dcp_records_the_source_tensor_properties(tmp_path: Path, chunked: bool) -> None:
    dcp.save(_parameters(), checkpoint_id=tmp_path / "stock")
    source = _properties(tmp_path / "stock")
    assert source["model.w"].requires_grad  # what stock records of an nn.Parameter
    extra = {"chunk_size": 2048} if chunked else {}
    parallel_dcp.convert(tmp_path / "stock", tmp_path / "ours", workers=2, **extra)
    if chunked:
        meta = _metadata(tmp_path / "ours").state_dict_metadata["model.w"]
        assert isinstance(meta, TensorStorageMetadata) and len(meta.chunks) > 1
    assert _properties(tmp_path / "ours") == source
    # read back the stock way, the values are the source's
    dcp_to_torch_save(tmp_path / "ours", tmp_path / "ours.pt")
    dcp_to_torch_save(tmp_path / "stock", tmp_path / "stock.pt")
    assert_same(
        torch.load(tmp_path / "ours.pt", weights_only=False), torch.load(tmp_path / "stock.pt", weights_only=False)
    )


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_properties_carried_through_a_cast_and_a_rename(tmp_path: Path) -> None:
    dcp.save(_parameters(), checkpoint_id=tmp_path / "stock")
    parallel_dcp.convert(
        tmp_path / "stock", tmp_path / "ours", workers=2, dtype="bf16", rename=[(r"model\.w", "model.weight")]
    )
    # what stock dcp.save records for the same values: a bfloat16 Parameter
    cast = {"model": {"weight": torch.nn.Parameter(torch.zeros(64, 32, dtype=torch.bfloat16))}}
    dcp.save(cast, checkpoint_id=tmp_path / "expected")
    assert _properties(tmp_path / "ours")["model.weight"] == _properties(tmp_path / "expected")["model.weight"]


def test_dcp_properties_that_no_read_tensor_has_are_carried(tmp_path: Path) -> None:
    """pin_memory=True (a pinned tensor's save; pinning needs an accelerator here) is carried too."""
    dcp.save(_parameters(), checkpoint_id=tmp_path / "src")
    metadata_file = tmp_path / "src" / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    meta = metadata.state_dict_metadata["model.b"]
    meta.properties.pin_memory = True
    metadata_file.write_bytes(pickle.dumps(metadata))
    parallel_dcp.convert(tmp_path / "src", tmp_path / "ours", workers=2)
    assert _properties(tmp_path / "ours") == _properties(tmp_path / "src")
    assert _properties(tmp_path / "ours")["model.b"].pin_memory


# --- safetensors __metadata__ -----------------------------------------------------------------------


def _header_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def test_single_file_metadata_is_carried_under_ours(tmp_path: Path) -> None:
    tensors = {"w": torch.randn(4, 4), "b": torch.ones(4)}
    stale = "stale: not this file's checksums"
    st.save_file(tensors, tmp_path / "src.safetensors", metadata={"format": "np", "source": "x", "parallel_dcp": stale})
    parallel_dcp.convert(tmp_path / "src.safetensors", tmp_path / "out.safetensors", workers=2)
    got = _header_metadata(tmp_path / "out.safetensors")
    assert got["source"] == "x"
    assert got["format"] == "pt"  # ours: the file holds torch tensors
    assert got["parallel_dcp"] != stale  # our own checksums, of this file
    assert parallel_dcp.verify(tmp_path / "out.safetensors").ok
    assert_same(st.load_file(tmp_path / "out.safetensors"), tensors)

    parallel_dcp.convert(tmp_path / "src.safetensors", tmp_path / "hf", workers=2, to="safetensors", shard_size=64)
    shards = sorted((tmp_path / "hf").glob("*.safetensors"))
    assert len(shards) == 2
    for shard in shards:
        assert _header_metadata(shard) == {"format": "pt", "source": "x"}


def test_sharded_metadata_carried_where_the_shards_agree(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    parts = [{"a": torch.ones(8)}, {"b": torch.zeros(8)}]
    for i, (name, part) in enumerate(zip(names, parts, strict=True)):
        st.save_file(part, folder / name, metadata={"format": "pt", "source": "x", "part": str(i)})
    weight_map = {"a": names[0], "b": names[1]}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    parallel_dcp.convert(folder, tmp_path / "one.safetensors", workers=2)
    got = _header_metadata(tmp_path / "one.safetensors")
    assert got["source"] == "x" and "part" not in got  # "part" describes one source shard only
    parallel_dcp.convert(folder, tmp_path / "out", workers=2, to="safetensors", shard_size=32)
    for shard in sorted((tmp_path / "out").glob("*.safetensors")):
        assert _header_metadata(shard) == {"format": "pt", "source": "x"}


def test_a_tensor_named_metadata_is_still_refused(tmp_path: Path) -> None:
    torch.save({"__metadata__": torch.ones(2), "w": torch.ones(2)}, tmp_path / "src.pt")
    with pytest.raises(ValueError, match="__metadata__"):
        parallel_dcp.convert(tmp_path / "src.pt", tmp_path / "out.safetensors", workers=2)
    assert not (tmp_path / "out.safetensors").exists()


def test_a_safetensors_source_on_object_storage(tmp_path: Path) -> None:
    """Read by ranges from its header (not the library's): the same order and metadata."""
    import s3fs

    from tests.s3_server import moto_endpoint

    tensors = _offset_order_file(tmp_path / "src.safetensors")
    st.save_file(tensors, tmp_path / "src.safetensors", metadata={"format": "pt", "source": "x", "parallel_dcp": "old"})
    with moto_endpoint() as endpoint:
        options = {"endpoint_url": endpoint}
        s3 = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        s3.mkdir("fidelity")
        s3.put(str(tmp_path / "src.safetensors"), "fidelity/src.safetensors")
        url = "s3://fidelity/src.safetensors"
        expected = st.load_file(tmp_path / "src.safetensors")
        assert list(parallel_dcp.load(url, storage_options=options)) == list(expected)
        parallel_dcp.convert(url, tmp_path / "out.safetensors", workers=2, storage_options=options)
    got = _header_metadata(tmp_path / "out.safetensors")
    assert got["source"] == "x" and got["parallel_dcp"] != "old"
    assert list(st.load_file(tmp_path / "out.safetensors")) == list(expected)
    assert parallel_dcp.verify(tmp_path / "out.safetensors").ok


def test_metadata_too_large_for_the_output_header_is_left_out_with_a_warning(tmp_path) -> None:
    """A source header near the library's 100,000,000-byte limit loads; carried on with our own
    entries over it, the output's header passed the limit and no reader could open it."""
    import warnings as _warnings

    from safetensors.torch import load_file as _load_file
    from safetensors.torch import save_file as _save_file

    from parallel_dcp.jobs.targets import CARRIED_METADATA_MAX_BYTES

    src = tmp_path / "big.safetensors"
    _save_file({"w": torch.ones(4)}, src, metadata={"notes": "x" * (CARRIED_METADATA_MAX_BYTES + 1), "k": "v"})
    out = tmp_path / "out.safetensors"
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        parallel_dcp.convert(src, out, workers=1)
    assert any("is not carried" in str(w.message) for w in caught)
    assert torch.equal(_load_file(out)["w"], torch.ones(4))
