"""``--quantize fp8-block``'s default rule against the modules transformers 5.25's FP8 path replaces
(review s16 F5).

transformers swaps ``nn.Linear`` modules for ``FP8Linear`` (``replace_with_fp8_linear``), but for
those ``modules_to_not_convert`` or the class's ``_keep_in_fp32_modules`` name; every other module
(an ``nn.Embedding``, GPT-2's ``Conv1D``) loads the stored tensor as it is. Where it runs FP8 (a GPU
of capability >= 8.9) it does not dequantize, so a weight quantized outside those layers loads as
raw e4m3 codes (up to 448). That load is emulated here on the CPU as the reviewer did: with
``validate_environment`` (which switches a GPU-less machine to dequantizing) made a no-op.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import assert_params_equal, assert_tensor_equal

BLOCK = 32


@pytest.fixture
def fp8_path_without_dequantizing(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' non-dequantizing FP8 load (what it does on a GPU), on this CPU."""
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None)


def test_t5_embeddings_and_kept_modules_stay_plain_and_load_as_the_original(
    run_cli: Callable[..., object], tmp_path: Path, fp8_path_without_dequantizing: None
) -> None:
    """T5's ``shared`` and ``relative_attention_bias`` are Embeddings (no 'embed' in their names) and
    its ``wo`` is in ``_keep_in_fp32_modules``: transformers keeps all three plain. Our output must
    too, list them in ``modules_to_not_convert``, and quantize the rest (the FP8Linear layers)."""
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.integrations.finegrained_fp8 import FP8Linear

    config = T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4, decoder_start_token_id=0
    )
    torch.manual_seed(0)
    T5ForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    run_cli("convert", tmp_path / "bf16", tmp_path / "fp8", "--to", "safetensors", "--quantize", f"fp8-block:{BLOCK}")

    skipped = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"][
        "modules_to_not_convert"
    ]
    assert "shared" in skipped
    assert any(n.endswith("relative_attention_bias") for n in skipped), skipped
    assert any(n.endswith("DenseReluDense.wo") for n in skipped), skipped

    original = T5ForConditionalGeneration.from_pretrained(tmp_path / "bf16").state_dict()
    model, info = T5ForConditionalGeneration.from_pretrained(tmp_path / "fp8", output_loading_info=True)
    assert not any(info.values()), f"load report: {info}"
    fp8 = {name for name, module in model.named_modules() if isinstance(module, FP8Linear)}
    assert fp8, "nothing was loaded into FP8 layers"
    loaded = model.state_dict()
    for name, weight in original.items():
        module = name.rsplit(".", 1)[0]
        got = loaded[name]
        if module in fp8 and name.endswith(".weight"):
            scale = loaded[module + ".weight_scale_inv"]
            blocks = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            values = got.float() * blocks[: got.shape[0], : got.shape[1]]
            bound = weight.float().abs().max() * 2**-3  # e4m3: 3 mantissa bits
            assert (values - weight.float()).abs().max() <= bound, name
        else:  # plain: the original, bit for bit (never raw codes)
            assert_tensor_equal(got, weight, name)


def test_t5_dequantizing_load_equals_our_dequantize(run_cli: Callable[..., object], tmp_path: Path) -> None:
    """The CPU path (transformers dequantizes every pair) and ``--dequantize`` agree on the same output."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4, decoder_start_token_id=0
    )
    torch.manual_seed(1)
    T5ForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    run_cli("convert", tmp_path / "bf16", tmp_path / "fp8", "--to", "safetensors", "--quantize", f"fp8-block:{BLOCK}")
    run_cli("convert", tmp_path / "fp8", tmp_path / "deq", "--to", "safetensors", "--dequantize")
    assert_params_equal(
        T5ForConditionalGeneration.from_pretrained(tmp_path / "deq"),
        T5ForConditionalGeneration.from_pretrained(tmp_path / "fp8"),
    )


def test_gpt2_conv1d_layers_are_not_quantized(run_cli: Callable[..., object], tmp_path: Path) -> None:
    """GPT-2's attention and MLP are Conv1D, which transformers' FP8 never replaces, and its embeddings
    and tied head stay plain: the default rule has nothing to quantize, and says why, writing nothing."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    done = run_cli(
        "convert", tmp_path / "bf16", tmp_path / "fp8", "--to", "safetensors", "--quantize", "fp8-block", check=False
    )
    assert done.returncode != 0  # type: ignore[attr-defined]
    said = done.stderr  # type: ignore[attr-defined]
    assert "GPT2LMHeadModel" in said and "c_attn" in said and "nn.Linear" in said, said
    assert not (tmp_path / "fp8").exists() or not any((tmp_path / "fp8").iterdir())
