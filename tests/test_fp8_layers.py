"""``--quantize``'s default rule follows the modules transformers' FP8 path replaces (review s16 F5),
here with a stand-in for transformers (the main suite has none; tests_clients/hf/test_fp8_layers.py
runs the real one): a model class whose layers are an Embedding not named "embed", a module that
is not nn.Linear (as GPT-2's Conv1D), a Linear its ``_keep_in_fp32_modules`` names (as T5's "wo"),
and plain Linears. Only the plain Linears are quantized; the rest stay as they were and are listed
in ``modules_to_not_convert``."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import parallel_dcp
from parallel_dcp.jobs import built_model
from parallel_dcp.jobs.fp8_layers import Fp8Layers, fp8_layers


class Conv1D(nn.Module):  # GPT-2's: a [in, out] weight, not an nn.Linear
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))


class FakeConfig:
    def __init__(self, **values: object) -> None:
        self.__dict__.update(values)

    @classmethod
    def from_dict(cls, values: dict[str, object]) -> FakeConfig:
        return cls(**values)


class FakeForCausalLM(nn.Module):
    config_class = FakeConfig
    base_model_prefix = "model"
    _keep_in_fp32_modules = ("wo",)

    def __init__(self, config: FakeConfig) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.shared = nn.Embedding(64, 64)
        self.model.c_attn = Conv1D(64, 64)
        self.model.wo = nn.Linear(64, 64, bias=False)
        self.model.q_proj = nn.Linear(64, 64, bias=False)
        self.lm_head = nn.Linear(64, 64, bias=False)


@pytest.fixture
def fake_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("transformers")
    module.FakeForCausalLM = FakeForCausalLM  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers", module)


def test_classify_by_module_type_and_kept_list(fake_transformers: None) -> None:
    layers = fp8_layers({"architectures": ["FakeForCausalLM"]})
    assert isinstance(layers, Fp8Layers)
    assert layers.classify("model.q_proj.weight") is True
    assert layers.classify("q_proj.weight") is True  # a checkpoint without the base model's prefix
    assert layers.classify("model.shared.weight") is False
    assert layers.classify("model.c_attn.weight") is False
    assert layers.classify("model.wo.weight") is False
    assert layers.classify("model.renamed_on_load.weight") is None
    assert fp8_layers({"architectures": ["NoSuchModel"]}) == "transformers has no model class NoSuchModel"


def test_only_what_transformers_replaces_is_quantized(fake_transformers: None, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    names = ["model.shared", "model.c_attn", "model.wo", "model.q_proj", "lm_head"]
    tensors = {f"{n}.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16) for n in names}
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps({"architectures": ["FakeForCausalLM"], "model_type": "fake"}))

    parallel_dcp.convert(src, tmp_path / "out", to="safetensors", quantize="fp8-block:32", workers=1)

    out = {}
    for file in (tmp_path / "out").glob("*.safetensors"):
        out |= load_file(file)
    assert out["model.q_proj.weight"].dtype == torch.float8_e4m3fn
    for name in ["model.shared", "model.c_attn", "model.wo", "lm_head"]:
        assert f"{name}.weight_scale_inv" not in out
        assert torch.equal(out[f"{name}.weight"], tensors[f"{name}.weight"]), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["modules_to_not_convert"] == [
        "lm_head",
        "model.c_attn",
        "model.shared",
        "model.wo",
    ]


def test_a_model_with_no_linear_layer_is_refused_saying_why(fake_transformers: None, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    save_file({"model.c_attn.weight": torch.zeros(64, 64)}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"architectures": ["FakeForCausalLM"]}))
    with pytest.raises(parallel_dcp.QuantizationError, match=r"FakeForCausalLM loads none.*c_attn.*nn\.Linear"):
        parallel_dcp.convert(src, tmp_path / "out", to="safetensors", quantize="fp8-block:32", workers=1)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_without_transformers_the_names_decide_with_a_warning(tmp_path: Path) -> None:
    if "transformers" in sys.modules:
        pytest.skip("transformers is imported here")
    src = tmp_path / "src"
    src.mkdir()
    save_file({"model.q_proj.weight": torch.zeros(64, 64)}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.warns(UserWarning, match="could not tell which weights transformers' FP8 layers replace"):
        parallel_dcp.convert(src, tmp_path / "out", to="safetensors", quantize="fp8-block:32", workers=1)
    (file,) = (tmp_path / "out").glob("*.safetensors")
    assert load_file(file)["model.q_proj.weight"].dtype == torch.float8_e4m3fn


def test_the_child_that_builds_the_model_stays_under_the_memory_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child that imports transformers and builds the model is part of the job's tree: 374 MiB
    (a Llama-8B config) counted nowhere. It is read against the limit as the float32 lists' child
    is, stopped there, and the job refused before anything is written."""
    site = tmp_path / "site"
    (site / "transformers").mkdir(parents=True)
    (site / "transformers" / "__init__.py").write_text(
        "import time\n_held = b'x' * (96 * 2**20)  # (what importing transformers holds)\ntime.sleep(2)\n"
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.delitem(sys.modules, "transformers", raising=False)
    monkeypatch.setattr(built_model, "_ANSWERS", {})  # (no answer another test left for this class)
    src = tmp_path / "src"
    src.mkdir()
    save_file({"model.q_proj.weight": torch.zeros(64, 64)}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"architectures": ["FakeForCausalLM"]}))
    with pytest.raises(parallel_dcp.MemoryLimitExceeded, match=r"FakeForCausalLM.*passed the memory limit") as err:
        parallel_dcp.convert(
            src, tmp_path / "out", to="safetensors", quantize="fp8-block:32", workers=1, memory_limit="48MiB"
        )
    assert err.value.limit == 48 * 2**20 and err.value.measured > err.value.limit
    assert not (tmp_path / "out").exists()
    assert "transformers" not in sys.modules  # (read in a child, not imported here)


def test_copy_files_froms_config_linked_out_is_refused_before_the_model_is_built(
    fake_transformers: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The config.json of ``copy_files_from`` that the FP8 rule builds the model from is read by the
    one rule the copy reads it by: a link out of that folder was read with a plain open() and the
    model built from it before the copy refused it (review s17, minor)."""
    from parallel_dcp.jobs import quantization

    src = tmp_path / "src"
    src.mkdir()
    save_file({"model.q_proj.weight": torch.zeros(64, 64)}, str(src / "model.safetensors"))
    other = tmp_path / "other"
    other.mkdir()
    (tmp_path / "elsewhere.json").write_text(json.dumps({"architectures": ["FakeForCausalLM"]}))
    (other / "config.json").symlink_to(tmp_path / "elsewhere.json")
    built: list[object] = []
    monkeypatch.setattr(quantization, "fp8_layers", lambda *args, **kwargs: built.append(args))
    with pytest.raises(parallel_dcp.UnsafeCheckpointError, match=r"config\.json"):
        parallel_dcp.convert(
            src, tmp_path / "out", to="safetensors", quantize="fp8-block:32", workers=1, copy_files_from=other
        )
    assert built == []
    assert not (tmp_path / "out").exists()
