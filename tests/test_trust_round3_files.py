"""Issue 31, item 6: the files beside the weights, and Hugging Face cache folders.

Side files copied into a converted folder follow the one rule for reading: no symlink leaving the
source's tree (a Hugging Face cache snapshot's tree is its ``models--X/`` folder), regular files
only, each read no further than its size; a name the commit could not write is refused before
anything is written. Every ``io`` mode reads a cache snapshot the same way.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

import parallel_dcp
from parallel_dcp import ParallelDCPError, UnsafeCheckpointError

pytestmark = pytest.mark.timeout(120)

CONFIG = b'{"model_type": "llama", "hidden_size": 8}\n'


def _model(where: Path) -> dict[str, torch.Tensor]:
    where.mkdir(parents=True)
    tensors = {"a.weight": torch.arange(64.0).reshape(8, 8), "b.weight": torch.ones(8)}
    st.save_file(tensors, where / "model.safetensors")
    (where / "config.json").write_bytes(CONFIG)
    return tensors


# What is planted in the model folder as a side file, and the error that refuses it (by name).
PLANTED = [
    pytest.param("tokenizer.json", lambda t: Path("/etc/passwd"), r"tokenizer\.json is a symlink leading", id="etc"),
    pytest.param(
        "README.md", lambda t: Path("/proc/self/environ"), r"README\.md is a symlink leading out", id="proc-environ"
    ),
    pytest.param("notes.txt", lambda t: t / "secret.txt", r"notes\.txt is a symlink leading out", id="sibling"),
    pytest.param("vocab.txt", lambda t: t / "hf/../secret.txt", r"vocab\.txt is a symlink leading", id="dotdot"),
]


@pytest.mark.parametrize("via", ["source", "copy_files_from"])
@pytest.mark.parametrize(("name", "target", "error"), PLANTED)
def test_a_side_file_linking_out_of_the_folder_is_refused_before_anything_is_written(
    via: str, name: str, target: object, error: str, tmp_path: Path
) -> None:
    _model(tmp_path / "hf")
    (tmp_path / "secret.txt").write_bytes(b"TOKEN=hunter2")
    (tmp_path / "hf" / name).symlink_to(target(tmp_path))  # type: ignore[operator]
    extra = {"copy_files_from": tmp_path / "hf"} if via == "copy_files_from" else {}
    with pytest.raises(UnsafeCheckpointError, match=error):
        parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to="safetensors", workers=1, **extra)
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(60)
def test_a_fifo_side_file_is_refused_not_blocked_on(tmp_path: Path) -> None:
    _model(tmp_path / "hf")
    os.mkfifo(tmp_path / "hf" / "tokenizer.json")
    with pytest.raises(UnsafeCheckpointError, match=r"tokenizer\.json is not a regular file"):
        parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to="safetensors", workers=1)
    assert not (tmp_path / "out").exists()


def test_a_link_inside_the_folder_is_copied(tmp_path: Path) -> None:
    tensors = _model(tmp_path / "hf")
    (tmp_path / "hf" / "shared").mkdir()
    (tmp_path / "hf" / "shared" / "tok.json").write_bytes(b'{"v": 1}')
    (tmp_path / "hf" / "tokenizer.json").symlink_to("shared/tok.json")
    parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to="safetensors", workers=1)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == b'{"v": 1}'
    assert not (tmp_path / "out" / "tokenizer.json").is_symlink()
    assert (tmp_path / "out" / "config.json").read_bytes() == CONFIG
    loaded = st.load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_a_side_file_name_too_long_to_commit_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    _model(tmp_path / "hf")
    long_name = "n" * 244 + ".json"  # 249 bytes: fits the file system, not the commit's temporary name
    (tmp_path / "hf" / long_name).write_bytes(b"{}")
    with pytest.raises(ParallelDCPError, match=r"too long.*copy_files=False") as caught:
        parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to="safetensors", workers=1)
    assert "nnnn" in str(caught.value) and len(str(caught.value)) < 600
    assert not (tmp_path / "out").exists()


def _hf_cache(tmp_path: Path, sharded: bool = False, below: str = "") -> tuple[Path, dict[str, torch.Tensor]]:
    """A Hugging Face cache repository: snapshot files are links into ``../../blobs/`` (with
    ``below``, the model lies in that folder of the snapshot, its links one level deeper)."""
    repo = tmp_path / "hub" / "models--org--tiny"
    staged = tmp_path / "staged"
    tensors = _model(tmp_path / "single")
    shards = {"shard_size": 100} if sharded else {}
    parallel_dcp.convert(tmp_path / "single", staged, to="safetensors", workers=1, **shards)  # type: ignore[arg-type]
    assert (staged / "model.safetensors.index.json").exists() == sharded
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd" / below
    snapshot.mkdir(parents=True)
    up = [".."] * (2 + len(Path(below).parts))
    for i, name in enumerate(sorted(os.listdir(staged))):
        blob = repo / "blobs" / f"{i:040x}"
        blob.write_bytes((staged / name).read_bytes())
        (snapshot / name).symlink_to(Path(*up, "blobs", blob.name))
    return snapshot, tensors


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_a_model_in_a_folder_of_a_cache_snapshot_reads_as_the_snapshot_does(sharded: bool, tmp_path: Path) -> None:
    """A diffusers ``unet/`` (or a repository's ``subfolder=``): its files link into the same
    repository's ``blobs/``, three levels up; it was refused as "a symlink leading out"."""
    folder, tensors = _hf_cache(tmp_path, sharded, below="unet")
    parallel_dcp.convert(folder, tmp_path / "out", to="safetensors", workers=1)
    loaded = st.load_file(tmp_path / "out" / "model.safetensors")
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("io", ["auto", "direct", "buffered"])
def test_a_hugging_face_cache_snapshot_reads_the_same_in_every_io_mode(io: str, sharded: bool, tmp_path: Path) -> None:
    snapshot, tensors = _hf_cache(tmp_path, sharded)
    out = tmp_path / f"out-{io}"
    parallel_dcp.convert(snapshot, out, to="safetensors", workers=1, io=io)
    loaded = st.load_file(out / "model.safetensors")
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert (out / "config.json").read_bytes() == CONFIG
    dcp_out = tmp_path / f"dcp-{io}"
    parallel_dcp.convert(snapshot, dcp_out, workers=1, io=io)
    back = parallel_dcp.load(dcp_out, workers=1)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("io", ["auto", "direct", "buffered"])
def test_a_cache_snapshot_link_leaving_its_repository_is_refused_in_every_io_mode(io: str, tmp_path: Path) -> None:
    snapshot, _ = _hf_cache(tmp_path)
    other = tmp_path / "hub" / "models--evil--x" / "blobs"
    other.mkdir(parents=True)
    st.save_file({"a.weight": torch.zeros(8, 8), "b.weight": torch.zeros(8)}, other / "w")
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(other / "w")
    with pytest.raises(UnsafeCheckpointError, match=r"model\.safetensors is a symlink leading out"):
        parallel_dcp.convert(snapshot, tmp_path / "out", workers=1, io=io)
    assert not (tmp_path / "out").exists()


def test_a_config_json_linking_out_of_a_quantized_folder_is_never_read(tmp_path: Path) -> None:
    """Dequantizing reads the source's config.json (its block size) and writes it, edited, into
    the output: one linking out of the folder (another user's JSON secrets) is refused by name."""
    from tests.quantized_checkpoints import fp8_checkpoint

    src = fp8_checkpoint(tmp_path / "fp8")
    secret = tmp_path / "secrets.json"
    secret.write_text('{"token": "hunter2", "quantization_config": {"weight_block_size": [128, 128]}}')
    (src / "config.json").unlink()
    (src / "config.json").symlink_to(secret)
    with pytest.raises(UnsafeCheckpointError, match=r"config\.json is a symlink leading out"):
        parallel_dcp.convert(src, tmp_path / "out", to="safetensors", dequantize=True, workers=1, copy_files=False)
    assert not (tmp_path / "out").exists()


def test_verify_with_a_manifest_names_a_shard_replaced_by_a_link_or_a_fifo(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    parallel_dcp.save({"w": torch.zeros(64), "v": torch.ones(64)}, ckpt, workers=2)
    twin = tmp_path / "twin"
    shards = sorted(ckpt.glob("*.distcp"))
    twin.write_bytes(shards[0].read_bytes())  # the same bytes: only the rule can tell
    shards[0].unlink()
    shards[0].symlink_to(twin)
    shards[1].unlink()
    os.mkfifo(shards[1])
    report = parallel_dcp.verify(ckpt, workers=1)
    assert report.manifest and not report.ok
    shown = "\n".join(report.problems)
    assert f"{shards[0].name}" in shown and "symlink" in shown, shown
    assert f"{shards[1].name}" in shown and "not a regular file" in shown, shown
