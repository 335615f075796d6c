"""Releases quantized by a scheme the tool does not dequantize (GPTQ / AWQ, bitsandbytes 4- and
8-bit; review s16 F10).

- ``dtype`` used to cast their float scales (GPTQ ``scales``, bitsandbytes ``absmax`` and
  ``quant_map``) while the output kept the ``quantization_config``: the scheme's reader computed
  other weights, with no error. Refused now, as FP8 pairs are, naming the quant_method (from the
  config.json beside the folder's weights or beside a weights file named alone) or, without a
  config, the keys that show the layout; ``dequantize`` (which cannot read them) and ``quantize``
  (which needs plain weights) alike.
- A plain conversion copies them unchanged, byte for byte, and keeps their ``quantization_config``
  (it used to drop it, as it drops an FP8 one the shards no longer hold: the output then loaded as
  a plain model).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import parallel_dcp
from parallel_dcp.errors import QuantizationError

_G = torch.Generator().manual_seed(0)
_X = "model.layers.0.mlp.up_proj"

# name: (tensors as the scheme's saver writes them, its quantization_config, what names the layout)
LAYOUTS: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any], str]] = {
    "gptq": (
        {
            f"{_X}.qweight": torch.randint(0, 2**31 - 1, (8, 64), dtype=torch.int32, generator=_G),
            f"{_X}.qzeros": torch.randint(0, 2**31 - 1, (1, 8), dtype=torch.int32, generator=_G),
            f"{_X}.scales": (torch.rand(1, 64, generator=_G) * 0.01 + 1e-3).half(),
            f"{_X}.g_idx": torch.zeros(64, dtype=torch.int32),
            "model.norm.weight": torch.ones(64, dtype=torch.float16),
        },
        {"quant_method": "gptq", "bits": 4, "group_size": 64},
        "GPTQ / AWQ",
    ),
    "bnb4": (
        {
            f"{_X}.weight": torch.randint(0, 255, (2048, 1), dtype=torch.uint8, generator=_G),
            f"{_X}.weight.absmax": torch.rand(64, generator=_G) * 0.1 + 1e-3,
            f"{_X}.weight.quant_map": torch.linspace(-1, 1, 16) * 0.7,
            f"{_X}.weight.quant_state.bitsandbytes__nf4": torch.zeros(100, dtype=torch.uint8),
            "model.norm.weight": torch.ones(64, dtype=torch.float16),
        },
        {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
        "bitsandbytes 4-bit",
    ),
    "bnb8": (
        {
            f"{_X}.weight": torch.randint(-127, 127, (64, 64), dtype=torch.int8, generator=_G),
            f"{_X}.SCB": torch.rand(64, generator=_G) + 0.5,
            "model.norm.weight": torch.ones(64, dtype=torch.float16),
        },
        {"load_in_8bit": True},  # an older bitsandbytes config: no quant_method
        "bitsandbytes 8-bit",
    ),
}


def _release(directory: Path, layout: str, *, config: bool = True) -> Path:
    tensors, quantization, _ = LAYOUTS[layout]
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if config:
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "float16"}
        (directory / "config.json").write_text(json.dumps(cfg | {"quantization_config": quantization}))
    return directory


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("named", ["folder", "file", "no config"])
@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"dtype": torch.bfloat16}, r"dtype=bfloat16 \(--dtype\) would round its float scales"),
        ({"dequantize": True}, r"dequantize \(--dequantize\) cannot read its layout"),
        ({"quantize": "fp8-block:64", "quantize_keys": "*"}, r"quantize \(--quantize\) needs plain weights"),
    ],
)
def test_refused_before_anything_is_written(
    tmp_path: Path, layout: str, named: str, options: dict[str, Any], said: str
) -> None:
    src = _release(tmp_path / "src", layout, config=named != "no config")
    source = src / "model.safetensors" if named == "file" else src
    out = tmp_path / "out"
    with pytest.raises(QuantizationError, match=said) as caught:
        parallel_dcp.convert(source, out, to="safetensors", workers=1, **options)
    message = str(caught.value)
    if named == "no config":
        assert LAYOUTS[layout][2] in message and caught.value.keys
    else:  # named by its config's quant_method
        assert ("gptq" if layout == "gptq" else "bitsandbytes") in message
    assert "convert without it to copy the release unchanged" in message
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_plain_conversion_copies_them_unchanged(tmp_path: Path, layout: str) -> None:
    src = _release(tmp_path / "src", layout)
    out = tmp_path / "out"
    parallel_dcp.convert(src, out, to="safetensors", workers=1)
    before, after = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert list(after) == list(before)
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype
        assert after[key].view(torch.uint8).equal(tensor.view(torch.uint8)), key
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == LAYOUTS[layout][1]
