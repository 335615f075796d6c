"""A dequantized MXFP4 gpt-oss loads in transformers 5.25 equal, bit for bit, to transformers'
own dequantizing load of the MXFP4 folder (``Mxfp4Config(dequantize=True)``).

    tiny GptOssForCausalLM (random, bf16) ── its non-expert tensors + random MXFP4 experts ──▶ mx/
    mx/ ── parallel-dcp convert --dequantize --to safetensors ──▶ out/ ── from_pretrained(out)
    mx/ ── from_pretrained(mx, quantization_config=Mxfp4Config(dequantize=True))
                                                                  ▲ parameters and logits equal

The config is hidden = intermediate, as every released gpt-oss (2880), so ``down_proj`` is square
and would load transposed without a size mismatch. The main suite keeps what transformers holds
for this config in ``tests/fixtures/clients/gpt_oss_keys.json``; ``python
tests_clients/hf/test_gpt_oss_mxfp4.py --record`` rewrites it from the installed transformers.
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.quantized_checkpoints import (  # noqa: E402
    GPT_OSS_EXPERTS,
    GPT_OSS_KEYS,
    gpt_oss_fixture,
    gpt_oss_mxfp4_checkpoint,
)

transformers = pytest.importorskip("transformers")

TINY_GPT_OSS = {
    "hidden_size": 64,
    "intermediate_size": 64,  # = hidden: down_proj is square, as in the releases
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 256,
}


def _model(config: dict[str, Any], seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return transformers.GptOssForCausalLM(transformers.GptOssConfig(**config)).to(torch.bfloat16).eval()


def _held(model: Any) -> dict[str, Any]:
    return {
        k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in model.state_dict().items()
    }


def record() -> None:
    """Write the fixture from the installed transformers."""
    fixture = {
        "client": f"transformers {transformers.__version__}",
        "model": "GptOssForCausalLM",
        "config": TINY_GPT_OSS,
        "tensors": _held(_model(TINY_GPT_OSS)),
    }
    GPT_OSS_KEYS.parent.mkdir(parents=True, exist_ok=True)
    GPT_OSS_KEYS.write_text(json.dumps(fixture, indent=1) + "\n")


def test_fixture_is_what_transformers_holds() -> None:
    fixture = gpt_oss_fixture()
    assert fixture["client"] == f"transformers {transformers.__version__}"
    assert _held(_model(fixture["config"])) == fixture["tensors"]


def _mxfp4_folder(tmp_path: Path) -> Path:
    config = TINY_GPT_OSS | {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]}
    model = _model(TINY_GPT_OSS)
    mx = tmp_path / "mx"
    model.save_pretrained(tmp_path / "bf16")  # for config.json exactly as transformers writes it
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    experts = tuple(f".mlp.experts.{name}" for name in GPT_OSS_EXPERTS)
    plain = {k: v.contiguous() for k, v in model.state_dict().items() if not k.endswith(experts)}
    return gpt_oss_mxfp4_checkpoint(mx, config, plain)


def _convert(*args: str | Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "parallel_dcp", "convert", *map(str, args), "-q", "--workers", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, want in expected.items():
        got = actual[name]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        differ = int((got.reshape(-1).view(torch.uint8) != want.reshape(-1).view(torch.uint8)).sum())
        assert differ == 0, f"{name}: {differ} bytes differ"


def test_dequantized_mxfp4_loads_as_transformers_dequantizes(tmp_path: Path) -> None:
    mx = _mxfp4_folder(tmp_path)
    reference = transformers.GptOssForCausalLM.from_pretrained(
        mx, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.bfloat16
    ).eval()
    _convert(mx, tmp_path / "out", "--dequantize", "--to", "safetensors")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config
    ours, info = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.bfloat16, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    _assert_same(dict(ours.state_dict()), dict(reference.state_dict()))
    ids = torch.arange(12).reshape(1, 12) % TINY_GPT_OSS["vocab_size"]
    with torch.no_grad():
        assert torch.equal(ours.eval()(ids).logits, reference(ids).logits)


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    record()
