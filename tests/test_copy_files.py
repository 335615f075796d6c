"""A converted Hugging Face folder keeps its non-weight files (issue 25, item 11).

transformers is not installed here, so ``from_pretrained`` itself is not run: what it reads is
checked instead (config.json and the tokenizer files byte for byte, the safetensors index valid
and naming every tensor's shard, each shard loading with safetensors' own reader).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

import parallel_dcp
from parallel_dcp import cli

KEEP = {
    "config.json": b'{"model_type": "llama", "hidden_size": 64}\n',
    "generation_config.json": b'{"do_sample": false}\n',
    "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE"}}',
    "tokenizer_config.json": b"{}",
    "special_tokens_map.json": b'{"bos_token": "<s>"}',
    "tokenizer.model": bytes(range(256)) * 4,
    "README.md": b"# a model\n",
}
SKIP = {
    ".gitattributes": b"*.safetensors filter=lfs",
    "training_args.bin": b"pickle",
    "pytorch_model.bin": b"weights of another format",
    "consolidated.pth": b"weights",
    "flax_model.msgpack": b"weights",
}


def _hf_folder(where: Path) -> dict[str, torch.Tensor]:
    where.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i}.weight": torch.randn(64, 64, generator=g) for i in range(4)}
    st.save_file(tensors, where / "model.safetensors")
    for name, data in {**KEEP, **SKIP}.items():
        (where / name).write_bytes(data)
    (where / "original").mkdir()  # non-weight files of folders are copied (issue 29), weights never
    (where / "original" / "params.json").write_bytes(b"{}")
    (where / "original" / "consolidated.00.pth").write_bytes(b"weights of another format")
    return tensors


def _check_loadable(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    """What from_pretrained reads: config and tokenizer files, the index, every shard."""
    for name, data in KEEP.items():
        assert (out / name).read_bytes() == data, name
    assert not any((out / name).exists() for name in SKIP)
    assert (out / "original" / "params.json").read_bytes() == b"{}"
    assert sorted(p.name for p in (out / "original").iterdir()) == ["params.json"]
    index = json.loads((out / "model.safetensors.index.json").read_bytes())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    loaded: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        part = st.load_file(out / shard)
        assert all(index["weight_map"][k] == shard for k in part)
        loaded |= part
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_a_hugging_face_folder_converted_to_sharded_safetensors_keeps_its_files(tmp_path: Path) -> None:
    tensors = _hf_folder(tmp_path / "hf")
    result = parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to="safetensors", shard_size="20KB", workers=2)
    assert not isinstance(result, list) and result.files == 5  # 4 shards and the index
    _check_loadable(tmp_path / "out", tensors)
    assert parallel_dcp.verify(tmp_path / "out", against=tmp_path / "hf", workers=1).ok
    manifest = json.loads((tmp_path / "out" / ".parallel_dcp.json").read_bytes())
    assert set(KEEP) <= set(manifest["files"])  # verify checks the copies' sizes and checksums too
    (tmp_path / "out" / "config.json").write_bytes(b'{"model_type": "gpt2", "hidden_size": 64}\n')
    damaged = parallel_dcp.verify(tmp_path / "out", workers=1)
    assert not damaged.ok and any("config.json" in p for p in damaged.problems)


def test_torch_shards_and_the_cli_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _hf_folder(tmp_path / "hf")
    assert cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "pt"), "--to", "torch", "-q"]) == 0
    assert all((tmp_path / "pt" / name).read_bytes() == data for name, data in KEEP.items())
    assert (
        cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "bare"), "--to", "safetensors", "--no-copy-files"])
        == 0
    )
    assert sorted(p.name for p in (tmp_path / "bare").iterdir()) == [".parallel_dcp.json", "model.safetensors"]
    code = cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "plan"), "--to", "safetensors", "--dry-run"])
    assert code == 0 and "copies 8 files beside the weights: README.md, config.json" in capsys.readouterr().out
    assert not (tmp_path / "plan").exists()


def test_copy_files_from_gives_a_dcp_checkpoint_its_model_folder(tmp_path: Path) -> None:
    tensors = _hf_folder(tmp_path / "hf")
    parallel_dcp.save(tensors, tmp_path / "step-1000", workers=2)  # a training checkpoint: weights only
    parallel_dcp.convert(tmp_path / "step-1000", tmp_path / "nothing", to="safetensors", workers=1)
    assert not (tmp_path / "nothing" / "config.json").exists()  # a DCP source has no files to copy
    parallel_dcp.convert(
        tmp_path / "step-1000",
        tmp_path / "serve",
        to="safetensors",
        shard_size="20KB",
        workers=2,
        copy_files_from=tmp_path / "hf",
    )
    _check_loadable(tmp_path / "serve", tensors)


def test_bad_requests_fail_before_anything_is_written(tmp_path: Path) -> None:
    _hf_folder(tmp_path / "hf")
    with pytest.raises(parallel_dcp.InvalidDestinationError, match="sharded directory"):
        parallel_dcp.convert(tmp_path / "hf", tmp_path / "one.safetensors", copy_files_from=tmp_path / "hf")
    with pytest.raises(ValueError, match="not a directory"):
        parallel_dcp.convert(
            tmp_path / "hf", tmp_path / "out", to="safetensors", copy_files_from=tmp_path / "hf" / "config.json"
        )
    with pytest.raises(ValueError, match="more than the memory limit"):
        (tmp_path / "hf" / "big.txt").write_bytes(b"x" * (40 * 2**20))
        parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to="safetensors", memory_limit="32MiB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_failed_conversion_leaves_no_copied_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies are staged with the save (written new under its temporary names before the commit
    point) and removed with it when the commit fails."""
    _hf_folder(tmp_path / "hf")
    from parallel_dcp.storage import local_staging

    real = local_staging.rename_name

    def fail_at_the_index(directory: int, source: str, target: str, *, replace: bool) -> None:
        if target == "model.safetensors.index.json":
            raise OSError(28, "No space left on device (simulated)")
        real(directory, source, target, replace=replace)

    monkeypatch.setattr(local_staging, "rename_name", fail_at_the_index)
    with pytest.raises(OSError, match="simulated"):
        parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to="safetensors", shard_size="20KB", workers=1)
    left = sorted(p.name for p in (tmp_path / "out").iterdir()) if (tmp_path / "out").exists() else []
    assert not any(name in KEEP or name.endswith(".tmp") for name in left), left


def test_a_planted_symlink_at_a_copy_is_not_followed(tmp_path: Path) -> None:
    """Overwriting a converted folder whose config.json someone replaced by a symlink: the link is
    replaced by the new file; the file it pointed to is untouched."""
    _hf_folder(tmp_path / "hf")
    parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to="safetensors", workers=1)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    (tmp_path / "out" / "config.json").unlink()
    (tmp_path / "out" / "config.json").symlink_to(victim)
    parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to="safetensors", workers=1, overwrite=True)
    assert victim.read_bytes() == b"precious"
    assert not (tmp_path / "out" / "config.json").is_symlink()
    assert (tmp_path / "out" / "config.json").read_bytes() == KEEP["config.json"]


# --- non-weight folders (issue 29, item 5) ------------------------------------------------------

FOLDERS = {
    "modules.json": b'[{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]',
    "1_Pooling/config.json": b'{"word_embedding_dimension": 64, "pooling_mode_mean_tokens": true}',
    "2_Dense/config.json": b'{"in_features": 64, "out_features": 32}',
    "3_Deep/a/b/notes.txt": b"nested",
}


def _st_folder(where: Path) -> dict[str, torch.Tensor]:
    """A sentence-transformers-like folder: module folders, weights in one of them, hidden ones."""
    tensors = _hf_folder(where)
    for name, data in FOLDERS.items():
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_bytes(data)
    (where / "2_Dense" / "model.safetensors").write_bytes(b"weights are never copied as files")
    (where / "2_Dense" / ".hidden").write_bytes(b"not copied")
    (where / "4_Empty").mkdir()
    (where / ".cache" / "huggingface").mkdir(parents=True)
    (where / ".cache" / "huggingface" / "x.lock").write_bytes(b"")
    return tensors


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".") and "/" in str(p.relative_to(root))
    }


@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_non_weight_folders_come_along(tmp_path: Path, to: str) -> None:
    _st_folder(tmp_path / "hf")
    parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to=to, workers=1)
    wanted = {k: v for k, v in FOLDERS.items() if "/" in k} | {"original/params.json": b"{}"}
    assert _tree(tmp_path / "out") == wanted
    assert (tmp_path / "out" / "modules.json").read_bytes() == FOLDERS["modules.json"]
    assert not (tmp_path / "out" / "2_Dense" / "model.safetensors").exists()
    assert not (tmp_path / "out" / "2_Dense" / ".hidden").exists() and not (tmp_path / "out" / ".cache").exists()
    assert not (tmp_path / "out" / "4_Empty").exists()  # a folder with nothing to copy is not made
    if to == "safetensors":  # the manifest lists plain files only: the folders do not trouble verify
        assert parallel_dcp.verify(tmp_path / "out", workers=1).ok


def test_a_module_folders_own_weights_come_along(tmp_path: Path) -> None:
    """sentence-transformers' Dense module keeps its weights in ``2_Dense/``: when modules.json names
    the folder they are copied as they are (the model does not load without them); weights in a
    folder no module names (``original/``) and hidden files still stay out."""
    _st_folder(tmp_path / "hf")
    modules = b'[{"path": ""}, {"path": "1_Pooling"}, {"path": "2_Dense/"}, {"path": 7}, "x"]'
    (tmp_path / "hf" / "modules.json").write_bytes(modules)
    parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to="safetensors", workers=1)
    out = tmp_path / "out"
    assert (out / "2_Dense" / "model.safetensors").read_bytes() == b"weights are never copied as files"
    assert not (out / "2_Dense" / ".hidden").exists()
    assert not (out / "original" / "consolidated.00.pth").exists()
    assert (out / "original" / "params.json").read_bytes() == b"{}"


def test_verify_checks_the_files_in_copied_folders(tmp_path: Path) -> None:
    """The manifest records the folders' files apart from the plain names (an older reader keeps
    reading ``files``), and ``verify`` hashes each: a flipped byte in a Dense head's weights, a
    truncated pooling config, a missing file, are all found."""
    _st_folder(tmp_path / "hf")
    (tmp_path / "hf" / "modules.json").write_bytes(b'[{"path": "1_Pooling"}, {"path": "2_Dense"}]')
    out = tmp_path / "out"
    parallel_dcp.convert(tmp_path / "hf", out, to="safetensors", workers=1)
    document = json.loads((out / ".parallel_dcp.json").read_bytes())
    assert all("/" not in name for name in document["files"])
    assert {"1_Pooling/config.json", "2_Dense/model.safetensors"} <= set(document["folder_files"])
    assert parallel_dcp.verify(out, workers=1).ok
    dense = out / "2_Dense" / "model.safetensors"
    data = bytearray(dense.read_bytes())
    data[3] ^= 0x20
    dense.write_bytes(bytes(data))
    (out / "1_Pooling" / "config.json").write_bytes(FOLDERS["1_Pooling/config.json"][:-1])
    os.unlink(out / "original" / "params.json")
    problems = parallel_dcp.verify(out, workers=1).problems
    assert any("2_Dense/model.safetensors: checksum" in p for p in problems), problems
    assert any("1_Pooling/config.json" in p and "truncated" in p for p in problems), problems
    assert any("original/params.json: missing" in p for p in problems), problems


def test_verify_refuses_a_copied_folder_swapped_for_a_symlink(tmp_path: Path) -> None:
    """A folder of the output replaced by a link to elsewhere is named, never read through (the
    file it would reach holds the very bytes the manifest records)."""
    _st_folder(tmp_path / "hf")
    out = tmp_path / "out"
    parallel_dcp.convert(tmp_path / "hf", out, to="safetensors", workers=1)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(out / "1_Pooling", elsewhere)
    shutil.rmtree(out / "1_Pooling")
    (out / "1_Pooling").symlink_to(elsewhere)
    report = parallel_dcp.verify(out, workers=1)
    assert not report.ok
    assert any("1_Pooling" in p and "symlink" in p for p in report.problems), report.problems


@pytest.mark.parametrize("name", ["../outside.txt", "1_Pooling/../../outside.txt", "/etc/hostname", "plain.txt"])
def test_a_manifest_naming_a_folder_file_outside_the_output_is_refused(tmp_path: Path, name: str) -> None:
    _st_folder(tmp_path / "hf")
    out = tmp_path / "out"
    parallel_dcp.convert(tmp_path / "hf", out, to="safetensors", workers=1)
    (tmp_path / "outside.txt").write_bytes(b"secret")
    manifest = out / ".parallel_dcp.json"
    document = json.loads(manifest.read_bytes())
    document["folder_files"][name] = {"size": 6}
    manifest.write_text(json.dumps(document))
    with pytest.raises(parallel_dcp.CorruptCheckpointError, match="not"):
        parallel_dcp.verify(out, workers=1)


def test_a_modules_json_that_is_not_a_list_copies_no_folder_weights(tmp_path: Path) -> None:
    _st_folder(tmp_path / "hf")
    (tmp_path / "hf" / "modules.json").write_bytes(b'{"path": "2_Dense"}')
    parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to="safetensors", workers=1)
    assert (tmp_path / "out" / "2_Dense" / "config.json").is_file()
    assert not (tmp_path / "out" / "2_Dense" / "model.safetensors").exists()


def test_folders_through_dcp_with_copy_files_from_and_overwrite(tmp_path: Path) -> None:
    tensors = _st_folder(tmp_path / "hf")
    parallel_dcp.convert(tmp_path / "hf", tmp_path / "dcp", workers=1)
    parallel_dcp.convert(tmp_path / "dcp", tmp_path / "out", to="safetensors", copy_files_from=tmp_path / "hf")
    assert _tree(tmp_path / "out")["1_Pooling/config.json"] == FOLDERS["1_Pooling/config.json"]
    # overwrite: the copied files replace their namesakes; a file only the old folder had is kept
    # (no checkpoint owns it: it may be the user's)
    (tmp_path / "out" / "1_Pooling" / "notes.txt").write_bytes(b"old")
    (tmp_path / "hf" / "1_Pooling" / "config.json").write_bytes(b'{"new": 1}')
    parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to="safetensors", overwrite=True, workers=1)
    assert sorted(p.name for p in (tmp_path / "out" / "1_Pooling").iterdir()) == ["config.json", "notes.txt"]
    assert (tmp_path / "out" / "1_Pooling" / "notes.txt").read_bytes() == b"old"
    assert (tmp_path / "out" / "1_Pooling" / "config.json").read_bytes() == b'{"new": 1}'
    assert not [p.name for p in (tmp_path / "out").iterdir() if p.name.endswith(".tmp")]
    loaded = st.load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def _hostile(where: Path, outside: Path, case: str) -> None:
    if case == "symlinked folder out":
        (where / "1_Pooling").rename(where / "moved")
        (where / "1_Pooling").symlink_to(outside)
    elif case == "symlink in a folder out":
        (where / "1_Pooling" / "secret.json").symlink_to(outside / "secret.txt")
    elif case == "proc file":
        (where / "1_Pooling" / "environ").symlink_to("/proc/self/environ")
    elif case == "fifo in a folder":
        os.mkfifo(where / "1_Pooling" / "pipe")
    elif case == "socket":  # (its open fails with ENXIO before fstat can name it: review s17 F3)
        import socket

        here = os.getcwd()
        (where / "special_tokens_map.json").unlink(missing_ok=True)
        os.chdir(where)  # (bound by a short name: a socket's path is at most 107 bytes)
        try:
            bound = socket.socket(socket.AF_UNIX)
            bound.bind("special_tokens_map.json")
            bound.close()  # (the socket file stays)
        finally:
            os.chdir(here)


@pytest.mark.parametrize(
    "case", ["symlinked folder out", "symlink in a folder out", "proc file", "fifo in a folder", "socket"]
)
def test_hostile_folders_are_refused_before_anything_is_written(tmp_path: Path, case: str) -> None:
    _st_folder(tmp_path / "hf")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"secret")
    _hostile(tmp_path / "hf", outside, case)
    with pytest.raises(parallel_dcp.UnsafeCheckpointError, match=r"symlink leading out|not a regular file"):
        parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to="safetensors", workers=1)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]


def test_a_link_to_a_folder_inside_the_source_is_not_walked_twice(tmp_path: Path) -> None:
    _st_folder(tmp_path / "hf")
    (tmp_path / "hf" / "alias").symlink_to(tmp_path / "hf" / "1_Pooling")
    (tmp_path / "hf" / "1_Pooling" / "loop").symlink_to(tmp_path / "hf")
    parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to="safetensors", workers=1)
    assert not (tmp_path / "out" / "alias").exists() and not (tmp_path / "out" / "1_Pooling" / "loop").exists()
    assert (tmp_path / "out" / "1_Pooling" / "config.json").read_bytes() == FOLDERS["1_Pooling/config.json"]


def test_a_planted_symlink_at_a_copied_folder_is_not_followed(tmp_path: Path) -> None:
    """Overwriting a converted folder whose 1_Pooling/ someone replaced by a symlink to a folder
    elsewhere: the link is removed itself, nothing is written where it led."""
    _st_folder(tmp_path / "hf")
    parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to="safetensors", workers=1)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_bytes(b"precious")
    shutil.rmtree(tmp_path / "out" / "1_Pooling")
    (tmp_path / "out" / "1_Pooling").symlink_to(victim)
    parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to="safetensors", workers=1, overwrite=True)
    assert (
        sorted(p.name for p in victim.iterdir()) == ["keep.txt"] and (victim / "keep.txt").read_bytes() == b"precious"
    )
    assert not (tmp_path / "out" / "1_Pooling").is_symlink()
    assert (tmp_path / "out" / "1_Pooling" / "config.json").read_bytes() == FOLDERS["1_Pooling/config.json"]


def test_a_failed_commit_leaves_no_copied_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _st_folder(tmp_path / "hf")
    from parallel_dcp.storage import local_staging

    real = local_staging.rename_name

    def fail_at_a_folder(directory: int, source: str, target: str, *, replace: bool) -> None:
        if target == "3_Deep":  # after the commit point: the save is committed, then fails
            raise OSError(28, "No space left on device (simulated)")
        real(directory, source, target, replace=replace)

    monkeypatch.setattr(local_staging, "rename_name", fail_at_a_folder)
    with pytest.raises(OSError, match="simulated"):
        parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to="safetensors", workers=1)
    left = [p.name for p in (tmp_path / "out").iterdir()] if (tmp_path / "out").exists() else []
    assert not [name for name in left if name.endswith(".tmp")], left


def test_a_dead_saves_temporary_folders_are_removed_by_the_next_save(tmp_path: Path) -> None:
    """A conversion killed (os._exit) after its commit point, between two folder renames, leaves
    its temporary folders; the next conversion to that destination removes them."""
    import subprocess
    import sys

    _st_folder(tmp_path / "hf")
    code = f"""
import os
import parallel_dcp
from parallel_dcp.storage import local_staging
real = local_staging.rename_name
def die_at_a_folder(directory, source, target, *, replace):
    if target == "3_Deep":
        os._exit(9)
    real(directory, source, target, replace=replace)
local_staging.rename_name = die_at_a_folder
parallel_dcp.convert({str(tmp_path / "hf")!r}, {str(tmp_path / "out")!r}, to="safetensors", workers=1)
"""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 9, run.stdout + run.stderr
    assert [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".3_Deep.") and p.is_dir()]
    with pytest.warns(UserWarning, match="leftover"):
        parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to="safetensors", overwrite=True, workers=1)
    assert not [p.name for p in (tmp_path / "out").iterdir() if p.name.endswith(".tmp")]
    assert (tmp_path / "out" / "3_Deep" / "a" / "b" / "notes.txt").read_bytes() == b"nested"


def test_a_hugging_face_cache_snapshot_with_folders(tmp_path: Path) -> None:
    """huggingface_hub's cache: snapshots/<rev>/ holds real folders of links into ../../blobs/;
    those links stay inside the repository's cache folder, so they are followed."""
    repo = tmp_path / "hub" / "models--org--minilm"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    (snapshot / "1_Pooling").mkdir(parents=True)
    st.save_file({"w": torch.ones(2, 2)}, repo / "blobs" / "b1")
    (repo / "blobs" / "b2").write_bytes(b'{"pooling_mode_mean_tokens": true}')
    (snapshot / "model.safetensors").symlink_to("../../blobs/b1")
    (snapshot / "1_Pooling" / "config.json").symlink_to("../../../blobs/b2")
    parallel_dcp.convert(snapshot, tmp_path / "out", to="safetensors", workers=1)
    assert (tmp_path / "out" / "1_Pooling" / "config.json").read_bytes() == b'{"pooling_mode_mean_tokens": true}'
    assert not (tmp_path / "out" / "1_Pooling" / "config.json").is_symlink()


def test_a_trainers_checkpoints_and_logs_are_not_copied_as_side_folders(tmp_path: Path) -> None:
    """A Hugging Face Trainer's output folder holds ``checkpoint-N/`` (whole models) and ``runs/``
    (TensorBoard logs): neither is a module of the model, so neither comes along."""
    _st_folder(tmp_path / "hf")
    for folder in ("checkpoint-500", "runs/Dec05_01-00-00"):
        (tmp_path / "hf" / folder).mkdir(parents=True)
        (tmp_path / "hf" / folder / "trainer_state.json").write_bytes(b"{}")
    (tmp_path / "hf" / "checkpoint-notes").mkdir()  # not a Trainer checkpoint: copied like any folder
    (tmp_path / "hf" / "checkpoint-notes" / "a.txt").write_bytes(b"a")
    parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", to="safetensors", workers=1)
    tree = _tree(tmp_path / "out")
    assert not any(name.startswith(("checkpoint-500/", "runs/")) for name in tree)
    assert tree["checkpoint-notes/a.txt"] == b"a"
    assert tree["1_Pooling/config.json"] == FOLDERS["1_Pooling/config.json"]
