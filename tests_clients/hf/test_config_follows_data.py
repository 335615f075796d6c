"""config.json follows the data, as transformers 5.25 reads it (issue 29, item 2).

- ``--dtype float16`` of a transformers-5 folder (``"dtype": "bfloat16"`` in its config) loads as
  float16, equal bit for bit to transformers' own ``from_pretrained(src).to(float16)``;
- ``--quantize fp8-block`` output's ``quantization_config`` is parsed as ``FineGrainedFP8Config``
  with ``modules_to_not_convert`` naming what stayed bf16, and those modules load as plain layers
  equal to the source's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]


def _convert(*args: str | Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "parallel_dcp", "convert", *map(str, args), "-q", "--workers", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr


def _llama(where: Path) -> Path:
    """A tiny Llama saved by transformers 5 in bfloat16 (its config.json says "dtype")."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(where)
    return where


def _tensors(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, want in expected.items():
        got = actual[name]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name


def test_dtype_float16_loads_as_float16(tmp_path: Path) -> None:
    src = _llama(tmp_path / "llama")
    assert json.loads((src / "config.json").read_text())["dtype"] == "bfloat16"
    _convert(src, tmp_path / "fp16", "--to", "safetensors", "--dtype", "float16")
    ours, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "fp16", output_loading_info=True)
    assert not any(info.values()), info
    theirs = transformers.LlamaForCausalLM.from_pretrained(src).to(torch.float16)
    assert {p.dtype for p in ours.parameters()} == {torch.float16}
    _assert_same(_tensors(ours), _tensors(theirs))


def test_quantized_fp8_config_is_fine_grained_fp8_with_modules_to_not_convert(tmp_path: Path) -> None:
    from transformers.quantizers.auto import AutoQuantizationConfig

    src = _llama(tmp_path / "llama")
    _convert(src, tmp_path / "fp8", "--to", "safetensors", "--quantize", "fp8-block")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "fp8")
    parsed = AutoQuantizationConfig.from_dict(config.quantization_config)
    assert isinstance(parsed, transformers.FineGrainedFP8Config)
    assert parsed.weight_block_size == (128, 128) or list(parsed.weight_block_size) == [128, 128]
    assert sorted(parsed.modules_to_not_convert) == ["lm_head", "model.embed_tokens"]
    ours, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "fp8", output_loading_info=True)
    assert not any(info.values()), info
    original = _tensors(transformers.LlamaForCausalLM.from_pretrained(src))
    loaded = _tensors(ours)
    for name in ("lm_head.weight", "model.embed_tokens.weight"):  # not converted: the source's bits
        _assert_same({name: loaded[name]}, {name: original[name]})
