"""What ``--dequantize`` writes without ``--dtype``: what transformers' own dequantizing load of
the folder gives (``dtype="auto"``), so that ``from_pretrained`` of the output equals
``from_pretrained`` of the FP8 folder (review s16 F3: a float32 model's FP8 folder was written
bfloat16, config included, and transformers rounded its float32 norms and embeddings on load).
The client suite checks it against transformers itself (tests_clients/hf/test_fp8_outputs.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch

import parallel_dcp
from parallel_dcp.formats import open_source
from parallel_dcp.formats.quantized_pairs import dequantized_dtype_of


def _fp8_folder(root: Path, config: dict[str, Any] | None, plain: torch.dtype) -> Path:
    root.mkdir()
    weight = (torch.randn(128, 128) * 4).to(torch.float8_e4m3fn)
    tensors = {"a.norm.weight": torch.randn(128).to(plain), "b.weight": weight, "b.weight_scale_inv": torch.rand(1, 1)}
    st.save_file(tensors, root / "model.safetensors")
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize(
    ("config", "plain", "want"),
    [
        ({"dtype": "float32"}, torch.float32, torch.float32),
        ({"torch_dtype": "float16"}, torch.float32, torch.float16),  # transformers 4's key
        ({"dtype": "bfloat16"}, torch.float32, torch.bfloat16),  # (transformers casts by it too)
        ({"architectures": ["BertModel"]}, torch.float32, torch.float32),  # none named: the data's
        ({"architectures": ["BertModel"]}, torch.float64, torch.bfloat16),
        (None, torch.float32, torch.bfloat16),  # no config: as before
    ],
    ids=["dtype", "torch_dtype", "bf16", "unnamed", "unnamed-f64", "no-config"],
)
def test_without_dtype_the_weights_take_what_transformers_loads_the_folder_as(
    tmp_path: Path, config: dict[str, Any] | None, plain: torch.dtype, want: torch.dtype
) -> None:
    src = _fp8_folder(tmp_path / "src", config, plain)
    source = open_source(str(src))
    try:
        assert dequantized_dtype_of(source, None) == want
        assert dequantized_dtype_of(source, torch.float16) == torch.float16  # --dtype decides
    finally:
        source.close()
    if config is None:
        return
    out = tmp_path / "out"
    parallel_dcp.convert(src, out, to="safetensors", dequantize=True, workers=1)
    held = st.load_file(out / "model.safetensors")
    assert held["b.weight"].dtype == want and held["a.norm.weight"].dtype == plain
    said = json.loads((out / "config.json").read_text())
    assert (said["dtype"], said["torch_dtype"]) == (str(want).removeprefix("torch."),) * 2
    assert parallel_dcp.verify(out, against=src, dequantize=True).ok
