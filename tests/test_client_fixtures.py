"""The client suite's findings, pinned for the main suite (issue 29, item 6).

tests/fixtures/clients/transformers-*.json were recorded from transformers 5.25 itself by
tests_clients/record_fixtures.py: the config.json its ``save_pretrained`` writes and every tensor's
name, dtype and shape (for ``llama-fp8``: what transformers' fine-grained FP8 model holds). Here a
checkpoint is rebuilt from each record with random values, without transformers, and converted; what
we write must keep the names and shapes transformers expects and a config.json that says what the
shards hold. The client suite (tools/test-clients) checks the same outputs in transformers itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import parallel_dcp

FIXTURES = Path(__file__).parent / "fixtures" / "clients"
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn}
NAMES = {v: k for k, v in DTYPES.items()}


def record(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return data


def build_folder(rec: dict[str, Any], dest: Path) -> Path:
    """A Hugging Face folder with the record's config.json and tensors (seeded random values)."""
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for key, (dtype_name, shape) in rec["tensors"].items():
        dtype = DTYPES[dtype_name]
        if dtype == torch.float8_e4m3fn:
            tensors[key] = (torch.randn(shape, generator=gen) * 64).to(dtype)
        elif key.endswith("weight_scale_inv"):
            tensors[key] = torch.rand(shape, generator=gen, dtype=dtype) / 448 + 1e-4
        else:
            tensors[key] = torch.randn(shape, generator=gen).to(dtype)
    dest.mkdir()
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(rec["config"]))
    return dest


def written(folder: Path) -> dict[str, list[Any]]:
    """Every tensor of a sharded safetensors output as [dtype name, shape], as the records hold them."""
    out: dict[str, list[Any]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sl = f.get_slice(key)
                out[key] = [sl.get_dtype(), list(sl.get_shape())]
    return out


def config_of(folder: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((folder / "config.json").read_text())
    return data


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("client-fixtures")
    return {n: build_folder(record(n), base / n) for n in ("transformers-llama", "transformers-bert")}


def test_records_name_their_client_and_hold_what_transformers_wrote() -> None:
    for name in ("transformers-llama", "transformers-bert", "transformers-llama-fp8"):
        rec = record(name)
        assert (rec["client"], rec["version"]) == ("transformers", "5.25.0")
        assert rec["config"]["dtype"] in ("float32", "bfloat16") and "torch_dtype" not in rec["config"]
        assert rec["tensors"]
    assert "lm_head.weight" in record("transformers-llama")["tensors"]
    assert "embeddings.word_embeddings.weight" in record("transformers-bert")["tensors"]


@pytest.mark.parametrize("name", ["transformers-llama", "transformers-bert"])
@pytest.mark.parametrize("route", ["direct", "via-dcp"])
def test_plain_conversion_keeps_every_name_shape_and_dtype(
    name: str, route: str, folders: dict[str, Path], tmp_path: Path
) -> None:
    src, out = folders[name], tmp_path / "out"
    if route == "direct":
        parallel_dcp.convert(src, out, to="safetensors", workers=2)
    else:
        parallel_dcp.convert(src, tmp_path / "dcp", workers=2)
        parallel_dcp.convert(tmp_path / "dcp", out, to="safetensors", workers=2, copy_files_from=src)
    assert written(out) == record(name)["tensors"]
    assert config_of(out) == record(name)["config"]


@pytest.mark.parametrize("name", ["transformers-llama", "transformers-bert"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("route", ["direct", "via-dcp"])
def test_dtype_cast_config_names_what_the_shards_hold(
    name: str, dtype: str, route: str, folders: dict[str, Path], tmp_path: Path
) -> None:
    """transformers 5 reads ``dtype`` (``torch_dtype`` only without it): both must name the cast."""
    src, out = folders[name], tmp_path / "out"
    if route == "direct":
        parallel_dcp.convert(src, out, to="safetensors", workers=2, dtype=dtype)
    else:
        parallel_dcp.convert(src, tmp_path / "dcp", workers=2)
        parallel_dcp.convert(tmp_path / "dcp", out, to="safetensors", workers=2, dtype=dtype, copy_files_from=src)
    want = NAMES[getattr(torch, dtype)]
    assert written(out) == {k: [want, shape] for k, (_, shape) in record(name)["tensors"].items()}
    config = config_of(out)
    assert (config.get("dtype"), config.get("torch_dtype")) == (dtype, dtype)
    others = {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")}
    assert others == {k: v for k, v in record(name)["config"].items() if k not in ("dtype", "torch_dtype")}


def test_quantize_fp8_block_writes_what_transformers_fp8_llama_holds(tmp_path: Path) -> None:
    fp8 = record("transformers-llama-fp8")
    src = build_folder({**fp8, "tensors": record("transformers-llama")["tensors"]}, tmp_path / "src")
    # The recorded config names bf16 (the FP8 model's other tensors); the source here is float32.
    out = tmp_path / "out"
    block = fp8["config"]["quantization_config"]["weight_block_size"][0]
    parallel_dcp.convert(src, out, to="safetensors", workers=2, dtype="bfloat16", quantize=f"fp8-block:{block}")
    assert written(out) == fp8["tensors"]
    quantization = config_of(out)["quantization_config"]
    assert quantization["quant_method"] == "fp8"
    assert quantization["weight_block_size"] == [block, block]
    assert quantization.get("activation_scheme", "dynamic") == "dynamic"
    assert "lm_head" in quantization["modules_to_not_convert"]
    assert (config_of(out)["dtype"], config_of(out)["torch_dtype"]) == ("bfloat16", "bfloat16")


@pytest.mark.parametrize("dtype", [None, "float16"])
def test_dequantize_fp8_gives_the_plain_llama(dtype: str | None, tmp_path: Path) -> None:
    fp8, plain = record("transformers-llama-fp8"), record("transformers-llama")
    src = build_folder(fp8, tmp_path / "src")
    out = tmp_path / "out"
    parallel_dcp.convert(src, out, to="safetensors", workers=2, dequantize=True, dtype=dtype)
    want = dtype or "bfloat16"
    assert written(out) == {k: [NAMES[getattr(torch, want)], s] for k, (_, s) in plain["tensors"].items()}
    config = config_of(out)
    assert "quantization_config" not in config
    assert (config.get("dtype"), config.get("torch_dtype")) == (want, want)
