"""A folder source means the weights transformers 5.25 loads from it (review s15 rev1 F9, F5).

- F9: ``model.safetensors`` (seed 1) beside an older sharded upload's index and shards (seed 0), as
  ``upload_folder`` leaves them: transformers loads ``model.safetensors``; so must our conversion.
- F5: ``pytorch_model.bin`` (the model) beside a PEFT adapter's ``adapter_model.safetensors`` and
  ``adapter_config.json``: transformers loads ``pytorch_model.bin``; our conversion did the adapter.

Each converts the folder to a sharded safetensors folder and loads it in transformers, equal bit for
bit to ``from_pretrained`` of the source folder itself.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_params_equal, load_checked, make_llama, run_parallel_dcp

transformers = pytest.importorskip("transformers")


def test_model_safetensors_before_an_index_beside_it(tmp_path: Path) -> None:
    old = make_llama(tmp_path / "old", seed=0)
    transformers.LlamaForCausalLM.from_pretrained(old).save_pretrained(old, max_shard_size="40KB")
    (old / "model.safetensors").unlink()  # (save_pretrained of a sharded model leaves the index and shards)
    assert (old / "model.safetensors.index.json").exists()
    new = make_llama(tmp_path / "new", seed=1)
    repo = tmp_path / "repo"
    shutil.copytree(old, repo)
    shutil.copy(new / "model.safetensors", repo / "model.safetensors")

    expected = load_checked(transformers.LlamaForCausalLM, repo)
    assert_params_equal(expected, load_checked(transformers.LlamaForCausalLM, new))  # (what transformers reads)
    run_parallel_dcp("convert", repo, tmp_path / "out", "--to", "safetensors", "--shard-size", "40KB")
    assert_params_equal(load_checked(transformers.LlamaForCausalLM, tmp_path / "out"), expected)


def test_pytorch_model_bin_beside_a_peft_adapter(tmp_path: Path) -> None:
    source = make_llama(tmp_path / "source", seed=0)
    model = load_checked(transformers.LlamaForCausalLM, source)
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(source / "config.json", repo)
    torch.save(model.state_dict(), repo / "pytorch_model.bin")
    from safetensors.torch import save_file

    save_file({"base_model.model.lm_head.lora_A.weight": torch.ones(4, 64)}, repo / "adapter_model.safetensors")
    (repo / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')

    expected = load_checked(transformers.LlamaForCausalLM, repo)
    assert_params_equal(expected, model)
    run_parallel_dcp("convert", repo, tmp_path / "out", "--to", "safetensors")
    assert_params_equal(load_checked(transformers.LlamaForCausalLM, tmp_path / "out"), expected)
