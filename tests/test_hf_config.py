"""config.json follows the data (issue 29, item 2): ``--dtype`` sets ``dtype`` and ``torch_dtype``
alike (transformers 5 reads ``dtype``, older ones ``torch_dtype``), ``--dequantize`` removes
``quantization_config``, ``--quantize`` writes it with ``modules_to_not_convert``; the default
quantize rule leaves routers, embeddings, ``lm_head`` and norms alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import parallel_dcp
from parallel_dcp.cli import main
from tests.quantized_checkpoints import fp8_checkpoint, write_hf

ROUTED = {
    "model.embed_tokens.weight": (32, 64),
    "model.layers.0.self_attn.q_proj.weight": (64, 64),
    "model.layers.0.self_attn.q_proj.bias": (64,),
    "model.layers.0.mlp.router.weight": (4, 64),  # gpt-oss
    "model.layers.0.mlp.gate.weight": (4, 64),  # Mixtral, Qwen, DeepSeek
    "model.layers.0.mlp.down_proj.weight": (64, 128),
    "model.layers.0.input_layernorm.weight": (64,),
    "model.norm.weight": (64,),
    "lm_head.weight": (32, 64),
}


def _folder(where: Path, config: dict[str, Any] | None) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(shape, generator=g).to(torch.bfloat16) for k, shape in ROUTED.items()}
    return write_hf(where, tensors, [list(tensors)], config)


def _config(path: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((path / "config.json").read_text())
    return config


@pytest.mark.parametrize(
    "given",
    [
        {"dtype": "bfloat16"},  # transformers 5 writes this one
        {"torch_dtype": "bfloat16"},  # transformers 4
        {"dtype": "bfloat16", "torch_dtype": "bfloat16"},
        {},
    ],
)
@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_dtype_sets_both_names(tmp_path: Path, given: dict[str, str], to: str) -> None:
    src = _folder(tmp_path / "src", {"model_type": "llama", **given})
    parallel_dcp.convert(src, tmp_path / "out", to=to, dtype="float16", workers=1)
    assert _config(tmp_path / "out") == {"model_type": "llama", "dtype": "float16", "torch_dtype": "float16"}


def test_without_dtype_config_is_copied_as_it_is(tmp_path: Path) -> None:
    src = _folder(tmp_path / "src", None)
    (src / "config.json").write_bytes(b'{"dtype": "bfloat16",  "odd spacing": 1}')
    parallel_dcp.convert(src, tmp_path / "out", to="safetensors", workers=1)
    assert (tmp_path / "out" / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_copy_files_from_config_follows_the_dtype(tmp_path: Path) -> None:
    src = _folder(tmp_path / "src", None)
    parallel_dcp.convert(src, tmp_path / "dcp", workers=1)
    files = tmp_path / "files"
    files.mkdir()
    (files / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    parallel_dcp.convert(tmp_path / "dcp", tmp_path / "out", to="safetensors", dtype="float32", copy_files_from=files)
    assert _config(tmp_path / "out") == {"dtype": "float32", "torch_dtype": "float32"}


def test_broken_config_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    src = _folder(tmp_path / "src", None)
    (src / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not JSON.*nothing was written"):
        parallel_dcp.convert(src, tmp_path / "out", to="safetensors", dtype="float16", workers=1)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_dequantize_removes_quantization_config_and_sets_both_dtypes(tmp_path: Path, to: str) -> None:
    src = fp8_checkpoint(tmp_path / "fp8")  # config.json has torch_dtype and quantization_config
    parallel_dcp.convert(src, tmp_path / "out", to=to, dequantize=True, dtype="float16", workers=2)
    config = _config(tmp_path / "out")
    assert "quantization_config" not in config
    assert config["dtype"] == config["torch_dtype"] == "float16"


def test_default_rule_leaves_routers_embeddings_head_and_norms(tmp_path: Path) -> None:
    src = _folder(tmp_path / "src", {"model_type": "x", "dtype": "bfloat16"})
    parallel_dcp.convert(src, tmp_path / "q", to="safetensors", quantize="fp8-block", workers=1)
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())
    scaled = {k.removesuffix("_scale_inv") for k in index["weight_map"] if k.endswith("_scale_inv")}
    assert scaled == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"}
    assert _config(tmp_path / "q")["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": [
            "lm_head",
            "model.embed_tokens",
            "model.layers.0.mlp.gate",
            "model.layers.0.mlp.router",
        ],
    }
    assert _config(tmp_path / "q")["dtype"] == "bfloat16"  # the unquantized tensors' dtype, unchanged


def test_modules_to_not_convert_follow_quantize_keys_rename_and_dtype(tmp_path: Path) -> None:
    src = _folder(tmp_path / "src", {"torch_dtype": "bfloat16"})
    args = ["convert", str(src), str(tmp_path / "q"), "--to", "safetensors", "--quantize", "fp8-block:64"]
    args += ["--quantize-keys", "*.down_proj.weight", "--rename", r"model\.(.*)=m.\1", "--dtype", "float16", "-q"]
    assert main(args) == 0
    config = _config(tmp_path / "q")
    assert config["quantization_config"]["weight_block_size"] == [64, 64]
    assert config["quantization_config"]["modules_to_not_convert"] == [
        "lm_head",
        "m.embed_tokens",
        "m.layers.0.mlp.gate",
        "m.layers.0.mlp.router",
        "m.layers.0.self_attn.q_proj",
    ]
    assert config["dtype"] == config["torch_dtype"] == "float16"
