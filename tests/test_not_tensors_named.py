"""Files that are not what a conversion reads are named for what they are (review s16 F9).

- ``torch.save(model)`` (a whole pickled ``nn.Module``, read with ``trust_pickle``), or a module
  under a key: said to hold a pickled ``torch.nn.Linear`` module, not tensors, and that its
  ``state_dict()`` converts (it said "selects 1 other values ()", and no ``keys=`` reaches its weights).
- A Git LFS pointer in place of a safetensors shard (a clone without git-lfs): said to be one, with
  ``git lfs pull`` (it said "header too large").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import parallel_dcp
from parallel_dcp.errors import CorruptCheckpointError


@pytest.mark.parametrize(
    ("saved", "where"),
    [
        (lambda: torch.nn.Linear(4, 3), "the file holds"),
        (lambda: {"model": torch.nn.Linear(4, 3), "step": 3}, "its key 'model' holds"),
    ],
)
def test_a_pickled_module_is_named(tmp_path: Path, saved: object, where: str) -> None:
    torch.save(saved(), tmp_path / "model.pt")  # type: ignore[operator]
    out = tmp_path / "out.safetensors"
    with pytest.warns(UserWarning, match="trust"), pytest.raises(ValueError) as caught:
        parallel_dcp.convert(tmp_path / "model.pt", out, trust_pickle=True, workers=1)
    message = str(caught.value)
    assert f"{where} a pickled torch.nn.Linear module, not tensors" in message
    assert "model.state_dict()" in message
    assert not out.exists()


def test_a_git_lfs_pointer_shard_is_named(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    save_file({"a": torch.ones(4)}, str(src / "model-00001-of-00002.safetensors"))
    (src / "model-00002-of-00002.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 123456\n"
    )
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CorruptCheckpointError, match=r"is a Git LFS pointer.*git lfs pull"):
        parallel_dcp.convert(src, tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()
