"""Small quantized checkpoints shaped like the real releases, and what stock torch reads from them.

FP8 (DeepSeek-V3 layout): ``model.safetensors.index.json`` with a ``weight_map``, weights in one
shard and their ``weight_scale_inv`` in the next, ``config.json`` with ``quantization_config``,
dimensions that are not multiples of 128 (partial edge blocks). MXFP4 (gpt-oss layout):
``*_blocks`` ``[E, N, G, 16]`` and ``*_scales`` ``[E, N, G]`` uint8, which dequantize to
transformers' expert layout ``[E, G * 32, N]`` (:func:`transformers_layout`); a whole tiny gpt-oss
in MXFP4 (:func:`gpt_oss_mxfp4_checkpoint`) for the key names and shapes transformers holds
(``tests/fixtures/clients/gpt_oss_keys.json``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

# name -> shape of the FP8 weights (rows, cols); edge blocks in both dimensions.
FP8_WEIGHTS = {
    "model.layers.0.self_attn.q_proj.weight": (200, 136),
    "model.layers.0.mlp.down_proj.weight": (136, 300),
    "model.layers.1.self_attn.q_proj.weight": (260, 136),
    "model.layers.1.mlp.experts.0.up_proj.weight": (128, 129),
}
PLAIN = {
    "model.embed_tokens.weight": ((50, 136), torch.bfloat16),
    "model.layers.0.input_layernorm.weight": ((136,), torch.bfloat16),
    "model.layers.1.mlp.gate.weight": ((4, 136), torch.bfloat16),
    "model.norm.weight": ((136,), torch.float32),
    "lm_head.weight": ((50, 136), torch.bfloat16),
}


def fp8_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """The FP8 weights and their scales (float32, small positive), by name."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, (rows, cols) in FP8_WEIGHTS.items():
        out[name] = (torch.randn(rows, cols, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[name + "_scale_inv"] = torch.rand(math.ceil(rows / 128), math.ceil(cols / 128), generator=g) * 0.01 + 1e-4
    # NaN (both signs), -0 and the largest codes, in the last (partial) block too
    codes = torch.tensor([0x7F, 0xFF, 0x80, 0x7E, 0xFE], dtype=torch.uint8)
    first = out[next(iter(FP8_WEIGHTS))].view(torch.uint8)
    first[0, :5] = codes
    first[-1, -5:] = codes
    return out


def plain_tensors(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=g).to(dtype) for name, (shape, dtype) in PLAIN.items()}


def write_hf(directory: Path, tensors: dict[str, torch.Tensor], shards: list[list[str]], config: Any = None) -> Path:
    """A Hugging Face directory: ``shards`` lists each shard's keys; index and config.json too."""
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in keys}, str(directory / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(keys, name)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def deepseek_config(block: int = 128) -> dict[str, Any]:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 136,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [block, block],
        },
    }


def fp8_checkpoint(directory: Path) -> Path:
    """An FP8 release: each scale in the shard after its weight's, plain tensors spread around."""
    tensors = fp8_weights() | plain_tensors()
    names = list(FP8_WEIGHTS)
    shards = [
        ["model.embed_tokens.weight", names[0], names[1] + "_scale_inv", "model.layers.0.input_layernorm.weight"],
        [names[0] + "_scale_inv", names[1], names[2], "model.layers.1.mlp.gate.weight"],
        [names[2] + "_scale_inv", names[3], "model.norm.weight"],
        [names[3] + "_scale_inv", "lm_head.weight"],
    ]
    return write_hf(directory, tensors, shards, deepseek_config())


def mxfp4_tensors(seed: int = 2) -> dict[str, torch.Tensor]:
    """gpt-oss-shaped MXFP4 pairs (every exponent but 255, so overflow and subnormals too) and a plain bias."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, (experts, rows, groups) in {
        "model.layers.0.mlp.experts.gate_up_proj": (3, 10, 5),
        "model.layers.0.mlp.experts.down_proj": (3, 6, 3),
    }.items():
        out[name + "_blocks"] = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=g)
        out[name + "_scales"] = torch.randint(0, 255, (experts, rows, groups), dtype=torch.uint8, generator=g)
        out[name + "_bias"] = torch.randn(experts, rows, generator=g).to(torch.bfloat16)
    return out


def mxfp4_checkpoint(directory: Path) -> Path:
    tensors = mxfp4_tensors()
    keys = sorted(tensors)
    blocks = [k for k in keys if k.endswith("_blocks")]
    rest = [k for k in keys if not k.endswith("_blocks")]
    config = {"quantization_config": {"quant_method": "mxfp4"}, "torch_dtype": "bfloat16"}
    return write_hf(directory, tensors, [blocks, rest], config)


GPT_OSS_KEYS = Path(__file__).parent / "fixtures" / "clients" / "gpt_oss_keys.json"
GPT_OSS_EXPERTS = ("gate_up_proj", "down_proj")  # the MXFP4 tensors of each layer's experts
# What the real gpt-oss releases leave in bf16.
GPT_OSS_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def gpt_oss_fixture() -> dict[str, Any]:
    """The tiny gpt-oss config and the tensors (name -> shape, dtype) transformers 5.25's
    ``GptOssForCausalLM`` holds for it (recorded by tests_clients/hf/test_gpt_oss_mxfp4.py)."""
    fixture: dict[str, Any] = json.loads(GPT_OSS_KEYS.read_text())
    return fixture


def gpt_oss_mxfp4_checkpoint(
    directory: Path, config: dict[str, Any], plain: dict[str, torch.Tensor], seed: int = 3
) -> Path:
    """A gpt-oss release in miniature: ``plain`` (every tensor but the experts' two projections,
    bf16) and, per layer, ``mlp.experts.{gate_up_proj,down_proj}_{blocks,scales}`` in gpt-oss's
    packed layout: ``gate_up_proj`` ``[E, 2 * intermediate, hidden / 32, 16]`` (a row per output),
    ``down_proj`` ``[E, hidden, intermediate / 32, 16]``. Exponents 118..130 keep values finite
    and the model's forward pass meaningful. ``config.json`` is ``config`` with the release's
    ``quantization_config``."""
    g = torch.Generator().manual_seed(seed)
    experts, hidden, inter = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    tensors = dict(plain)
    for layer in range(config["num_hidden_layers"]):
        for name, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            stem = f"model.layers.{layer}.mlp.experts.{name}"
            tensors.pop(stem, None)
            groups = cols // 32
            tensors[stem + "_blocks"] = torch.randint(
                0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=g
            )
            tensors[stem + "_scales"] = torch.randint(118, 131, (experts, rows, groups), dtype=torch.uint8, generator=g)
    keys = list(tensors)
    quantization = {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_NOT_CONVERTED}
    return write_hf(
        directory,
        tensors,
        [keys[: len(keys) // 2], keys[len(keys) // 2 :]],
        config | {"quantization_config": quantization},
    )


def transformers_layout(state: dict[str, torch.Tensor], src: Path) -> dict[str, torch.Tensor]:
    """``state`` (stock's dequantized MXFP4, ``[E, N, G * 32]``) with every expert tensor
    (4-D blocks in ``src``) transposed to transformers' ``[E, G * 32, N]``, as its own
    ``convert_moe_packed_tensors`` returns it (``out.transpose(1, 2).contiguous()``)."""
    from safetensors import safe_open

    experts = set()
    for shard in src.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            experts |= {
                k.removesuffix("_blocks")
                for k in f.keys()  # noqa: SIM118 (safe_open is not iterable)
                if k.endswith("_blocks") and len(f.get_slice(k).get_shape()) == 4
            }
    return {k: v.transpose(1, 2).contiguous() if k in experts else v for k, v in state.items()}


def stock_dequantized(src: Path, dtype: torch.dtype, block: int = 128) -> dict[str, torch.Tensor]:
    """What stock ``dcp.load`` with ``QuantizedHuggingFaceStorageReader`` gives for ``src``:
    tensors preallocated from its (dequantized) metadata, every key but the scales (MXFP4 experts
    in the gpt-oss reference loader's ``[E, N, G * 32]``: see :func:`transformers_layout`).

    MXFP4: torch 2.13's reader corrects the metadata's size but not its chunk (the packed
    ``[..., G, B]`` shape), so its planner reads only the first G values of each row. The
    reference corrects the chunk too, and the reader's own unpacking arithmetic runs unchanged.
    """
    reader = QuantizedHuggingFaceStorageReader(str(src), target_dtype=dtype, block_size=block)
    metadata = reader.read_metadata()
    state: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.endswith(("_scale_inv", "_scales")):
            continue
        assert isinstance(meta, TensorStorageMetadata)
        if key.endswith("_blocks"):
            for chunk in meta.chunks:
                chunk.sizes = meta.size  # the correction (the packed shape is the bug)
        quantized = key in reader._weight_scale_mapping
        state[key] = torch.empty(meta.size, dtype=dtype if quantized else meta.properties.dtype)
    original = reader.read_metadata
    reader.read_metadata = lambda: metadata  # type: ignore[method-assign]
    try:
        dcp.load(state, storage_reader=reader, no_dist=True)
    finally:
        reader.read_metadata = original  # type: ignore[method-assign]
    return {k.removesuffix("_blocks"): v for k, v in state.items()}
