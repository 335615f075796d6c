"""Quantized sources the tool cannot treat as plain are refused clearly, before anything is written
(review s16 F6, F7).

- ``quantize`` of a source that is quantized already: FP8 blocks (``X.weight_scale_inv``), MXFP4
  (gpt-oss's ``X_blocks``/``X_scales``, whose config's ``mxfp4`` quantization_config an FP8 one
  replaced: transformers then loaded random experts) and per-channel FP8 (compressed-tensors'
  ``X.weight_scale``) alike: "quantized already", and what to do.
- ``dtype`` and ``dequantize`` of a per-channel FP8 (compressed-tensors) release: named as a layout
  dequantize does not read (it used to say "add --dequantize", which then said the scale was missing).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import parallel_dcp
from parallel_dcp.errors import QuantizationError
from tests.quantized_checkpoints import fp8_checkpoint, mxfp4_checkpoint


def compressed_tensors_checkpoint(directory: Path) -> Path:
    """The compressed-tensors FP8 layout (RedHatAI's ...-FP8 releases): per-channel scales."""
    directory.mkdir(parents=True)
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    scale = w.abs().amax(1, keepdim=True) / 448
    tensors = {
        "model.layers.0.mlp.up_proj.weight": (w / scale).to(torch.float8_e4m3fn),
        "model.layers.0.mlp.up_proj.weight_scale": scale,
        "model.layers.0.mlp.up_proj.input_scale": torch.tensor([0.02]),
        "model.norm.weight": torch.ones(64, dtype=torch.bfloat16),
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized"},
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


SOURCES = {"fp8-blocks": fp8_checkpoint, "mxfp4": mxfp4_checkpoint, "compressed-tensors": compressed_tensors_checkpoint}


@pytest.mark.parametrize(
    ("layout", "options", "said"),
    [
        ("fp8-blocks", {"quantize": "fp8-block"}, r"quantized already.*--dequantize\) to a plain checkpoint first"),
        ("mxfp4", {"quantize": "fp8-block:16"}, r"quantized already.*_blocks.*--dequantize\) to a plain checkpoint"),
        ("mxfp4", {"quantize": "fp8-block", "quantize_keys": "*"}, r"quantized already"),
        ("compressed-tensors", {"quantize": "fp8-block:64"}, r"quantized already.*per-channel FP8.*does not read"),
        ("compressed-tensors", {"dtype": torch.bfloat16}, r"per-channel FP8.*compressed-tensors.*does not read"),
        ("compressed-tensors", {"dequantize": True}, r"cannot be dequantized"),
    ],
)
def test_refused_before_anything_is_written(tmp_path: Path, layout: str, options: dict[str, Any], said: str) -> None:
    src = SOURCES[layout](tmp_path / "src")
    out = tmp_path / "out"
    with pytest.raises(QuantizationError, match=said) as caught:
        parallel_dcp.convert(src, out, to="safetensors", workers=1, **options)
    assert "add --dequantize" not in str(caught.value) or layout != "compressed-tensors"
    if options.get("dequantize"):  # its lines name the layout
        assert "per-channel FP8" in str(caught.value) and "does not read" in str(caught.value)
    assert not out.exists() or not any(out.iterdir())
