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
from pathlib import Path

import pytest

import parallel_dcp
from parallel_dcp import PresetError
from parallel_dcp.errors import UnsafeCheckpointError
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
