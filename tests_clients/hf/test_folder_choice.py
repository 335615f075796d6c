"""A folder source means the weights transformers 5.25 loads from it (review s15 rev1 F9, F5).

- F9: ``model.safetensors`` (seed 1) beside an older sharded upload's index and shards (seed 0), as
  ``upload_folder`` leaves them: transformers loads ``model.safetensors``; so must our conversion.
- F5: ``pytorch_model.bin`` (the model) beside a PEFT adapter's ``adapter_model.safetensors`` and
  ``adapter_config.json``: transformers loads ``pytorch_model.bin``; our conversion did the adapter.
- s15 rev2 F1: ``config.json`` naming ``transformers_weights`` (a file, an index in a subfolder,
  ``adapter_model.bin``): transformers loads that, before ``model.safetensors``; we converted
  ``model.safetensors``, then refused the folder. A name transformers fails on, we refuse too.
- s15 rev2 F2: ``model.safetensors`` a dangling link or a folder beside an index and its shards:
  transformers loads the shards.
- s15 rev2 F5: no client name, HF shards without their index beside ``consolidated.safetensors``:
  transformers refuses the folder, and so do we (read together they were one model of both).
- the hub's layout of both sets, ``.bin`` and ``.safetensors`` (single or sharded, here with other
  values): transformers loads the safetensors.

Each converts the folder to a sharded safetensors folder and loads it in transformers, equal bit for
bit to ``from_pretrained`` of the source folder itself (each source built with other weights beside
the ones transformers loads, so a conversion of the wrong file cannot pass).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import assert_params_equal, load_checked, make_llama, run_parallel_dcp

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402 (after the skip, as transformers)


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
    save_file({"base_model.model.lm_head.lora_A.weight": torch.ones(4, 64)}, repo / "adapter_model.safetensors")
    (repo / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')

    expected = load_checked(transformers.LlamaForCausalLM, repo)
    assert_params_equal(expected, model)
    run_parallel_dcp("convert", repo, tmp_path / "out", "--to", "safetensors")
    assert_params_equal(load_checked(transformers.LlamaForCausalLM, tmp_path / "out"), expected)


def _sharded(source: Path, dest: Path) -> Path:
    """The model at ``source`` saved again by transformers into ``dest`` as an index and shards."""
    transformers.LlamaForCausalLM.from_pretrained(source).save_pretrained(dest, max_shard_size="40KB")
    if (dest / "model.safetensors").exists():  # (a sharded save leaves the index and its shards)
        (dest / "model.safetensors").unlink()
    assert (dest / "model.safetensors.index.json").exists()
    return dest


def _named(repo: Path, name: str) -> None:
    """``repo``'s config.json names ``name`` as ``transformers_weights``."""
    config = json.loads((repo / "config.json").read_text())
    config["transformers_weights"] = name
    (repo / "config.json").write_text(json.dumps(config, indent=2))


def _custom_file(repo: Path, other: Path) -> str:
    shutil.copy(other / "model.safetensors", repo / "custom.safetensors")
    return "custom.safetensors"


def _index_in_subfolder(repo: Path, other: Path) -> str:
    """An index in ``sub/``, its shards at the top: transformers names them from the folder."""
    sharded = _sharded(other, other.parent / "other-sharded")
    for shard in sharded.glob("model-*.safetensors"):
        shutil.copy(shard, repo / shard.name)
    (repo / "sub").mkdir()
    shutil.copy(sharded / "model.safetensors.index.json", repo / "sub" / "weights.safetensors.index.json")
    return "sub/weights.safetensors.index.json"


def _adapter_bin(repo: Path, other: Path) -> str:
    torch.save(load_checked(transformers.LlamaForCausalLM, other).state_dict(), repo / "adapter_model.bin")
    return "adapter_model.bin"


@pytest.mark.parametrize("lay_out", [_custom_file, _index_in_subfolder, _adapter_bin], ids=lambda f: f.__name__)
def test_the_file_config_json_names_is_the_one_converted(tmp_path: Path, lay_out: Callable[[Path, Path], str]) -> None:
    """``model.safetensors`` (seed 0) beside the weights config.json names (seed 1)."""
    repo = make_llama(tmp_path / "repo", seed=0)
    other = make_llama(tmp_path / "other", seed=1)
    _named(repo, lay_out(repo, other))

    expected = load_checked(transformers.LlamaForCausalLM, repo)
    assert_params_equal(expected, load_checked(transformers.LlamaForCausalLM, other))  # (what transformers reads)
    plan = run_parallel_dcp("convert", repo, tmp_path / "plan", "--dry-run")
    assert "config.json names (transformers_weights)" in plan.stdout + plan.stderr
    run_parallel_dcp("convert", repo, tmp_path / "out", "--to", "safetensors", "--shard-size", "40KB")
    assert "transformers_weights" not in json.loads((tmp_path / "out" / "config.json").read_text())
    assert_params_equal(load_checked(transformers.LlamaForCausalLM, tmp_path / "out"), expected)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "missing.safetensors"])
def test_a_named_file_transformers_fails_on_is_refused(tmp_path: Path, name: str) -> None:
    """config.json names a file transformers will not load (a .bin other than adapter_model.bin, a
    file that is not there): it fails on the folder, and we refuse it by name, writing nothing;
    neither falls back to ``model.safetensors``."""
    repo = make_llama(tmp_path / "repo", seed=0)
    if name.endswith(".bin"):
        torch.save(load_checked(transformers.LlamaForCausalLM, repo).state_dict(), repo / name)
    _named(repo, name)

    with pytest.raises((ValueError, OSError)):
        transformers.LlamaForCausalLM.from_pretrained(repo)
    result = run_parallel_dcp("convert", repo, tmp_path / "out", "--to", "safetensors", check=False)
    assert result.returncode != 0
    assert f"transformers_weights {name!r}" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("lone", ["dangling link", "folder"])
def test_a_model_safetensors_that_is_no_file_beside_shards(tmp_path: Path, lone: str) -> None:
    repo = _sharded(make_llama(tmp_path / "source", seed=0), tmp_path / "repo")
    if lone == "folder":
        (repo / "model.safetensors").mkdir()
    else:
        (repo / "model.safetensors").symlink_to(tmp_path / "gone.safetensors")

    expected = load_checked(transformers.LlamaForCausalLM, repo)
    assert_params_equal(expected, load_checked(transformers.LlamaForCausalLM, tmp_path / "source"))
    run_parallel_dcp("convert", repo, tmp_path / "out", "--to", "safetensors", "--shard-size", "40KB")
    assert_params_equal(load_checked(transformers.LlamaForCausalLM, tmp_path / "out"), expected)


def test_two_sets_without_an_index_are_refused_as_transformers_refuses_them(tmp_path: Path) -> None:
    """Shards without their index (a download filtered by ``*.safetensors``) beside Mistral's
    ``consolidated.safetensors``: transformers finds none of its names; we name both sets (we
    converted one checkpoint of both key sets, silently)."""
    repo = _sharded(make_llama(tmp_path / "source", seed=0), tmp_path / "repo")
    (repo / "model.safetensors.index.json").unlink()
    other = load_file(make_llama(tmp_path / "other", seed=1) / "model.safetensors")  # (under Mistral's own names)
    save_file({f"mistral.{k}": v for k, v in other.items()}, repo / "consolidated.safetensors")

    with pytest.raises(OSError, match="no file named"):
        transformers.LlamaForCausalLM.from_pretrained(repo)
    result = run_parallel_dcp("convert", repo, tmp_path / "out", "--to", "safetensors", check=False)
    assert result.returncode != 0
    assert "two sets of weights" in result.stderr and "consolidated.safetensors" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def _torch_shards(model: torch.nn.Module, repo: Path) -> None:
    """``model`` as two ``pytorch_model-0000N-of-00002.bin`` shards and their index."""
    state = model.state_dict()
    keys = list(state)
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2 :])):
        name = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({k: state[k] for k in part}, repo / name)
        weight_map.update(dict.fromkeys(part, name))
    (repo / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_the_hub_layout_of_bin_and_safetensors(tmp_path: Path, sharded: bool) -> None:
    """Both sets, as the hub's safetensors conversion leaves a repository (here the .bin set holds
    seed 1, the safetensors seed 0): transformers loads the safetensors."""
    source = make_llama(tmp_path / "source", seed=0)
    repo = _sharded(source, tmp_path / "repo") if sharded else shutil.copytree(source, tmp_path / "repo")
    other = load_checked(transformers.LlamaForCausalLM, make_llama(tmp_path / "other", seed=1))
    if sharded:
        _torch_shards(other, repo)
    else:
        torch.save(other.state_dict(), repo / "pytorch_model.bin")

    expected = load_checked(transformers.LlamaForCausalLM, repo)
    assert_params_equal(expected, load_checked(transformers.LlamaForCausalLM, source))
    run_parallel_dcp("convert", repo, tmp_path / "out", "--to", "safetensors", "--shard-size", "40KB")
    assert_params_equal(load_checked(transformers.LlamaForCausalLM, tmp_path / "out"), expected)
