"""torchtitan 0.3.0 loads what ``--preset hf-llama3-to-torchtitan`` writes exactly as its own HF path gives.

Runs in the torchtitan venv of ``tools/test-clients`` (torchtitan==0.3.0, triton). A tiny Llama 3
with grouped-query attention (4 heads, 2 key/value heads, head_dim 16), random weights, in the
Hugging Face layout (safetensors shards + a hand-written config.json: transformers is not in this
venv), is converted by parallel_dcp's CLI, then:

- torchtitan's Llama 3 model, built on the meta device and materialized, loads the DCP output the
  way its checkpointer's model-only load does (``dcp.load`` of ``ModelWrapper.state_dict()``, then
  ``load_state_dict``); its state dict equals, bit for bit, the one its own HF path gives from the
  same folder (``Llama3StateDictAdapter.to_hf`` -> ``dcp.load`` with its HF storage reader ->
  ``from_hf``), as ``CheckpointManager.dcp_load(from_hf=True)`` does;
- with row-range chunks (``--chunk-size``) too, so q/k split into ranges are permuted right;
- back with ``--preset torchtitan-to-hf-llama3``, the safetensors equal ``Llama3StateDictAdapter.to_hf``
  of the model's state dict (and so the original folder), bit for bit;
- the pinned fixture of the main suite (tests/fixtures/clients/torchtitan_llama3_keys.json) holds
  exactly the names and shapes this torchtitan's model holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch
import torch.distributed.checkpoint as dcp

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "clients" / "torchtitan_llama3_keys.json"
TINY = json.loads(FIXTURE.read_text())["config"]  # the Hugging Face config.json of the tiny model


def titan_model(tied: bool = False) -> tuple[torch.nn.Module, Any]:
    """torchtitan 0.3.0's Llama 3 for ``TINY`` (``tied``: embeddings tied to the output head, as its
    Llama 3.2 1B), built on the meta device, then materialized on CPU."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    dim, vocab, heads = TINY["hidden_size"], TINY["vocab_size"], TINY["num_attention_heads"]
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True,
            n_layers=TINY["num_hidden_layers"],
            dim=dim,
            n_heads=heads,
            n_kv_heads=TINY["num_key_value_heads"],
            hidden_dim=TINY["intermediate_size"],
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=256, theta=TINY["rope_theta"], scaling="llama"),
            attn_backend="flex",
        ),
    )
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.fill_(float("nan"))  # anything a load does not write stays visible
    return model, config


def write_hf_llama(folder: Path, tied: bool = False) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama folder of ``TINY`` (two shards, index, config.json); its tensors.
    ``tied``: ``tie_word_embeddings`` and no ``lm_head.weight``, as Hugging Face saves a tied model."""
    g = torch.Generator().manual_seed(29)
    dim, inter, vocab = TINY["hidden_size"], TINY["intermediate_size"], TINY["vocab_size"]
    q_rows = TINY["num_attention_heads"] * TINY["head_dim"]
    kv_rows = TINY["num_key_value_heads"] * TINY["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, dim)}
    for i in range(TINY["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_rows, dim),
            p + "self_attn.k_proj.weight": (kv_rows, dim),
            p + "self_attn.v_proj.weight": (kv_rows, dim),
            p + "self_attn.o_proj.weight": (dim, q_rows),
            p + "mlp.gate_proj.weight": (inter, dim),
            p + "mlp.up_proj.weight": (inter, dim),
            p + "mlp.down_proj.weight": (dim, inter),
            p + "input_layernorm.weight": (dim,),
            p + "post_attention_layernorm.weight": (dim,),
        }
    shapes |= {"model.norm.weight": (dim,)} | ({} if tied else {"lm_head.weight": (vocab, dim)})
    tensors = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    folder.mkdir()
    names = list(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2]}
    halves["model-00002-of-00002.safetensors"] = names[len(names) // 2 :]
    weight_map = {}
    for file, keys in halves.items():
        st.save_file({k: tensors[k] for k in keys}, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(keys, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(TINY | {"tie_word_embeddings": tied}, indent=2))
    return tensors


def parallel_dcp(*args: str | Path) -> None:
    cmd = [sys.executable, "-m", "parallel_dcp", *map(str, args), "--workers", "2", "-q"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert run.returncode == 0, f"{' '.join(cmd)} failed:\n{run.stdout}\n{run.stderr}"


def titan_model_only_load(checkpoint: Path, tied: bool = False) -> dict[str, torch.Tensor]:
    """torchtitan's model-only load of a DCP checkpoint (CheckpointManager.dcp_load, from_hf=False)."""
    from torchtitan.components.checkpointer.base import ModelWrapper

    model, _ = titan_model(tied)
    wrapper = ModelWrapper(model)
    state_dict = wrapper.state_dict()
    dcp.load(state_dict, checkpoint_id=str(checkpoint))
    wrapper.load_state_dict(state_dict)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def titan_hf_load(folder: Path, tied: bool = False) -> dict[str, torch.Tensor]:
    """torchtitan's own HF load of the same folder (CheckpointManager.dcp_load, from_hf=True)."""
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    model, config = titan_model(tied)
    adapter = Llama3StateDictAdapter(config, str(folder))
    wrapper = ModelWrapper(model)
    hf_state_dict = adapter.to_hf(wrapper.state_dict())
    dcp.load(hf_state_dict, storage_reader=adapter.get_hf_storage_reader(str(folder)))
    wrapper.load_state_dict(adapter.from_hf(hf_state_dict))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for key, tensor in expected.items():
        got = actual[key]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, key
        assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), f"{key} differs"


def test_fixture_holds_torchtitans_names_and_shapes() -> None:
    model, _ = titan_model()
    held = [[k, list(v.shape)] for k, v in model.state_dict().items()]
    assert json.loads(FIXTURE.read_text())["keys"] == held


@pytest.mark.parametrize(
    ("chunk_size", "tied"), [(None, False), ("4KB", False), (None, True)], ids=["whole", "row-ranges", "tied"]
)
def test_hf_to_torchtitan_loads_as_torchtitans_own_hf_path(tmp_path: Path, chunk_size: str | None, tied: bool) -> None:
    write_hf_llama(tmp_path / "hf", tied)
    chunks = ["--chunk-size", chunk_size] if chunk_size else []
    parallel_dcp("convert", tmp_path / "hf", tmp_path / "titan", "--preset", "hf-llama3-to-torchtitan", *chunks)
    ours = titan_model_only_load(tmp_path / "titan", tied)
    theirs = titan_hf_load(tmp_path / "hf", tied)
    assert not any(t.isnan().any() for t in theirs.values())
    assert_bitwise_equal(ours, theirs)
    if chunk_size:  # the q/k weights were written as several row ranges
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(tmp_path / "titan")).read_metadata()
        assert len(metadata.state_dict_metadata["layers.0.attention.qkv_linear.wq.weight"].chunks) > 1


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_torchtitan_to_hf_equals_torchtitans_to_hf(tmp_path: Path, tied: bool) -> None:
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    original = write_hf_llama(tmp_path / "hf", tied)
    parallel_dcp("convert", tmp_path / "hf", tmp_path / "titan", "--preset", "hf-llama3-to-torchtitan")
    parallel_dcp(
        "convert",
        tmp_path / "titan",
        tmp_path / "back",
        "--to",
        "safetensors",
        "--preset",
        "torchtitan-to-hf-llama3",
        "--model-config",
        tmp_path / "hf" / "config.json",
    )
    ours: dict[str, torch.Tensor] = {}
    for file in sorted((tmp_path / "back").glob("*.safetensors")):
        ours |= st.load_file(file)
    _, config = titan_model(tied)
    expected = Llama3StateDictAdapter(config, None).to_hf(titan_model_only_load(tmp_path / "titan", tied))
    assert sorted(ours) == sorted(expected)
    assert_bitwise_equal({k: ours[k] for k in expected}, {k: v.contiguous() for k, v in expected.items()})
    assert_bitwise_equal({k: ours[k] for k in original}, original)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == TINY | {"tie_word_embeddings": tied}
