"""The presets' definitions: what each one reads and writes, its rules, its transforms and the
keys its client holds (read from the client at the version named; pinned by tests/fixtures/clients).

A preset is data only; :mod:`parallel_dcp.jobs.presets` applies it to a source.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from parallel_dcp.errors import PresetError

__all__ = ["PRESETS", "Permute", "Preset", "get_preset"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Permute:
    """Rows of the source tensors matching ``key`` (a whole-name regex) permuted per head; the
    number of heads is ``config.json``'s ``heads`` field."""

    key: str
    heads: str
    to_interleaved: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Preset:
    """A named conversion for a client.

    Attributes:
        name: what users pass (``preset="hf-llama3-to-torchtitan"``).
        client, client_version: the library and version whose layout the output follows.
        reads, writes: the source and output layouts, in words.
        rules: rename rules (regex, template); every source key must match one, or be dropped.
        drop: whole-name regexes of source keys the client does not hold (left out of the output).
        permute: the row permutations applied (to source keys) before renaming.
        model_keys, layer_keys: every name the client's model holds (``{}`` in a layer key: the
            layer index, ``num_hidden_layers`` of them).
        tied_copy: with ``tie_word_embeddings`` in the config, (output name, source key) pairs:
            the output holds the name as a copy of the source key (a tied Hugging Face model has
            no ``lm_head.weight``; torchtitan's tied model holds both).
        tied_drop: with ``tie_word_embeddings``, whole-name regexes of source keys left out, and
            model keys the output does not hold (a tied Hugging Face model has no head of its own).
        writes_hf: the output is a Hugging Face layout (a sharded directory gets ``config.json``).
    """

    name: str
    client: str
    client_version: str
    reads: str
    writes: str
    rules: tuple[tuple[str, str], ...]
    drop: tuple[str, ...] = ()
    permute: tuple[Permute, ...] = ()
    model_keys: tuple[str, ...] = ()
    layer_keys: tuple[str, ...] = ()
    tied_copy: tuple[tuple[str, str], ...] = ()
    tied_drop: tuple[str, ...] = ()
    writes_hf: bool = False

    def describe(self) -> str:
        """One line: the name, the client and version, and what it converts."""
        return f"{self.name}: {self.reads} -> {self.writes} ({self.client} {self.client_version})"

    def expected_keys(self, layers: int, tied: bool = False) -> list[str]:
        """Every name the client's model holds, for a model of ``layers`` layers (``tied``: its
        embeddings tied to its output head)."""
        per_layer = [template.format(i) for i in range(layers) for template in self.layer_keys]
        keys = [*self.model_keys[:1], *per_layer, *self.model_keys[1:]]
        return [k for k in keys if not (tied and any(re.fullmatch(d, k) for d in self.tied_drop))]


_HF_LAYER = r"model\.layers\.(\d+)\."
_TT_LAYER = r"layers\.(\d+)\."
# (Hugging Face Llama name, torchtitan 0.3.0 Llama 3 name): per layer, then per model.
_LLAMA3_LAYER_NAMES = (
    ("self_attn.q_proj.weight", "attention.qkv_linear.wq.weight"),
    ("self_attn.k_proj.weight", "attention.qkv_linear.wk.weight"),
    ("self_attn.v_proj.weight", "attention.qkv_linear.wv.weight"),
    ("self_attn.o_proj.weight", "attention.wo.weight"),
    ("mlp.gate_proj.weight", "feed_forward.w1.weight"),
    ("mlp.down_proj.weight", "feed_forward.w2.weight"),
    ("mlp.up_proj.weight", "feed_forward.w3.weight"),
    ("input_layernorm.weight", "attention_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
)
_LLAMA3_MODEL_NAMES = (
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
)


def _llama3_pair() -> tuple[Preset, Preset]:
    hf_to_tt = tuple((_HF_LAYER + re.escape(hf), r"layers.\1." + tt) for hf, tt in _LLAMA3_LAYER_NAMES) + tuple(
        (re.escape(hf), tt) for hf, tt in _LLAMA3_MODEL_NAMES
    )
    tt_to_hf = tuple((_TT_LAYER + re.escape(tt), r"model.layers.\1." + hf) for hf, tt in _LLAMA3_LAYER_NAMES) + tuple(
        (re.escape(tt), hf) for hf, tt in _LLAMA3_MODEL_NAMES
    )
    client, version = "torchtitan", "0.3.0"
    to_titan = Preset(
        name="hf-llama3-to-torchtitan",
        client=client,
        client_version=version,
        reads="Hugging Face Llama 3 (LlamaForCausalLM safetensors + config.json)",
        writes="torchtitan Llama 3 model state dict (fused qkv_linear, q/k rows interleaved for its RoPE)",
        rules=hf_to_tt,
        # Rotary frequencies are recomputed by both models: old transformers checkpoints still hold them.
        drop=(_HF_LAYER + r"self_attn\.rotary_emb\.inv_freq",),
        permute=(
            Permute(key=_HF_LAYER + r"self_attn\.q_proj\.weight", heads="num_attention_heads", to_interleaved=True),
            Permute(key=_HF_LAYER + r"self_attn\.k_proj\.weight", heads="num_key_value_heads", to_interleaved=True),
        ),
        model_keys=("tok_embeddings.weight", "norm.weight", "lm_head.weight"),
        layer_keys=tuple(f"layers.{{}}.{tt}" for _, tt in _LLAMA3_LAYER_NAMES),
        tied_copy=(("lm_head.weight", "model.embed_tokens.weight"),),  # as its from_hf does
    )
    to_hf = Preset(
        name="torchtitan-to-hf-llama3",
        client="transformers",
        client_version="5.25.0",
        reads=f"torchtitan {version} Llama 3 model state dict (DCP)",
        writes="Hugging Face Llama 3 (LlamaForCausalLM; q/k rows in halves, as transformers holds them)",
        rules=tt_to_hf,
        permute=(
            Permute(
                key=_TT_LAYER + r"attention\.qkv_linear\.wq\.weight", heads="num_attention_heads", to_interleaved=False
            ),
            Permute(
                key=_TT_LAYER + r"attention\.qkv_linear\.wk\.weight", heads="num_key_value_heads", to_interleaved=False
            ),
        ),
        model_keys=("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"),
        layer_keys=tuple(f"model.layers.{{}}.{hf}" for hf, _ in _LLAMA3_LAYER_NAMES),
        tied_drop=(r"lm_head\.weight",),  # as its to_hf does
        writes_hf=True,
    )
    return to_titan, to_hf


PRESETS: Mapping[str, Preset] = MappingProxyType({p.name: p for p in _llama3_pair()})


def get_preset(name: str | Preset) -> Preset:
    """The preset called ``name`` (a :class:`Preset` is returned as it is).

    Raises:
        PresetError: no preset of that name (the known ones are listed).
    """
    if isinstance(name, Preset):
        return name
    if name not in PRESETS:
        raise PresetError(f"no preset {name!r}: known presets are {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
