"""Issue 31, item 6: an owner record is a file in the destination, so it may be planted.

A record acts only on names its own save created (the exact names our writer gives, for its own
full-length save id, never a substring), and its ``replaces`` list never reaches a file that a
committed checkpoint of any layout names (DCP ``.metadata``, a Hugging Face index, a single-file
output beside others).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch

import parallel_dcp
from parallel_dcp import ParallelDCPError
from parallel_dcp.storage.ownership import find_leftovers, is_of_save

pytestmark = pytest.mark.timeout(120)

TENSORS = {"a.weight": torch.arange(64.0).reshape(8, 8), "b.weight": torch.ones(8)}


def _plant(where: Path, save_id: str, **record: Any) -> None:
    """An owner record of a dead save on this host (pid 0: never running)."""
    body = {"host": socket.gethostname(), "pid": 0, "start": None, "save_id": save_id} | record
    (where / f".parallel_dcp.owner.{save_id}").write_text(json.dumps(body))


def _files(where: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in where.iterdir() if p.is_file()}


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src.safetensors"
    st.save_file(TENSORS, src)
    return src


def test_a_planted_record_never_deletes_a_committed_hugging_face_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    parallel_dcp.convert(_source(tmp_path), out, to="safetensors", workers=1)
    before = _files(out)
    assert "model.safetensors" in before
    _plant(out, "0123456789ab", replaces=["model.safetensors", ".parallel_dcp.json"])
    with pytest.raises(parallel_dcp.CheckpointExistsError):
        parallel_dcp.convert(_source(tmp_path), out, to="safetensors", workers=1)
    assert {k: v for k, v in _files(out).items() if not k.startswith(".parallel_dcp.owner")} == before


def test_a_planted_record_never_deletes_a_sharded_hugging_face_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    parallel_dcp.convert(_source(tmp_path), out, to="safetensors", workers=1, shard_size=100)
    before = _files(out)
    shards = sorted(n for n in before if n.endswith(".safetensors"))
    assert len(shards) == 2
    _plant(out, "0123456789ab", replaces=[*shards, "model.safetensors.index.json"])
    with pytest.raises(parallel_dcp.CheckpointExistsError):
        parallel_dcp.convert(_source(tmp_path), out, to="safetensors", workers=1)
    assert {k: v for k, v in _files(out).items() if not k.startswith(".parallel_dcp.owner")} == before


def test_a_planted_record_beside_a_single_file_output_never_deletes_the_users_files(tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    users = {"mine.pt": b"weights of mine", "other.bin": b"other weights", "best.safetensors": b"x" * 16}
    for name, data in users.items():
        (folder / name).write_bytes(data)
    _plant(folder, "0123456789ab", replaces=list(users))
    parallel_dcp.convert(_source(tmp_path), folder / "new.pt", workers=1)
    files = _files(folder)
    assert all(files.get(name) == data for name, data in users.items()), sorted(files)
    assert "new.pt" in files


# Planted records whose id is not one a save gives (empty, short, a pattern), beside the files of
# another save (a stopped conversion kept for resume, id abcdef012345).
BAD_IDS = ["", "0", "ab", "_", "abcdef", "abcdef012345_0", "*", "ABCDEF012345"]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_a_record_with_a_malformed_save_id_matches_nothing(bad: str, tmp_path: Path) -> None:
    where = tmp_path / "ckpt"
    where.mkdir()
    others = ["__0_abcdef012345_0.distcp", "__1_abcdef012345_0.distcp", ".model.safetensors.abcdef012345.tmp"]
    for name in others:
        (where / name).write_bytes(b"in progress")
    _plant(where, "abcdef012345", host="another-host")  # alive elsewhere: its files are kept
    _plant(where, bad)
    for leftover in find_leftovers(where):
        if leftover["save_id"] != "abcdef012345":
            assert leftover["files"] == [], leftover
    with pytest.raises(ParallelDCPError):  # a directory holding another save's files is refused
        parallel_dcp.save({"w": torch.zeros(4)}, where, workers=1)
    assert all((where / name).exists() for name in others)


@pytest.mark.parametrize(
    ("name", "mine"),
    [
        ("__0_abcdef012345_0.distcp", True),
        ("__12_abcdef012345_3.distcp", True),
        (".model.safetensors.abcdef012345.tmp", True),
        (".parallel_dcp.owner.abcdef012345", True),
        ("__0_xabcdef012345_0.distcp", False),
        ("__0_abcdef012345x_0.distcp", False),
        ("__0_abcdef012345_0_abcdef012345_0.distcp", False),
        ("__a_abcdef012345_0.distcp", False),
        ("model.safetensors", False),
    ],
)
def test_a_save_owns_exactly_the_names_its_writer_gives(name: str, mine: bool) -> None:
    assert is_of_save(name, "abcdef012345") is mine
    assert not is_of_save(name, "") and not is_of_save(name, "abcdef")


def test_a_real_crash_after_the_commit_is_still_cleaned_up(tmp_path: Path) -> None:
    """The record a save killed between its commit and the removal of the old shards leaves (its
    own, naming the replaced checkpoint's shards) is still honoured."""
    dest = tmp_path / "ckpt"
    parallel_dcp.save({"w": torch.zeros(8)}, dest, workers=1)
    old = sorted(p.name for p in dest.glob("*.distcp"))
    parallel_dcp.save({"w": torch.ones(8)}, tmp_path / "new", workers=1)
    for p in (tmp_path / "new").glob("*.distcp"):  # the new checkpoint committed in place
        p.rename(dest / p.name)
    (tmp_path / "new" / ".metadata").replace(dest / ".metadata")
    (dest / ".parallel_dcp.json").unlink()
    save_id = next(p.name for p in dest.glob("*.distcp") if p.name not in old).split("_")[3]
    _plant(dest, save_id, replaces=old)
    with pytest.warns(UserWarning, match="leftover"):
        parallel_dcp.save({"w": torch.full((8,), 2.0)}, dest, workers=1, overwrite=True)
    assert not any((dest / name).exists() for name in old)
    assert torch.equal(parallel_dcp.load(dest, workers=1)["w"], torch.full((8,), 2.0))
