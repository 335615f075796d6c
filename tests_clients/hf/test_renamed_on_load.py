"""Models whose checkpoint names transformers 5.25 renames on load (its ``conversion_mapping``), against
transformers itself (review s17 F8, F9).

- ``--dtype bfloat16`` on Ergo and DeepSeek-V4 (release names ``tok_embeddings``, ``feed_forward.gate_kernel``,
  ``attn.wq_a``, ...): transformers matches ``_keep_in_fp32_modules_strict`` against the renamed keys,
  so its own bf16 load keeps the router, the embedding and DeepSeek-V4's ``attn_hc.fn`` float32; ours
  were matched against the checkpoint's names, cast, and loaded rounded. Now every parameter equals
  ``from_pretrained(src, dtype=bfloat16)`` bit for bit.
- ``--quantize fp8-block`` on Ovis2.5: ``vte.weight`` loads as ``visual_embeddings_table``, a module
  transformers' FP8 layers do not replace; it was quantized (raw codes on a GPU). Now the weights we
  quantize are exactly those loaded into the FP8Linear modules transformers builds for the output.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_params_equal, load_checked

BLOCK = 32


def _tiny(name: str) -> tuple[Any, Any]:
    import transformers

    config_class = getattr(transformers, f"{name}Config")
    values = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        n_routed_experts=4,
        first_k_dense_replace=1,
    )
    defaults = config_class()
    config = config_class(**{k: v for k, v in values.items() if hasattr(defaults, k)})
    return getattr(transformers, f"{name}ForCausalLM"), config


@pytest.mark.parametrize("name", ["Ergo", "DeepseekV4"])
def test_dtype_keeps_what_transformers_keeps_under_the_names_it_loads(
    name: str, run_cli: Callable[..., object], tmp_path: Path
) -> None:
    from safetensors import safe_open

    model_class, config = _tiny(name)
    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path / "src")
    with safe_open(tmp_path / "src" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    expected = load_checked(model_class, tmp_path / "src", dtype=torch.bfloat16)
    kept = {n for n, p in expected.named_parameters() if p.dtype == torch.float32}
    assert kept - keys  # (the case: some of what it keeps float32 it names otherwise than the release)

    run_cli("convert", tmp_path / "src", tmp_path / "out", "--to", "safetensors", "--dtype", "bfloat16")
    assert_params_equal(load_checked(model_class, tmp_path / "out", dtype=torch.bfloat16), expected)


def test_quantize_quantizes_exactly_what_transformers_loads_into_fp8_layers(
    run_cli: Callable[..., object], tmp_path: Path
) -> None:
    import transformers
    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    from transformers.integrations.finegrained_fp8 import FP8Linear
    from transformers.quantizers import AutoHfQuantizer

    text = dict(
        model_type="qwen3",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=256)
    config = transformers.Ovis2_5Config(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    transformers.Ovis2_5ForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    out = tmp_path / "fp8"
    run_cli("convert", tmp_path / "src", out, "--to", "safetensors", "--quantize", f"fp8-block:{BLOCK}")

    with safe_open(out / "model.safetensors", "pt") as f:
        quantized = [k.removesuffix("_scale_inv") for k in f.keys() if k.endswith(".weight_scale_inv")]  # noqa: SIM118
    assert "vte.weight" not in quantized

    # transformers' model for the output, as it builds it to load it (FP8Linear where it runs FP8)
    loaded_config = transformers.AutoConfig.from_pretrained(out)
    quantizer = AutoHfQuantizer.from_config(loaded_config.quantization_config, pre_quantized=True)
    with torch.device("meta"):
        model = transformers.Ovis2_5ForConditionalGeneration(loaded_config)
    quantizer._process_model_before_weight_loading(model)
    fp8_modules = {name for name, module in model.named_modules() if isinstance(module, FP8Linear)}

    # our quantized weights, by the names transformers loads them as
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    names = model.state_dict()
    loaded = {rename_source_key(k, renamings, converters, model.base_model_prefix, names)[0] for k in quantized}
    assert {n.removesuffix(".weight") for n in loaded} == fp8_modules
    listed = json.loads((out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.multi_modal_projector.visual_embeddings_table" in listed and "vte" in listed
