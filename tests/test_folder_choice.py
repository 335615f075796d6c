"""A Hugging Face folder source means the weights transformers loads from it (review s15 rev1 F9, F5).

transformers 5 (modeling_utils.py ``_get_resolved_checkpoint_files``) loads the first of
``model.safetensors``, ``model.safetensors.index.json``, ``pytorch_model.bin``,
``pytorch_model.bin.index.json`` it finds in a folder and ignores the rest; the folders here hold a
second set beside that one, with other values, and every reader (open, convert, load, inspect,
``--dry-run``) must take the client's. (The client suite, tests_clients/hf/test_folder_choice.py,
loads the same folders in transformers itself.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import parallel_dcp
from parallel_dcp.formats import detect_format, folder_weights, open_source
from parallel_dcp.jobs.inspect import inspect_checkpoint


def _values(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(8, 16, generator=generator) for i in range(3)}


def _write(values: dict[str, torch.Tensor], path: Path) -> None:
    """``values`` as a safetensors file or a torch.save file, by ``path``'s suffix."""
    if path.suffix == ".safetensors":
        save_file(values, path)
    else:
        torch.save(values, path)


def _sharded(folder: Path, values: dict[str, torch.Tensor], fmt: str) -> None:
    """``values`` as two shards and their index, as transformers writes them (``fmt``: safetensors or torch)."""
    suffix, index = (
        (".safetensors", "model.safetensors.index.json")
        if fmt == "safetensors"
        else (".bin", "pytorch_model.bin.index.json")
    )
    stem = "model" if fmt == "safetensors" else "pytorch_model"
    keys = list(values)
    shards = {f"{stem}-0000{i + 1}-of-00002{suffix}": part for i, part in enumerate((keys[:2], keys[2:]))}
    for name, part in shards.items():
        chunk = {k: values[k] for k in part}
        _write(chunk, folder / name)
    weight_map = {k: name for name, part in shards.items() for k in part}
    (folder / index).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_single_file_before_an_index_beside_it(tmp_path: Path, fmt: str) -> None:
    """F9: model.safetensors (or pytorch_model.bin) beside an older upload's index and shards: the
    single file is what transformers loads, so it is what every reader reads."""
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    old, new = _values(0), _values(1)
    _sharded(folder, old, fmt)
    lone = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    _write(new, folder / lone)

    source = open_source(folder)
    assert [Path(f).name for f in source.files] == [lone]
    source.close()
    assert _equal(parallel_dcp.load(folder), new)
    parallel_dcp.convert(folder, tmp_path / "out", workers=2)
    assert _equal(parallel_dcp.load(tmp_path / "out"), new)
    assert [f["name"] for f in inspect_checkpoint(folder)["files"]] == [lone]  # (not the unread index)
    plan = parallel_dcp.convert(folder, tmp_path / "plan", workers=2, dry_run=True)
    assert any(
        f"reads {lone} " in note and "model-00001-of-00002" not in note.split("not read")[0] for note in plan.notes
    )
    assert any("not read: " in note and "-00001-of-00002" in note for note in plan.notes)


def test_pytorch_model_bin_beside_a_peft_adapter(tmp_path: Path) -> None:
    """F5: pytorch_model.bin (the model) beside adapter_model.safetensors (a PEFT adapter): the
    folder is a torch folder, as transformers loads it; the adapter is never taken for the model."""
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "adapter_config.json").write_text("{}")
    save_file({"lora_A": torch.ones(4, 4)}, folder / "adapter_model.safetensors")
    model = _values(0)
    torch.save(model, folder / "pytorch_model.bin")

    assert detect_format(folder) == "torch"
    assert _equal(parallel_dcp.load(folder), model)
    parallel_dcp.convert(folder, tmp_path / "out", to="torch", workers=2)
    assert _equal(parallel_dcp.load(tmp_path / "out"), model)
    source = open_source(folder)
    assert folder_weights(source) == (["pytorch_model.bin"], ["adapter_model.safetensors"])
    source.close()


def test_the_client_order_across_formats(tmp_path: Path) -> None:
    """The safetensors index comes before pytorch_model.bin (the hub's layout after the safetensors
    conversion bot: both sets, the same values); model.safetensors before all."""
    folder = tmp_path / "repo"
    folder.mkdir()
    values = _values(0)
    _sharded(folder, values, "safetensors")
    torch.save(_values(1), folder / "pytorch_model.bin")
    assert detect_format(folder) == "safetensors"
    assert _equal(parallel_dcp.load(folder), values)


def test_a_folder_with_no_standard_name(tmp_path: Path) -> None:
    """No client name: every .safetensors is read as before, an adapter beside them not; an
    adapter alone (a PEFT folder) is read."""
    folder = tmp_path / "mistral"
    folder.mkdir()
    model = _values(0)
    save_file(model, folder / "consolidated.safetensors")
    save_file({"lora_A": torch.ones(4, 4)}, folder / "adapter_model.safetensors")
    assert _equal(parallel_dcp.load(folder), model)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file({"lora_A": torch.ones(4, 4)}, adapter / "adapter_model.safetensors")
    assert sorted(parallel_dcp.load(adapter)) == ["lora_A"]


def test_two_sets_without_an_index_are_refused_not_merged(tmp_path: Path) -> None:
    """Mistral's ``consolidated.safetensors`` beside Hugging Face shards whose index a filtered
    download left out (review s15 rev2 F5): the two copies were converted as one checkpoint."""
    folder = tmp_path / "mistral"
    folder.mkdir()
    _sharded(folder, _values(0), "safetensors")
    (folder / "model.safetensors.index.json").unlink()
    save_file(_values(1), folder / "consolidated.safetensors")
    with pytest.raises(parallel_dcp.CorruptCheckpointError, match=r"two sets of weights.*consolidated\.safetensors"):
        parallel_dcp.convert(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_variant_beside_its_plain_file_is_not_read(tmp_path: Path) -> None:
    """A diffusers folder with ``diffusion_pytorch_model.safetensors`` and its ``.fp16`` variant
    (review s15 rev2 F3): diffusers loads the plain file; both read, every tensor was "in two shards"."""
    folder = tmp_path / "unet"
    folder.mkdir()
    plain = _values(0)
    save_file(plain, folder / "diffusion_pytorch_model.safetensors")
    save_file({k: v.half() for k, v in _values(1).items()}, folder / "diffusion_pytorch_model.fp16.safetensors")
    parallel_dcp.convert(folder, tmp_path / "out")
    assert _equal(parallel_dcp.load(tmp_path / "out"), plain)


@pytest.mark.parametrize("named", ["custom.safetensors", "model.safetensors"])
def test_config_transformers_weights_is_not_passed_over(tmp_path: Path, named: str) -> None:
    """``config.json``'s ``transformers_weights`` is the file transformers 5 loads before any other
    (review s15 rev2 F1): we converted ``model.safetensors`` instead, silently. Not followed yet:
    refused by name, unless it names the file the folder is read by anyway."""
    folder = tmp_path / "m"
    folder.mkdir()
    save_file(_values(0), folder / "model.safetensors")
    save_file(_values(1), folder / "custom.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "transformers_weights": named}))
    if named == "model.safetensors":
        parallel_dcp.convert(folder, tmp_path / "out")
        assert _equal(parallel_dcp.load(tmp_path / "out"), _values(0))
        return
    with pytest.raises(parallel_dcp.CorruptCheckpointError, match=r"transformers_weights 'custom\.safetensors'"):
        parallel_dcp.convert(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("lone", ["dangling link", "folder"])
def test_a_client_name_that_is_no_file_is_passed_over(tmp_path: Path, lone: str) -> None:
    """``model.safetensors`` a dangling link or a folder beside an index and its shards: transformers
    (``os.path.isfile``) loads the shards; we refused the folder (review s15 rev2 F2)."""
    folder = tmp_path / "m"
    folder.mkdir()
    _sharded(folder, _values(0), "safetensors")
    if lone == "folder":
        (folder / "model.safetensors").mkdir()
    else:
        (folder / "model.safetensors").symlink_to(tmp_path / "gone.safetensors")
    assert detect_format(folder) == "safetensors"
    parallel_dcp.convert(folder, tmp_path / "out")
    assert _equal(parallel_dcp.load(tmp_path / "out"), _values(0))
