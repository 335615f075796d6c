"""``--dtype`` and ``--quantize`` decide on the names transformers loads a checkpoint's keys as
(jobs/loaded_names.py; review s17 F8, F9): transformers 5 renames keys on load and matches its float32
lists and swaps its FP8 layers by the renamed names, where we matched the checkpoint's. And where a
key's loaded name is not a parameter, or cannot be known, the safe side: ``--dtype`` keeps it as it
is, ``--quantize`` leaves it plain and lists it in ``modules_to_not_convert``, each with a warning.

A stand-in ``transformers`` package on the path plays the installed library, with its own
``conversion_mapping`` and ``core_model_loading`` (the client suite runs the real one)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

import parallel_dcp
from parallel_dcp.jobs import built_model

# The checkpoint's names, and what the stand-in's mapping renames them to on load.
ROUTER = "layers.0.ffn.w_router.weight"  # -> model.layers.0.mlp.gate.weight: strict float32, plain for FP8
UP = "layers.0.ffn.w_up.weight"  # -> model.layers.0.mlp.up_proj.weight: an nn.Linear (FP8)
TABLE = "vte.weight"  # -> model.table.weight: an nn.Linear subclass, used as a table (plain for FP8)
STRAY = "extra.proj.weight"  # -> model.extra.proj.weight: no parameter of the model
NORM = "layers.0.ffn_norm.weight"  # not renamed by the mapping: the prefix put on (as from_pretrained)

STAND_IN = """
from torch import nn

class PreTrainedModel(nn.Module):
    pass

class RenamedConfig:
    model_type = "renamed"

    def __init__(self, **values):
        self.__dict__.update(values)

    @classmethod
    def from_dict(cls, values):
        return cls(**values)

class Table(nn.Linear):
    pass

class RenamedForCausalLM(PreTrainedModel):
    config_class = RenamedConfig
    base_model_prefix = "model"
    _keep_in_fp32_modules_strict = ["mlp.gate"]

    def __init__(self, config):
        super().__init__()
        if getattr(config, "unbuildable", False):
            raise ValueError("this config does not build")
        self.config = config
        self.model = nn.Module()
        self.model.table = Table(64, 64, bias=False)
        layer = nn.Module()
        layer.mlp = nn.Module()
        layer.mlp.gate = nn.Linear(64, 8, bias=False)
        layer.mlp.up_proj = nn.Linear(64, 64, bias=False)
        layer.ffn_norm = nn.LayerNorm(64, bias=False)
        self.model.layers = nn.ModuleList([layer])
"""

CORE_MODEL_LOADING = """
import re

class WeightTransform:
    def __init__(self, source, target):
        self.source, self.target = source, target

    def rename_source_key(self, key):
        renamed = re.sub(self.source, self.target, key)
        return renamed, (self.source if renamed != key else None)

class WeightRenaming(WeightTransform):
    pass

class WeightConverter(WeightTransform):
    pass

def rename_source_key(key, renamings, converters, base_model_prefix=None, meta_state_dict=None):
    for renaming in renamings:
        key, _ = renaming.rename_source_key(key)
    pattern = None
    for converter in converters:
        key, pattern = converter.rename_source_key(key)
        if pattern is not None:
            break
    if meta_state_dict is not None and base_model_prefix and f"{base_model_prefix}.{key}" in meta_state_dict:
        key = f"{base_model_prefix}.{key}"
    return key, pattern
"""

CONVERSION_MAPPING = """
import os
from transformers.core_model_loading import WeightConverter, WeightRenaming

def get_checkpoint_conversion_mapping(name):
    if name not in ("RenamedForCausalLM", "renamed"):
        return None
    return [WeightRenaming(r"^layers\\.", "model.layers."), WeightRenaming(r"\\.ffn\\.w_up\\.", ".mlp.up_proj."),
            WeightConverter(r"\\.ffn\\.w_router\\.", ".mlp.gate."), WeightRenaming(r"^vte\\.", "model.table."),
            WeightRenaming(r"^extra\\.", "model.extra.")]

def get_model_conversion_mapping(model):
    if os.environ.get("STAND_IN_MAPPING_FAILS"):
        raise RuntimeError("the mapping cannot be read")
    return get_checkpoint_conversion_mapping(type(model).__name__) or []
"""


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in installed (for this process's children only)."""
    package = tmp_path / "site" / "transformers"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN)
    (package / "core_model_loading.py").write_text(CORE_MODEL_LOADING)
    (package / "conversion_mapping.py").write_text(CONVERSION_MAPPING)
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.setenv("PYTHONPATH", str(package.parent))
    monkeypatch.delitem(sys.modules, "transformers", raising=False)
    monkeypatch.setattr(built_model, "_ANSWERS", {})


def _source(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    shapes = {ROUTER: (8, 64), UP: (64, 64), TABLE: (64, 64), STRAY: (64, 64), NORM: (64,)}
    folder = tmp_path / "src"
    folder.mkdir()
    st.save_file({k: torch.randn(*s, generator=g) for k, s in shapes.items()}, folder / "model.safetensors")
    config = {"architectures": ["RenamedForCausalLM"], "model_type": "renamed"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_dtype_keeps_what_the_list_names_under_the_loaded_name(tmp_path: Path, stand_in: None) -> None:
    src = _source(tmp_path)
    parallel_dcp.convert(src, tmp_path / "out", to="safetensors", dtype="bfloat16", workers=1)
    held, original = st.load_file(tmp_path / "out" / "model.safetensors"), st.load_file(src / "model.safetensors")
    # "mlp.gate" names the router only as transformers loads it (model.layers.0.mlp.gate.weight)
    assert torch.equal(held[ROUTER], original[ROUTER])
    assert {held[k].dtype for k in (UP, TABLE, STRAY, NORM)} == {torch.bfloat16}


def test_dtype_keeps_a_tensor_whose_loaded_name_cannot_be_known(
    tmp_path: Path, stand_in: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAND_IN_MAPPING_FAILS", "1")
    src = _source(tmp_path)
    with pytest.warns(UserWarning, match=r"could not tell the names transformers loads 5 tensors.*cannot be read"):
        parallel_dcp.convert(src, tmp_path / "out", to="safetensors", dtype="bfloat16", workers=1)
    held, original = st.load_file(tmp_path / "out" / "model.safetensors"), st.load_file(src / "model.safetensors")
    assert all(torch.equal(held[k], original[k]) for k in original)  # kept as they are: none rounded


def test_quantize_only_what_loads_into_an_fp8_layer_and_lists_the_rest_by_both_names(
    tmp_path: Path, stand_in: None
) -> None:
    src = _source(tmp_path)
    with pytest.warns(UserWarning, match=r"1 weights are left unquantized.*extra\.proj"):
        parallel_dcp.convert(src, tmp_path / "out", to="safetensors", quantize="fp8-block:32", workers=1)
    held = st.load_file(tmp_path / "out" / "model.safetensors")
    # the nn.Linear modules they load into (the strict list is no FP8 rule: transformers' FP8 path
    # leaves only _keep_in_fp32_modules plain)
    assert sorted(k for k in held if k.endswith("_scale_inv")) == sorted([UP + "_scale_inv", ROUTER + "_scale_inv"])
    assert held[TABLE].dtype == held[STRAY].dtype == torch.float32  # (the table: plain in transformers)
    listed = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    # by the checkpoint's names and by those transformers matches the list against
    assert listed["modules_to_not_convert"] == ["extra.proj", "model.table", "vte"]


def test_a_model_that_does_not_build_keeps_and_leaves_plain_what_its_class_renames(
    tmp_path: Path, stand_in: None
) -> None:
    """Unbuilt, the class's own mapping still says which keys it renames, not to what: those are
    unknown, kept by ``--dtype`` and left plain by ``--quantize``; the others go by their names."""
    src = tmp_path / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    weights = {k: torch.randn(64, 64, generator=g) for k in (UP, "head.proj.weight")}
    st.save_file(weights, src / "model.safetensors")
    config = {"architectures": ["RenamedForCausalLM"], "model_type": "renamed", "unbuildable": True}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match=r"could not tell the names transformers loads 1 tensors"):
        parallel_dcp.convert(src, tmp_path / "cast", to="safetensors", dtype="bfloat16", workers=1)
    cast = st.load_file(tmp_path / "cast" / "model.safetensors")
    assert torch.equal(cast[UP], weights[UP]) and cast["head.proj.weight"].dtype == torch.bfloat16
    with pytest.warns(UserWarning, match=r"1 weights are left unquantized.*w_up"):
        parallel_dcp.convert(src, tmp_path / "fp8", to="safetensors", quantize="fp8-block:32", workers=1)
    held = st.load_file(tmp_path / "fp8" / "model.safetensors")
    assert held[UP].dtype == torch.float32 and held["head.proj.weight"].dtype == torch.float8_e4m3fn
