"""``--dtype`` against transformers' own cast for models whose class keeps modules in float32
(``_keep_in_fp32_modules_strict``: DeepSeek-V3's router ``gate.weight`` and its
``e_score_correction_bias``; ``_keep_in_fp32_modules`` for float16: T5's ``wo``).
``from_pretrained(src, dtype=X)`` keeps those with the source's float32 values; our output
held them cast, and transformers loaded them upcast again: rounded, with no warning (a router's
rounded bias picks other experts). Now they are kept, and every parameter equals transformers'
own cast bit for bit; ``verify --against SRC --dtype X`` passes on the result."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_params_equal


def _deepseek_v3() -> tuple[Any, Any]:
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
    )
    return transformers.DeepseekV3ForCausalLM, config


def _t5() -> tuple[Any, Any]:
    import transformers

    config = transformers.T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0
    )
    return transformers.T5ForConditionalGeneration, config


def _blip2_t5() -> tuple[Any, Any]:
    """A composite model (as Salesforce/blip2-flan-t5-xl): the class keeps ``query_tokens`` and
    ``qformer``; its T5 language model adds ``wo`` to the instance's list (``post_init``), which
    the class attributes did not show, and ``wo`` was written rounded (review s16 F1)."""
    import transformers

    text = transformers.T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4, decoder_start_token_id=0
    )
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = transformers.Blip2Config(
        vision_config={**small, "image_size": 16, "patch_size": 8},
        qformer_config={**small, "vocab_size": 64, "encoder_hidden_size": 32},
        text_config=text.to_dict(),
        num_query_tokens=4,
    )
    return transformers.Blip2ForConditionalGeneration, config


@pytest.mark.parametrize(
    ("make", "dtype", "kept"),
    [
        (_deepseek_v3, "bfloat16", "e_score_correction_bias"),
        (_t5, "float16", "DenseReluDense.wo.weight"),
        (_blip2_t5, "float16", "DenseReluDense.wo.weight"),
    ],
    ids=["deepseek-v3-bf16", "t5-fp16", "blip2-t5-fp16"],
)
def test_dtype_keeps_what_transformers_keeps_in_float32(
    run_cli: Callable[..., object], tmp_path: Path, make: Callable[[], tuple[Any, Any]], dtype: str, kept: str
) -> None:
    model_class, config = make()
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():  # a bias of zeros would round to itself
        for key, value in model.state_dict().items():
            if "e_score_correction_bias" in key:
                value.copy_(torch.randn_like(value))
    src = tmp_path / "src"
    model.save_pretrained(src)
    out = tmp_path / "out"
    run_cli("convert", src, out, "--to", "safetensors", "--dtype", dtype)
    own = model_class.from_pretrained(src, dtype=getattr(torch, dtype)).eval()
    ours = model_class.from_pretrained(out).eval()
    kept_keys = [k for k in own.state_dict() if kept in k]
    assert kept_keys and all(own.state_dict()[k].dtype == torch.float32 for k in kept_keys)
    assert_params_equal(ours, own)
    run_cli("verify", out, "--against", src, "--dtype", dtype)
