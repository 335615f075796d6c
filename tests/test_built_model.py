"""One child process answers every question a conversion asks of the model transformers builds
(jobs/built_model.py): with both ``--dtype`` and ``--quantize fp8-block`` it started two, each
importing transformers (seconds, 270-380 MiB) and building the same model. And a config.json
beside a weights file named as the source, whose model has none of the file's names, is refused
where it would decide what is kept in float32 or quantized (it decided in silence). A stand-in
``transformers`` package on the path plays the installed library, and counts its imports (the
client suite runs the real one)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

import parallel_dcp
from parallel_dcp.jobs import built_model

ROUTER, PROJ, EMBED = "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.up_proj.weight", "model.embed.weight"

# A model class of the stand-in: a router its strict list keeps in float32 (nn.Linear, so only that
# list keeps it out of FP8), a plain projection, an embedding; each import leaves a line in COUNT.
STAND_IN = """
import os
from torch import nn
with open(os.environ["COUNT"], "a") as count:
    count.write("imported\\n")

class PreTrainedModel(nn.Module):
    pass

class RouterConfig:
    def __init__(self, **values):
        self.__dict__.update(values)

    @classmethod
    def from_dict(cls, values):
        return cls(**values)

class RouterForCausalLM(PreTrainedModel):
    config_class = RouterConfig
    base_model_prefix = "model"
    _keep_in_fp32_modules_strict = ["gate"]

    def __init__(self, config):
        super().__init__()
        self.model = nn.Module()
        self.model.embed = nn.Embedding(64, 64)
        layer = nn.Module()
        layer.mlp = nn.Module()
        layer.mlp.gate = nn.Linear(64, 8, bias=False)
        layer.mlp.up_proj = nn.Linear(64, 64, bias=False)
        self.model.layers = nn.ModuleList([layer])
"""


@pytest.fixture
def imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in installed (for this process's children only), and the file that counts its imports."""
    site = tmp_path / "site"
    (site / "transformers").mkdir(parents=True)
    (site / "transformers" / "__init__.py").write_text(STAND_IN)
    count = tmp_path / "imports"
    count.write_text("")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("COUNT", str(count))
    monkeypatch.delitem(sys.modules, "transformers", raising=False)
    monkeypatch.setattr(built_model, "_ANSWERS", {})
    return count


def _source(folder: Path, weights: dict[str, torch.Tensor], config: dict[str, object]) -> Path:
    folder.mkdir()
    st.save_file(weights, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _router(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(*shape, generator=g) for name, shape in [(ROUTER, (8, 64)), (PROJ, (64, 64))]}
    weights[EMBED] = torch.randn(64, 64, generator=g)
    return _source(tmp_path / "src", weights, {"architectures": ["RouterForCausalLM"], "model_type": "router"})


def _held(folder: Path) -> dict[str, torch.Tensor]:
    held: dict[str, torch.Tensor] = {}
    for file in folder.glob("*.safetensors"):
        held |= st.load_file(file)
    return held


def test_a_conversion_with_dtype_and_quantize_starts_one_child(tmp_path: Path, imports: Path) -> None:
    src = _router(tmp_path)
    parallel_dcp.convert(src, tmp_path / "out", to="safetensors", dtype="bfloat16", quantize="fp8-block:32", workers=1)
    assert imports.read_text().splitlines() == ["imported"]  # (two before: one per option)
    assert "transformers" not in sys.modules
    held, original = _held(tmp_path / "out"), st.load_file(src / "model.safetensors")
    # the strict list keeps the router float32 and out of FP8; the FP8 layers quantize the projection only
    assert torch.equal(held[ROUTER], original[ROUTER])
    assert held[PROJ].dtype == torch.float8_e4m3fn and PROJ + "_scale_inv" in held
    assert held[EMBED].dtype == torch.bfloat16 and EMBED + "_scale_inv" not in held
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["modules_to_not_convert"] == ["model.embed", "model.layers.0.mlp.gate"]


@pytest.mark.parametrize("options", [{"dtype": "bfloat16"}, {"quantize": "fp8-block:32"}], ids=["dtype", "quantize"])
def test_one_option_asks_only_its_own_question(tmp_path: Path, imports: Path, options: dict[str, str]) -> None:
    asked: list[list[str]] = []
    read = built_model._read_apart

    def spy(
        class_name: str, config: dict[str, object], questions: list[str], limit: int | None, keys: list[str]
    ) -> object:
        asked.append(questions)
        return read(class_name, config, questions, limit, keys)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(built_model, "_read_apart", spy)
        parallel_dcp.convert(_router(tmp_path), tmp_path / "out", to="safetensors", workers=1, **options)
    own = built_model.FLOAT32_LISTS if "dtype" in options else built_model.FP8_LAYERS
    assert asked == [sorted([own, built_model.LOADED_NAMES])]  # (the names it loads the keys as: one child)
    assert imports.read_text().splitlines() == ["imported"]


def _bert_beside_router_config(tmp_path: Path) -> Path:
    """Another model's weights (a BERT's names) as other.safetensors, beside the router's config.json."""
    src = _router(tmp_path)
    g = torch.Generator().manual_seed(1)
    names = ["bert.embeddings.word_embeddings.weight", "bert.encoder.layer.0.attention.self.query.weight"]
    st.save_file({n: torch.randn(64, 64, generator=g) for n in names}, src / "other.safetensors")
    return src / "other.safetensors"


@pytest.mark.parametrize(
    "options",
    [{"dtype": "bfloat16"}, {"quantize": "fp8-block:32"}, {"dtype": "bfloat16", "quantize": "fp8-block:32"}],
    ids=["dtype", "quantize", "both"],
)
def test_a_config_beside_the_file_of_another_model_is_refused(
    tmp_path: Path, imports: Path, options: dict[str, str]
) -> None:
    """A T5's config.json beside a BERT's file kept BERT's word_embeddings float32 by T5's ``wo``
    pattern, in silence; ``--quantize`` judged the file by another model's layers and wrote that
    model's config.json beside the BERT's weights. Here the router's "gate" matches a BERT name."""
    other = _bert_beside_router_config(tmp_path)
    if "dtype" in options:  # (a list that matches a name of the file: the config would decide)
        st.save_file(
            {**st.load_file(other), "bert.pooler.gate.weight": torch.zeros(8, 64)}, other.parent / "other.safetensors"
        )
    with pytest.raises(parallel_dcp.ConfigMismatchError) as refused:
        parallel_dcp.convert(other, tmp_path / "out", to="safetensors", workers=1, **options)
    message = str(refused.value)
    assert str(other) in message and str(other.parent / "config.json") in message
    assert "RouterForCausalLM (model_type 'router') has none of the file's" in message
    assert "Name the folder" in message and "move other.safetensors to a folder of its own" in message
    assert not (tmp_path / "out").exists()
    assert imports.read_text().splitlines() == ["imported"]


def test_a_file_beside_its_own_config_is_judged_by_it_as_its_folder_is(tmp_path: Path, imports: Path) -> None:
    """The model's own weights file named alone (``SRC/model.safetensors``): kept and quantized as
    for the folder, the checkpoint's names lacking the ``model.`` prefix included."""
    src = _router(tmp_path)
    unprefixed = tmp_path / "unprefixed"
    unprefixed.mkdir()
    st.save_file(
        {k.removeprefix("model."): v for k, v in st.load_file(src / "model.safetensors").items()},
        unprefixed / "model.safetensors",
    )
    (unprefixed / "config.json").write_text((src / "config.json").read_text())
    both = {"dtype": "bfloat16", "quantize": "fp8-block:32"}
    parallel_dcp.convert(src, tmp_path / "folder", to="safetensors", workers=1, **both)
    parallel_dcp.convert(src / "model.safetensors", tmp_path / "file", to="safetensors", workers=1, **both)
    parallel_dcp.convert(unprefixed / "model.safetensors", tmp_path / "bare", to="safetensors", workers=1, **both)
    folder, file, bare = _held(tmp_path / "folder"), _held(tmp_path / "file"), _held(tmp_path / "bare")
    assert folder.keys() == file.keys() and all(torch.equal(folder[k], file[k]) for k in folder)
    assert bare[ROUTER.removeprefix("model.")].dtype == torch.float32
    assert bare[PROJ.removeprefix("model.")].dtype == torch.float8_e4m3fn
    assert "transformers" not in sys.modules


def test_a_config_whose_lists_decide_nothing_for_the_file_is_not_refused(tmp_path: Path, imports: Path) -> None:
    """Beside another model's file, a config whose lists match none of its names decides nothing
    for ``--dtype``: every floating tensor is cast, as with no config at all."""
    other = _bert_beside_router_config(tmp_path)
    parallel_dcp.convert(other, tmp_path / "out", to="safetensors", dtype="bfloat16", workers=1)
    assert {v.dtype for v in _held(tmp_path / "out").values()} == {torch.bfloat16}
