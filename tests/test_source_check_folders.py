"""A file's own record is used whichever way the file is reached: named, or through its folder.

- A folder holding one parallel_dcp ``model.safetensors`` (its checksums in its header) or one
  ``pytorch_model.bin`` with its sidecar, and no ``.parallel_dcp.json`` (``convert ckpt
  folder/model.safetensors`` plus a config.json: the usual model folder, a hub upload), was
  checked when the file was named, but the folder named converted a damaged shard without a word
  and ``verify`` of the folder said OK. The folder's shards' own records are now its record.
- One shard of a folder parallel_dcp wrote, named alone, is checked against the folder's record.
- A name through a link is resolved once, and the job reads, checks and hashes what it led to
  then: a source folder (``latest -> step-100/``) and a single file (``latest.pt``) alike.
- verify says a stale record is stale; a dangling link in a folder names itself; a record beside
  the middle link of a chain is warned of (review s14 F14, F11, F5).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import parallel_dcp
from tests.conftest import save_with_a_stale_manifest
from tests.test_convert_checks_shared_files import _flip_inside


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {"w": torch.randn(96, 64, generator=gen), "tgt": torch.randn(64, 128, generator=gen)}


def _model_folder(tmp: Path, name: str) -> Path:
    """A model folder of one file ``name`` written by parallel_dcp (its own record: header or
    sidecar) beside a config.json, with no folder record."""
    dcp = tmp / "made_dcp"
    parallel_dcp.save(_state(), dcp, workers=1)
    folder = tmp / "model"
    folder.mkdir()
    parallel_dcp.convert(dcp, folder / name, workers=1)
    (folder / "config.json").write_text("{}")
    assert not (folder / ".parallel_dcp.json").exists()
    return folder


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_a_folder_checks_its_files_own_records(tmp_path: Path, name: str) -> None:
    folder = _model_folder(tmp_path, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (clean: checked, nothing to warn of)
        parallel_dcp.convert(folder, tmp_path / "clean_out", workers=2)
        report = parallel_dcp.verify(folder)
    assert report.problems == [] and report.manifest and report.files_checked == 1

    _flip_inside(folder / name, _state()["tgt"])
    with pytest.raises(parallel_dcp.SourceChecksumError, match=rf"model/{name}: its bytes are not"):
        parallel_dcp.convert(folder, tmp_path / "out", workers=2)
    assert not (tmp_path / "out").exists()
    assert [p.split(":")[0] for p in parallel_dcp.verify(folder).problems] == [f"file {name}"]


def test_a_folder_whose_file_links_within_it_checks_the_file_it_leads_to(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path, "model.safetensors")
    (folder / "store").mkdir()
    (folder / "model.safetensors").rename(folder / "store" / "model.safetensors")
    (folder / "model.safetensors").symlink_to("store/model.safetensors")
    _flip_inside(folder / "store" / "model.safetensors", _state()["tgt"])
    with pytest.raises(parallel_dcp.SourceChecksumError, match=r"model\.safetensors -> .*store/model\.safetensors"):
        parallel_dcp.convert(folder, tmp_path / "out", workers=1)
    assert len(parallel_dcp.verify(folder).problems) == 1


@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_one_shard_named_alone_is_checked_against_its_folders_record(tmp_path: Path, to: str) -> None:
    """One shard of a Hugging Face folder parallel_dcp wrote, named alone: its checksum is in the
    ``.parallel_dcp.json`` beside it (the folder's shards carry no record of their own), which
    was never looked at: converted unchecked, without a word, and ``verify`` said no record exists."""
    dcp = tmp_path / "made_dcp"
    parallel_dcp.save(_state(), dcp, workers=1)
    folder = tmp_path / "hf"
    parallel_dcp.convert(dcp, folder, workers=1, to=to, shard_size="20KB")
    shard = next(p for p in sorted(folder.iterdir()) if p.read_bytes().find(_raw("tgt")) >= 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallel_dcp.convert(shard, tmp_path / "clean_out", workers=1)
    assert parallel_dcp.verify(shard).problems == []

    _flip_inside(shard, _state()["tgt"])
    with pytest.raises(parallel_dcp.SourceChecksumError, match=r"checksum in \.parallel_dcp\.json"):
        parallel_dcp.convert(shard, tmp_path / "out", workers=1)
    assert parallel_dcp.verify(shard).problems == [
        next(p for p in parallel_dcp.verify(folder).problems if p.startswith(f"file {shard.name}:"))
    ]


def _raw(key: str) -> bytes:
    return _state()[key].contiguous().numpy().tobytes()[:256]


def test_a_folder_named_through_a_link_repointed_mid_job_is_read_from_one_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training run's ``latest -> step-100/``, repointed to ``step-200/`` (``ln -sfn``) after the
    job's first task: every shard open walked the link again, so one output held the first key of
    step-100 and the rest of step-200 (stock DCP's shard names are the same in both saves), and it
    verified clean. The folder is now resolved once, when the source is opened."""
    import torch.distributed.checkpoint as dcp

    from parallel_dcp.engine import pool

    for step in (100, 200):
        state = {f"k{i:02d}": torch.full((64, 64), float(step + i)) for i in range(8)}
        dcp.save(state, checkpoint_id=tmp_path / f"step-{step}")
    latest = tmp_path / "latest"
    latest.symlink_to("step-100")
    run = pool.WorkerPool.run

    def run_then_repoint(self: pool.WorkerPool, tasks: object, *args: object, **kwargs: object) -> object:
        for n, result in enumerate(run(self, tasks, *args, **kwargs)):  # type: ignore[arg-type]
            if n == 0 and os.readlink(latest) == "step-100":
                latest.unlink()
                latest.symlink_to("step-200")
            yield result

    monkeypatch.setattr(pool.WorkerPool, "run", run_then_repoint)
    out = tmp_path / "out"
    parallel_dcp.convert(latest, out, to="safetensors", shard_size="20KB", workers=2)
    assert os.readlink(latest) == "step-200"  # (the repoint happened mid-job)
    got = parallel_dcp.load(out)
    assert {k: got[k].unique().tolist() for k in got} == {f"k{i:02d}": [100.0 + i] for i in range(8)}


def _two_steps_and_latest(tmp_path: Path) -> Path:
    """``step-100/`` and ``step-200/`` saved by stock DCP (the same shard names, other offsets: 200
    holds one key more, first), and ``latest -> step-100``."""
    import torch.distributed.checkpoint as dcp

    for step in (100, 200):
        state = {f"k{i:02d}": torch.full((64, 64), float(step + i)) for i in range(8)}
        if step == 200:
            state = {"a_first": torch.zeros(32, 64), **state}
        dcp.save(state, checkpoint_id=tmp_path / f"step-{step}")
    latest = tmp_path / "latest"
    latest.symlink_to("step-100")
    return latest


@pytest.mark.parametrize("route", ["load", "load(into=)", "dcp.load(FastReader)"])
def test_a_load_through_a_folder_link_repointed_after_its_metadata_reads_one_checkpoint(
    route: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same repoint under a load: ``.metadata`` read from step-100, then each shard opened
    through the link again read step-200's bytes at step-100's offsets. Resolved once now."""
    import torch.distributed.checkpoint as dcp

    from parallel_dcp.storage import metadata as metadata_module

    latest = _two_steps_and_latest(tmp_path)
    read = metadata_module._read_metadata

    def read_then_repoint(*args: object, **kwargs: object) -> object:
        found = read(*args, **kwargs)
        if os.readlink(latest) == "step-100":
            latest.unlink()
            latest.symlink_to("step-200")
        return found

    monkeypatch.setattr(metadata_module, "_read_metadata", read_then_repoint)
    wanted = {f"k{i:02d}": [100.0 + i] for i in range(8)}
    if route == "load":
        got = parallel_dcp.load(latest, workers=2)
    else:
        got = {k: torch.empty(64, 64) for k in wanted}
        if route == "load(into=)":
            parallel_dcp.load(latest, into=got, workers=2)
        else:
            dcp.load(got, storage_reader=parallel_dcp.FastReader(latest, workers=2))
    assert os.readlink(latest) == "step-200"  # (the repoint happened after .metadata was read)
    assert {k: got[k].unique().tolist() for k in got} == wanted


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_file_link_repointed_between_listing_and_check_is_checked_as_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str
) -> None:
    """``latest.pt -> step1.pt`` (damaged) repointed to a clean ``step2.pt`` (``ln -sf``) after the
    source's files were listed but before its record was looked up: the name was resolved again
    there, so the check hashed step2 and passed while the job converted step1. Its name is now
    resolved once; the check hashes the file the job reads."""
    from parallel_dcp.jobs import source_check

    dcp = tmp_path / "made_dcp"
    parallel_dcp.save(_state(), dcp, workers=1)
    for step in ("step1", "step2"):
        parallel_dcp.convert(dcp, tmp_path / f"{step}{suffix}", workers=1)
    _flip_inside(tmp_path / f"step1{suffix}", _state()["tgt"])
    latest = tmp_path / f"latest{suffix}"
    latest.symlink_to(f"step1{suffix}")
    recorded = source_check.recorded_checksums

    def repointed_first(source: object) -> object:
        latest.unlink()
        latest.symlink_to(f"step2{suffix}")
        return recorded(source)  # type: ignore[arg-type]

    monkeypatch.setattr(source_check, "recorded_checksums", repointed_first)
    with pytest.raises(parallel_dcp.SourceChecksumError, match=rf"step1{re.escape(suffix)}: its bytes are not"):
        parallel_dcp.convert(latest, tmp_path / "out", workers=2)
    assert os.readlink(latest) == f"step2{suffix}"


def test_verify_says_a_stale_manifest_is_stale_not_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A save stopped between its commit's two renames leaves the old save's record beside the new
    ``.metadata``: not used (no corruption: OK), but verify printed "OK (no manifest; ...)" as
    if there were none."""
    from parallel_dcp import cli

    src = tmp_path / "src"
    save_with_a_stale_manifest(src)
    report = parallel_dcp.verify(src, workers=1)  # (reported, not warned of: review s14 F15)
    assert report.ok and not report.manifest and report.manifest_stale
    assert any("stale" in warning and "no file was checked" in warning for warning in report.warnings)
    capsys.readouterr()
    assert cli.main(["verify", str(src), "--workers", "1"]) == 0  # (the CLI prints the warning)
    out = capsys.readouterr().out
    assert "stale manifest, not used" in out and "no manifest" not in out and "warning: " in out


def test_a_dangling_link_in_a_folder_is_named_as_a_link_to_a_missing_file(tmp_path: Path) -> None:
    """A Hugging Face folder's file that links within it to a file that is gone (a hub snapshot
    whose blob was deleted, an interrupted download) was a raw ``[Errno 2]`` naming only the
    missing target, or "vanished: the checkpoint changed while reading"."""
    dcp = tmp_path / "made_dcp"
    parallel_dcp.save(_state(), dcp, workers=1)
    first = tmp_path / "first"
    parallel_dcp.convert(dcp, first, workers=1, to="safetensors")
    (first / "config.json").write_text("{}")
    folder = tmp_path / "hf"
    parallel_dcp.convert(first, folder, workers=1, to="safetensors")  # (config.json recorded)
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to("store/config.json")
    gone = rf"{re.escape(str(folder / 'config.json'))} is a link to .*store/config\.json, which does not exist"
    link, target = folder / "config.json", folder / "store" / "config.json"
    assert [p for p in parallel_dcp.verify(folder).problems if "config.json" in p] == [
        f"file config.json: {link} is a link to {target}, which does not exist"
    ]
    with pytest.raises(FileNotFoundError, match=gone):
        parallel_dcp.convert(folder, tmp_path / "out", workers=1, to="safetensors")
    (folder / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (folder / "model.safetensors").symlink_to("store/model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors is a link to .*store/model\.safetensors, which"):
        parallel_dcp.load(folder)


def test_a_record_beside_the_middle_link_of_a_chain_is_warned_of(tmp_path: Path) -> None:
    """``run/latest.pt -> ../ckpt/mid.pt -> ../store/real.pt``, the record left beside ``ckpt/mid.pt``
    (the file moved to the store and linked back): named as ``ckpt/mid.pt`` it was warned of, named
    as ``run/latest.pt`` it converted unchecked without a word, and verify looked beside the wrong name."""
    dcp = tmp_path / "made_dcp"
    parallel_dcp.save(_state(), dcp, workers=1)
    for folder in ("run", "ckpt", "store"):
        (tmp_path / folder).mkdir()
    parallel_dcp.convert(dcp, tmp_path / "ckpt" / "mid.pt", workers=1)
    (tmp_path / "ckpt" / "mid.pt").rename(tmp_path / "store" / "real.pt")
    (tmp_path / "ckpt" / "mid.pt").symlink_to("../store/real.pt")
    latest = tmp_path / "run" / "latest.pt"
    latest.symlink_to("../ckpt/mid.pt")
    record = re.escape(str(tmp_path / "ckpt" / "mid.pt.manifest.json"))
    with pytest.warns(parallel_dcp.SourceNotCheckedWarning, match=rf"{record} beside the link is not used"):
        parallel_dcp.convert(latest, tmp_path / "out", workers=1)
    (problem,) = parallel_dcp.verify(latest).problems
    assert re.search(rf"real\.pt\.manifest\.json beside it; {record}", problem), problem


def test_a_folder_named_with_dotdot_after_a_link_keeps_the_tree_its_reads_open(tmp_path: Path) -> None:
    """``lnk -> real/sub``: ``lnk/../hf`` is ``real/hf`` to the kernel but ``hf`` to abspath, so the
    tree its links were checked against was the wrong folder: a clean link within ``real/hf`` was
    refused, and a link out of it into ``hf`` was followed (review s14 F12)."""
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "lnk").symlink_to("real/sub")
    folder = tmp_path / "real" / "hf"
    (folder / "store").mkdir(parents=True)
    save_file({"w": torch.ones(4, 4)}, folder / "store" / "model.safetensors")
    (folder / "model.safetensors").symlink_to("store/model.safetensors")
    named = tmp_path / "lnk" / ".." / "hf"
    assert torch.equal(parallel_dcp.load(named)["w"], torch.ones(4, 4))  # (within its tree)

    (tmp_path / "hf").mkdir()
    save_file({"w": torch.full((4, 4), 7.0)}, tmp_path / "hf" / "outside.safetensors")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(tmp_path / "hf" / "outside.safetensors")
    with pytest.raises(parallel_dcp.UnsafeCheckpointError, match="leading out of"):
        parallel_dcp.load(named)


def test_verify_hashes_a_module_file_that_links_within_the_folder_where_it_leads(tmp_path: Path) -> None:
    """A converted sentence-transformers folder whose recorded ``1_Pooling/config.json`` is a link
    within it (``-> ../store/pool.json``, same bytes; in a hub snapshot every module file is such a
    link): convert copies it, but verify reported "is a symlink; refusing to follow it" (review s14 F9)."""
    src = tmp_path / "src"
    (src / "1_Pooling").mkdir(parents=True)
    save_file({"embeddings.w": torch.randn(128, 64)}, src / "model.safetensors")
    (src / "config.json").write_text('{"model_type": "bert"}')
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (src / "modules.json").write_text(json.dumps(modules))
    (src / "1_Pooling" / "config.json").write_text('{"word_embedding_dimension": 64}')
    out = tmp_path / "out"
    parallel_dcp.convert(src, out, workers=1, to="safetensors", shard_size="20KB")
    assert "1_Pooling/config.json" in json.loads((out / ".parallel_dcp.json").read_text())["folder_files"]
    (out / "store").mkdir()
    (out / "1_Pooling" / "config.json").rename(out / "store" / "pool.json")
    (out / "1_Pooling" / "config.json").symlink_to("../store/pool.json")
    assert parallel_dcp.verify(out, workers=1).problems == []
    (out / "store" / "pool.json").write_text('{"word_embedding_dimension": 65}')
    problems = parallel_dcp.verify(out, workers=1).problems  # (named as linked and as read: review s14 F15)
    assert [p.split(": ")[0] for p in problems] == [f"file 1_Pooling/config.json -> {out / 'store' / 'pool.json'}"]
