"""A converted Hugging Face folder keeps its non-weight files (issue 25, item 11).

transformers is not installed here, so ``from_pretrained`` itself is not run: what it reads is
checked instead (config.json and the tokenizer files byte for byte, the safetensors index valid
and naming every tensor's shard, each shard loading with safetensors' own reader).
"""

from __future__ import annotations

import json
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
    (where / "original").mkdir()  # subdirectories are not copied
    (where / "original" / "params.json").write_bytes(b"{}")
    return tensors


def _check_loadable(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    """What from_pretrained reads: config and tokenizer files, the index, every shard."""
    for name, data in KEEP.items():
        assert (out / name).read_bytes() == data, name
    assert not any((out / name).exists() for name in SKIP)
    assert not (out / "original").exists()
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
    assert code == 0 and "copies 7 files beside the weights: README.md, config.json" in capsys.readouterr().out
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
