"""The names transformers loads a checkpoint's keys as: what ``--dtype`` and ``--quantize`` decide on.

    checkpoint key                      ──▶  transformers 5 (conversion_mapping, core_model_loading)
      tok_embeddings.weight             ──▶  model.embed_tokens.weight        (a renaming)
      layers.1.feed_forward.gate_kernel ──▶  model.layers.1.mlp.gate.linear.weight  (a converter: transposed)
      vte.weight                        ──▶  model.multi_modal_projector.visual_embeddings_table.weight
      stray.weight                      ──▶  None (no parameter of the model: not loaded)

transformers 5 renames a checkpoint's keys on load (the model's ``conversion_mapping``: renamings,
and converters that merge, split or transpose), then matches its float32 lists
(``_keep_in_fp32_modules[_strict]``) and swaps its FP8 layers by the *renamed* names. Decided on the
checkpoint's spelling, Ergo's router and embedding were rounded where transformers keeps them float32,
and Ovis2.5's ``vte.weight`` quantized where transformers loads it into a module its FP8 path does not
replace. So the child of :mod:`parallel_dcp.jobs.built_model` that builds the model also maps every
key through transformers' own functions (``get_model_conversion_mapping``, ``rename_source_key``:
called, not copied), as ``from_pretrained`` does, base_model_prefix taken off or put on included. A
converter's key is loaded as its first target's name, the one transformers decides its dtype by.

Where that cannot be known (the model did not build, and the class's own mapping renames the key;
or transformers' functions raised), the key is ``unknown``: ``--dtype`` keeps it as it is and
``--quantize`` leaves it plain, each with a warning naming it. A transformers without these
functions (4.x) renames nothing: each key loads as itself, the prefix taken off or put on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CHILD_CODE", "LOADED_NAMES", "LoadedNames"]

LOADED_NAMES = "loaded_names"


@dataclass(frozen=True, slots=True)
class LoadedNames:
    """Each checkpoint key's name as transformers loads it, for the keys where that is not the key."""

    renamed: dict[str, str | None]  # key -> the parameter it loads as; None: no parameter (not loaded)
    unknown: frozenset[str]  # keys whose loaded name cannot be known (see the module doc)
    why: str | None = None  # why some are unknown

    def name(self, key: str) -> str | None:
        """The name transformers loads ``key`` as; None where it loads no parameter from it (and
        for an unknown key: ask :attr:`unknown` first)."""
        return self.renamed.get(key, key)

    @classmethod
    def of(cls, said: Any) -> LoadedNames | None:
        """The child's answer read (None: it gave none, as a class that is no model)."""
        if not isinstance(said, dict):
            return None
        renamed = said.get("renamed")
        unknown = said.get("unknown")
        if not isinstance(renamed, dict) or not isinstance(unknown, list):
            return None
        names = {k: v for k, v in renamed.items() if isinstance(k, str) and (v is None or isinstance(v, str))}
        why = said.get("why")
        return cls(names, frozenset(k for k in unknown if isinstance(k, str)), why if isinstance(why, str) else None)


# Run in the child (and in place) after the build, by built_model's ``answer``: ``built`` the model
# built on the meta device, or None where that failed; ``model_class`` and ``config`` what it was
# built from. Only the keys whose loaded name differs are answered (a few MiB for 50,000 keys).
CHILD_CODE = r"""
def loaded_names(transformers, built, model_class, config, keys):
    renamed, unknown = {}, []
    try:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping, get_model_conversion_mapping)
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # (transformers 4: no renames on load)
        get_model_conversion_mapping = None
    if built is None:  # the class's own renames cannot be placed: the keys they touch are unknown
        if get_model_conversion_mapping is None:
            return {"renamed": {}, "unknown": [], "why": None}
        try:
            mapping = (get_checkpoint_conversion_mapping(model_class.__name__)
                       or get_checkpoint_conversion_mapping(config.get("model_type")) or [])
            for key in keys:
                if any(t.rename_source_key(key)[0] != key for t in mapping):
                    unknown.append(key)
        except Exception as error:
            return {"renamed": {}, "unknown": list(keys), "why": f"{type(error).__name__}: {error}"[:300]}
        return {"renamed": {}, "unknown": unknown, "why": "the model did not build" if unknown else None}
    model = built.state_dict()  # (meta tensors: names only)
    prefix = getattr(built, "base_model_prefix", "") or ""
    if get_model_conversion_mapping is None:
        for key in keys:
            stripped = key[len(prefix) + 1:] if prefix and key.startswith(prefix + ".") else None
            name = key if key in model else stripped if stripped in model else (
                f"{prefix}.{key}" if prefix and f"{prefix}.{key}" in model else None)
            if name != key:
                renamed[key] = name
        return {"renamed": renamed, "unknown": [], "why": None}
    try:
        mapping = get_model_conversion_mapping(built)
        renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        for key in keys:
            # as convert_and_load_state_dict_in_model renames a key, the fallback to its own name included
            name, _ = rename_source_key(key, renamings, converters, prefix, model)
            if name not in model and key in model:
                name, _ = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=model)
            name = name if name in model else None
            if name != key:
                renamed[key] = name
    except Exception as error:
        return {"renamed": {}, "unknown": list(keys), "why": f"{type(error).__name__}: {error}"[:300]}
    return {"renamed": renamed, "unknown": [], "why": None}
"""
