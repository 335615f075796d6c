"""transformers 5.25 loads what `parallel-dcp convert` writes from a Hugging Face folder exactly as it
loads the original (issue 29, item 6): plain conversions, through DCP and back, and `--dtype` casts.

The judge is transformers' own path: ``from_pretrained(original, dtype=X)``. Our output, loaded with
transformers' defaults (``dtype="auto"``: it reads ``config.json``'s ``dtype``), must give the same
parameters bit for bit, the same dtype and the same outputs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import assert_params_equal, assert_tensor_equal, load_checked


def convert_routes(run_cli: Callable[..., object], src: Path, out: Path, route: str, fmt: str, *extra: str) -> Path:
    """HF folder -> OUT (a sharded folder of FMT) directly, or through a DCP checkpoint and back."""
    if route == "direct":
        run_cli("convert", src, out, "--to", fmt, *extra)
    else:
        dcp = out.with_name(out.name + "-dcp")
        run_cli("convert", src, dcp)
        run_cli("convert", dcp, out, "--to", fmt, "--copy-files-from", src, *extra)
    return out


def load_causal_lm(path: Path, **kwargs: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return load_checked(AutoModelForCausalLM, path, **kwargs)


def load_encoder(path: Path, **kwargs: object) -> torch.nn.Module:
    from transformers import AutoModel

    return load_checked(AutoModel, path, **kwargs)


def llama_logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(1, 17).reshape(2, 8) % model.config.vocab_size
    with torch.no_grad():
        return model(input_ids=ids).logits


def encoder_hidden_states(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 102, 0], [101, 2023, 2003, 2178, 6251, 1012, 2182, 102]])
    ids = ids % model.config.vocab_size
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=(ids != 0).long()).last_hidden_state


MODELS = {
    "llama": ("llama_dir", load_causal_lm, llama_logits),
    "bert": ("bert_dir", load_encoder, encoder_hidden_states),
    "minilm": ("minilm_dir", load_encoder, encoder_hidden_states),
}


# Each model kind through each route and output format would be 3 x 2 x 2 conversions per case; the
# suite runs in CI on two cores, so every route, format and model is covered, not every product.
PLAIN_CASES = [
    ("llama", "direct", "safetensors"),
    ("llama", "via-dcp", "safetensors"),
    ("llama", "direct", "torch"),
    ("bert", "direct", "safetensors"),
    ("minilm", "via-dcp", "safetensors"),
    ("minilm", "direct", "torch"),
]
DTYPE_CASES = [
    ("llama", "bfloat16", "direct", "safetensors"),
    ("llama", "float16", "direct", "safetensors"),
    ("llama", "bfloat16", "via-dcp", "safetensors"),
    ("llama", "float16", "via-dcp", "torch"),
    ("bert", "float16", "direct", "safetensors"),
    ("minilm", "bfloat16", "via-dcp", "safetensors"),
]


@pytest.mark.parametrize(("kind", "route", "fmt"), PLAIN_CASES)
def test_plain_conversion_loads_as_the_original(
    kind: str, route: str, fmt: str, request: pytest.FixtureRequest, run_cli: Callable[..., object], tmp_path: Path
) -> None:
    fixture, load, outputs = MODELS[kind]
    src: Path = request.getfixturevalue(fixture)
    out = convert_routes(run_cli, src, tmp_path / "out", route, fmt)

    expected, actual = load(src), load(out)
    assert actual.dtype == expected.dtype
    assert_params_equal(actual, expected)
    assert_tensor_equal(outputs(actual), outputs(expected), f"{kind} outputs")


@pytest.mark.parametrize(("kind", "dtype", "route", "fmt"), DTYPE_CASES)
def test_dtype_cast_loads_as_transformers_own_cast(
    kind: str,
    dtype: str,
    route: str,
    fmt: str,
    request: pytest.FixtureRequest,
    run_cli: Callable[..., object],
    tmp_path: Path,
) -> None:
    """`--dtype X` output, loaded with transformers' defaults, is `from_pretrained(original, dtype=X)`.

    transformers 5 takes the model's dtype from config.json's ``dtype`` (``torch_dtype`` only when
    ``dtype`` is absent), so a config.json that still names the source dtype loads the cast shards
    silently upcast: the parameters then differ in dtype from transformers' own cast.
    """
    fixture, load, outputs = MODELS[kind]
    src: Path = request.getfixturevalue(fixture)
    # via-dcp: the cast happens on the way out of DCP, and config.json comes from the source folder.
    out = convert_routes(run_cli, src, tmp_path / "out", route, fmt, "--dtype", dtype)

    config = json.loads((out / "config.json").read_text())
    source_config = json.loads((src / "config.json").read_text())
    if {"dtype", "torch_dtype"} & source_config.keys():  # both, equal, when the source named either
        assert (config.get("dtype"), config.get("torch_dtype")) == (dtype, dtype), "config.json names another dtype"

    expected, actual = load(src, dtype=getattr(torch, dtype)), load(out)
    assert actual.dtype == getattr(torch, dtype)
    assert_params_equal(actual, expected)
    assert_tensor_equal(outputs(actual), outputs(expected), f"{kind} outputs in {dtype}")
