"""Round 3 review: hostile inputs to this round's new surfaces (presets' model configs), each a
finding that failed before its fix.

- A preset read the model's config.json beside the source with a plain ``open``: a symlink out of
  the source's folder was followed (and its content written as the output's config.json), a huge
  file was read whole, a FIFO was taken for "no config".
- A config whose num_hidden_layers is huge made the completeness check list every key of that many
  layers (10^9 layers: tens of GB) before saying anything.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import parallel_dcp
from parallel_dcp import PresetError
from parallel_dcp.errors import CorruptCheckpointError, InvalidDestinationError, UnsafeCheckpointError
from parallel_dcp.formats import open_source
from parallel_dcp.jobs.copy_files import files_to_copy, read_copies
from tests.test_convert import write_hf_safetensors
from tests.test_hf_config import _folder
from tests.test_presets import CONFIG, TO_HF, TO_TITAN, hf_folder


@pytest.fixture
def titan(tmp_path: Path) -> Path:
    """A torchtitan DCP checkpoint (no config.json beside it) converted from a Hugging Face folder."""
    hf_folder(tmp_path / "hf")
    parallel_dcp.convert(tmp_path / "hf", tmp_path / "titan", preset=TO_TITAN, workers=1)
    return tmp_path / "titan"


def test_a_config_json_linking_out_of_the_source_is_refused_never_copied(tmp_path: Path, titan: Path) -> None:
    elsewhere = tmp_path / "someone_elses"
    elsewhere.mkdir()
    (elsewhere / "private.json").write_text(json.dumps(CONFIG | {"secret": "do not copy"}))
    os.symlink(elsewhere / "private.json", titan / "config.json")
    with pytest.raises(UnsafeCheckpointError, match="symlink leading out"):
        parallel_dcp.convert(titan, tmp_path / "back", to="safetensors", preset=TO_HF, workers=1)
    assert not (tmp_path / "back").exists()


def test_a_config_json_linking_inside_the_source_is_read(tmp_path: Path, titan: Path) -> None:
    (titan / "model_config.json").write_text(json.dumps(CONFIG))
    os.symlink("model_config.json", titan / "config.json")
    parallel_dcp.convert(titan, tmp_path / "back", to="safetensors", preset=TO_HF, workers=1)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == CONFIG


def test_a_fifo_as_config_json_is_refused_by_name(tmp_path: Path, titan: Path) -> None:
    os.mkfifo(titan / "config.json")
    with pytest.raises(UnsafeCheckpointError, match=r"config\.json is not a regular file"):
        parallel_dcp.convert(titan, tmp_path / "back", to="safetensors", preset=TO_HF, workers=1)
    assert not (tmp_path / "back").exists()


def test_a_fifo_given_as_model_config_is_refused_not_called_missing(tmp_path: Path) -> None:
    hf_folder(tmp_path / "hf")
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(UnsafeCheckpointError, match=r"fifo\.json is not a regular file"):
        parallel_dcp.convert(
            tmp_path / "hf", tmp_path / "out", preset=TO_TITAN, workers=1, model_config=tmp_path / "fifo.json"
        )
    assert not (tmp_path / "out").exists()


def test_a_model_config_the_user_names_through_a_symlink_is_followed(tmp_path: Path) -> None:
    hf_folder(tmp_path / "hf")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "llama.json").write_text(json.dumps(CONFIG))
    os.symlink(tmp_path / "configs" / "llama.json", tmp_path / "link.json")
    parallel_dcp.convert(
        tmp_path / "hf", tmp_path / "out", preset=TO_TITAN, workers=1, model_config=tmp_path / "link.json"
    )
    assert (tmp_path / "out" / ".metadata").is_file()


def test_a_huge_config_json_is_refused_by_its_size_not_read(tmp_path: Path, titan: Path) -> None:
    with open(titan / "config.json", "w") as f:  # valid JSON: a reader that reads it all accepts it
        f.write(json.dumps(CONFIG))
        f.write(" " * (17 * 2**20))
    with pytest.raises(PresetError, match="more than"):
        parallel_dcp.convert(titan, tmp_path / "back", to="safetensors", preset=TO_HF, workers=1)
    assert not (tmp_path / "back").exists()


@pytest.mark.parametrize("layers", [10**5, 10**12])
def test_a_huge_num_hidden_layers_is_refused_without_listing_its_keys(tmp_path: Path, layers: int) -> None:
    hf_folder(tmp_path / "hf", config=CONFIG)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(CONFIG | {"num_hidden_layers": layers}))
    with pytest.raises(PresetError, match=f"num_hidden_layers={layers}"):
        parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", preset=TO_TITAN, workers=1)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"head_dim": 0}, "positive integer head_dim"),
        ({"head_dim": True}, "positive integer head_dim"),
        ({"head_dim": "8"}, "positive integer head_dim"),
        ({"num_attention_heads": 4.0}, "positive integer num_attention_heads"),
        ({"num_attention_heads": 10**30}, "do not have the rows"),
        ({"num_key_value_heads": -2}, "positive integer num_key_value_heads"),
        ({"head_dim": None, "hidden_size": 65}, "not a multiple of num_attention_heads"),
    ],
)
def test_hostile_head_counts_fail_before_writing(tmp_path: Path, change: dict, message: str) -> None:
    hf_folder(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(CONFIG | change))
    with pytest.raises(PresetError, match=message):
        parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", preset=TO_TITAN, workers=1)
    assert not (tmp_path / "out").exists()


def _hf_with_pooling(where: Path) -> Path:
    write_hf_safetensors({"a": torch.randn(4, 4), "b": torch.randn(3)}, where, shards=2)
    (where / "config.json").write_text("{}")
    (where / "1_Pooling").mkdir()
    (where / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    return where


def test_a_side_folder_swapped_for_a_symlink_after_it_was_chosen_is_refused_at_the_read(tmp_path: Path) -> None:
    """Someone who can write the source folder swaps ``1_Pooling/`` for a link out between the choice
    of the files (which checked it) and their read at the commit: the read walks the chosen path
    without following any link, so it refuses instead of copying the other folder's file."""
    src = _hf_with_pooling(tmp_path / "src")
    source = open_source(src)
    try:
        copies = files_to_copy(
            source, directory_output=True, copy_files=True, copy_files_from=None, storage_options=None, limit=2**30
        )
    finally:
        source.close()
    assert set(copies) == {"config.json", "1_Pooling/config.json"}
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "config.json").write_text('{"secret": 1}')
    os.rename(src / "1_Pooling", tmp_path / "moved")
    os.symlink(tmp_path / "private", src / "1_Pooling")
    with pytest.raises(UnsafeCheckpointError, match="symlink"):
        read_copies(copies)
    assert read_copies(copies, ["config.json"]) == {"config.json": b"{}"}


def test_side_files_are_read_through_a_symlinked_parent_the_user_chose(tmp_path: Path) -> None:
    """The path *to* the source may go through links (the user's choice): only a change below it is refused."""
    _hf_with_pooling(tmp_path / "real")
    os.symlink(tmp_path / "real", tmp_path / "link")
    parallel_dcp.convert(tmp_path / "link", tmp_path / "out", to="safetensors", workers=1)
    assert (tmp_path / "out" / "1_Pooling" / "config.json").read_text() == '{"pooling_mode_mean_tokens": true}'


def test_a_side_folder_named_like_the_config_json_the_output_writes_is_refused_before_writing(tmp_path: Path) -> None:
    """copy_files_from holds a folder ``config.json/`` and the preset writes the model's config.json:
    refused up front by name (was: shards written, then a refusal naming a temporary file)."""
    hf_folder(tmp_path / "hf")
    parallel_dcp.convert(tmp_path / "hf", tmp_path / "titan", preset=TO_TITAN, workers=1)
    side = tmp_path / "side"
    (side / "config.json").mkdir(parents=True)
    (side / "config.json" / "notes.txt").write_text("x")
    (tmp_path / "cfg.json").write_text(json.dumps(CONFIG))
    for dry_run in (True, False):
        with pytest.raises(InvalidDestinationError, match=r"folder 'config\.json'"):
            parallel_dcp.convert(
                tmp_path / "titan",
                tmp_path / "back",
                to="safetensors",
                preset=TO_HF,
                workers=1,
                copy_files_from=side,
                model_config=tmp_path / "cfg.json",
                dry_run=dry_run,
            )
        assert not (tmp_path / "back").exists()


DEEP = "[" * 100_000 + "]" * 100_000  # 200 KB of JSON nested deeper than json.loads can recurse


def test_a_deeply_nested_config_json_is_a_clear_error_not_a_recursion_traceback(tmp_path: Path) -> None:
    src = _hf_with_pooling(tmp_path / "src")
    (src / "config.json").write_text('{"x": ' + DEEP + "}")
    with pytest.raises(ValueError, match="nested too deeply"):
        parallel_dcp.convert(src, tmp_path / "out", to="safetensors", dtype="bfloat16", workers=1)
    assert not (tmp_path / "out").exists()


def test_a_deeply_nested_model_config_is_a_preset_error(tmp_path: Path) -> None:
    hf_folder(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(DEEP)
    with pytest.raises(PresetError, match="nested too deeply"):
        parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", preset=TO_TITAN, workers=1)
    assert not (tmp_path / "out").exists()


def test_a_deeply_nested_index_json_is_a_corrupt_checkpoint(tmp_path: Path) -> None:
    src = _hf_with_pooling(tmp_path / "src")
    (src / "model.safetensors.index.json").write_text('{"weight_map": ' + DEEP + "}")
    with pytest.raises(CorruptCheckpointError, match="nested too deeply"):
        parallel_dcp.convert(src, tmp_path / "out", to="safetensors", workers=1)
    assert not (tmp_path / "out").exists()


def test_a_deeply_nested_manifest_is_reported_by_verify(tmp_path: Path) -> None:
    src = _hf_with_pooling(tmp_path / "src")
    parallel_dcp.convert(src, tmp_path / "out", to="safetensors", workers=1)
    (tmp_path / "out" / ".parallel_dcp.json").write_text(DEEP)
    with pytest.raises(CorruptCheckpointError, match="nested too deeply"):
        parallel_dcp.verify(tmp_path / "out")


@pytest.mark.parametrize(
    "rule",
    [
        (r"(.*)\.weight", r"\1.w"),  # the weights renamed, their scales not: scales without a weight
        (r"(.*)_scale_inv", r"\1_s"),  # the scales renamed: FP8 weights without a scale, called unquantized
    ],
)
def test_a_rename_that_parts_a_quantized_weight_from_its_scale_is_refused(tmp_path: Path, rule: tuple) -> None:
    """--quantize then --rename: transformers pairs ``X.weight`` with ``X.weight_scale_inv`` by name; a
    rename that breaks a pair gave a config listing the FP8 weights in modules_to_not_convert (loaded
    as plain weights without their scales: wrong values, no error)."""
    src = _folder(tmp_path / "src", {"model_type": "x", "dtype": "bfloat16"})
    with pytest.raises(parallel_dcp.QuantizationError, match=r"weight_scale_inv"):
        parallel_dcp.convert(src, tmp_path / "q", to="safetensors", quantize="fp8-block", rename=[rule], workers=1)
    assert not (tmp_path / "q").exists()


def test_a_rename_that_keeps_the_pairs_is_fine(tmp_path: Path) -> None:
    src = _folder(tmp_path / "src", {"model_type": "x", "dtype": "bfloat16"})
    rule = (r"model\.(.*)", r"m.\1")
    parallel_dcp.convert(src, tmp_path / "q", to="safetensors", quantize="fp8-block", rename=[rule], workers=1)
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())
    assert "m.layers.0.mlp.down_proj.weight_scale_inv" in index["weight_map"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any folder: the permission is not checked")
def test_side_files_under_a_folder_others_can_only_search_are_read(tmp_path: Path) -> None:
    """A folder on the way of mode 0o311 (search, no read: like a home directory of mode 0711)."""
    _hf_with_pooling(tmp_path / "home" / "src")
    os.chmod(tmp_path / "home", 0o311)
    try:
        parallel_dcp.convert(tmp_path / "home" / "src", tmp_path / "out", to="safetensors", workers=1)
    finally:
        os.chmod(tmp_path / "home", 0o755)
    assert (tmp_path / "out" / "1_Pooling" / "config.json").is_file()


def test_a_conversion_killed_during_its_commit_resumes(tmp_path: Path) -> None:
    """SIGKILL after the commit wrote its temporaries (index, config.json, the side folder) and before
    it renamed them: the resume takes them over as its own (was: refused, its own temporary index
    called 'a planted file or symlink?')."""
    src = _hf_with_pooling(tmp_path / "src")
    out = tmp_path / "out"
    child = (
        "import os, signal, sys\n"
        "import parallel_dcp\n"
        "from parallel_dcp.storage import local_staging\n"
        "real = local_staging.write_tree\n"
        "def write_tree(*a, **k):\n"
        "    real(*a, **k)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "local_staging.write_tree = write_tree\n"
        f"parallel_dcp.convert({str(src)!r}, {str(out)!r}, to='safetensors', workers=1, shard_size='32B')\n"
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert any(n.startswith(".1_Pooling.") for n in os.listdir(out))  # killed inside the commit
    result = parallel_dcp.convert(src, out, to="safetensors", workers=1, shard_size="32B", resume=True)
    assert isinstance(result, parallel_dcp.SaveResult) and result.resumed
    assert sorted(n for n in os.listdir(out) if not n.startswith(".")) == [
        "1_Pooling",
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert (out / "1_Pooling" / "config.json").read_text() == '{"pooling_mode_mean_tokens": true}'
    assert parallel_dcp.verify(out).ok


def test_the_manifest_is_renamed_after_the_side_folders(tmp_path: Path) -> None:
    """SIGKILL at the rename of ``1_Pooling/``: no manifest may say the output is whole (was: the manifest
    was renamed first, so a verified output silently lacked its side folder)."""
    src = _hf_with_pooling(tmp_path / "src")
    out = tmp_path / "out"
    child = (
        "import os, signal, sys\n"
        "import parallel_dcp\n"
        "from parallel_dcp.storage import local_staging\n"
        "real = local_staging.rename_name\n"
        "def rename_name(fd, source, target, replace):\n"
        "    if target == '1_Pooling':\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return real(fd, source, target, replace=replace)\n"
        "local_staging.rename_name = rename_name\n"
        f"parallel_dcp.convert({str(src)!r}, {str(out)!r}, to='safetensors', workers=1, shard_size='32B')\n"
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert not (out / "1_Pooling").exists()
    assert not (out / ".parallel_dcp.json").exists()
