"""A parallel_dcp checkpoint downloaded through the Hugging Face hub cache is checked, verify's
messages name what was read, and a recorded folder that changed is refused (review s14 F4, F15, t29).

- Every file of a hub snapshot, our record ``.parallel_dcp.json`` included, is a link into the
  repository's ``blobs/``. The record was read never through a link, so a conversion ran unchecked
  ("is a symlink; refusing to follow it") and ``verify`` raised on it: the record is now read by the
  rule its shards are read by (a link only within the repository's folder).
- A torch.save file of a snapshot (``model.pt`` and ``model.pt.manifest.json``, both links into
  ``blobs/``): the sidecar beside the link was "not used" as if a link had been repointed; in a
  snapshot it is one of the revision's files, so it is the file's record. A plain sidecar there is
  still not used, and the warning says why in the cache's terms.
- verify named a linked file by its record's name or the blob's hash, never "LINK -> FILE"; a plain
  file below a linked folder was named as a link; a stale record made verify warn (an error where a
  caller turns SourceNotCheckedWarning into errors) instead of reporting.
- A shard added to our folder after its record (and named in the index) converted without a word.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import parallel_dcp
from parallel_dcp import SourceChecksumError, SourceNotCheckedWarning
from tests.conftest import save_with_a_stale_manifest
from tests.test_convert_checks_shared_files import _flip_inside


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {f"layer{i}.weight": torch.randn(64 + i, 32, generator=gen) for i in range(4)}


def _hub(folder: Path, root: Path, below: str = "") -> Path:
    """``folder``'s files laid out as huggingface_hub lays out a download: each file a link
    ``snapshots/<rev>/[below/]NAME -> ../../[../]blobs/<sha256>``; returns the model's folder."""
    repo = root / "hub" / "models--org--ours"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    model = repo / "snapshots" / "5eed" / below
    model.mkdir(parents=True)
    up = [".."] * (2 + len(Path(below).parts))
    for name in sorted(os.listdir(folder)):
        data = (folder / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (model / name).symlink_to(Path(*up, "blobs", blob.name))
    return model


@pytest.fixture
def ours(tmp_path: Path) -> Path:
    """A sharded safetensors folder parallel_dcp wrote (its record, an index, a config.json)."""
    dcp = tmp_path / "made_dcp"
    parallel_dcp.save(_state(), dcp, workers=1)
    hf = tmp_path / "hf"
    parallel_dcp.convert(dcp, hf, workers=1, to="safetensors", shard_size="12KB")
    (hf / "config.json").write_text('{"model_type": "bert"}')
    assert len(list(hf.glob("*.safetensors"))) > 2 and (hf / ".parallel_dcp.json").exists()
    return hf


@pytest.mark.parametrize("below", ["", "unet"], ids=["snapshot", "subfolder"])
def test_our_folder_in_the_hub_cache_is_checked_by_convert_and_verify(below: str, ours: Path, tmp_path: Path) -> None:
    model = _hub(ours, tmp_path, below)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SourceNotCheckedWarning)  # (it converted unchecked, warning so)
        parallel_dcp.convert(model, tmp_path / "clean", workers=2)
        report = parallel_dcp.verify(model, workers=2)  # (it raised on the linked record)
    recorded = json.loads((ours / ".parallel_dcp.json").read_text())["files"]
    assert report.ok and report.manifest and report.files_checked == len(recorded), report.problems

    shards = sorted(model.glob("*.safetensors"))
    blob = Path(os.path.realpath(shards[-1]))
    _flip_inside(blob, _state()["layer3.weight"])
    with pytest.raises(SourceChecksumError, match=rf"{shards[-1].name} -> {blob}: its bytes are not"):
        parallel_dcp.convert(model, tmp_path / "damaged", workers=2)
    assert not (tmp_path / "damaged").exists()
    problems = parallel_dcp.verify(model, workers=2).problems
    assert [p for p in problems if p.startswith("file ")] == [
        next(p for p in problems if p.startswith(f"file {shards[-1].name} -> {blob}: checksum"))
    ]


def test_a_record_in_the_cache_that_links_out_or_to_a_missing_blob_is_named_not_followed(
    ours: Path, tmp_path: Path
) -> None:
    model = _hub(ours, tmp_path)
    record = model / ".parallel_dcp.json"
    outside = tmp_path / "outside.json"
    outside.write_bytes(record.read_bytes())
    record.unlink()
    record.symlink_to(outside)
    with pytest.warns(SourceNotCheckedWarning, match="symlink leading out"):
        parallel_dcp.convert(model, tmp_path / "out1", workers=1)
    with pytest.raises(parallel_dcp.UnsafeCheckpointError, match="symlink leading out"):
        parallel_dcp.verify(model, workers=1)

    record.unlink()
    record.symlink_to("../../blobs/" + "0" * 64)  # (a blob deleted from the cache, a download cut short)
    with pytest.warns(SourceNotCheckedWarning, match=r"which does not exist \(a file of the cache deleted"):
        parallel_dcp.convert(model, tmp_path / "out2", workers=1)


@pytest.fixture
def hub_pt(tmp_path: Path) -> Path:
    """``snapshots/<rev>/pytorch_model.bin`` and its ``.manifest.json``, both links into ``blobs/``."""
    dcp = tmp_path / "made_dcp"
    parallel_dcp.save(_state(), dcp, workers=1)
    folder = tmp_path / "pt"
    folder.mkdir()
    parallel_dcp.convert(dcp, folder / "pytorch_model.bin", workers=1)  # (its folder a source too)
    assert sorted(os.listdir(folder)) == ["pytorch_model.bin", "pytorch_model.bin.manifest.json"]
    return _hub(folder, tmp_path) / "pytorch_model.bin"


def test_a_torch_file_in_the_hub_cache_is_checked_against_the_snapshots_sidecar(hub_pt: Path, tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", SourceNotCheckedWarning)
        parallel_dcp.convert(hub_pt, tmp_path / "clean", workers=2)
        parallel_dcp.convert(hub_pt.parent, tmp_path / "clean_folder", workers=2)
    report = parallel_dcp.verify(hub_pt, workers=1)
    assert report.ok and report.manifest and report.files_checked == 1, report.problems
    assert parallel_dcp.verify(hub_pt.parent, workers=1).files_checked == 1

    blob = Path(os.path.realpath(hub_pt))
    _flip_inside(blob, _state()["layer2.weight"])
    mismatch = rf"pytorch_model\.bin -> {blob}: its bytes are not .* pytorch_model\.bin\.manifest"
    with pytest.raises(SourceChecksumError, match=mismatch):
        parallel_dcp.convert(hub_pt, tmp_path / "damaged", workers=2)
    with pytest.raises(SourceChecksumError, match=rf"pytorch_model\.bin -> {blob}: its bytes are not"):
        parallel_dcp.convert(hub_pt.parent, tmp_path / "damaged_folder", workers=2)
    problems = parallel_dcp.verify(hub_pt, workers=1).problems
    assert len(problems) == 1 and problems[0].startswith(f"file pytorch_model.bin -> {blob}: checksum"), problems


def test_a_plain_sidecar_in_a_snapshot_is_not_used_and_the_warning_says_so_in_the_caches_terms(
    hub_pt: Path, tmp_path: Path
) -> None:
    sidecar = hub_pt.parent / "pytorch_model.bin.manifest.json"
    data = sidecar.read_bytes()
    sidecar.unlink()
    sidecar.write_bytes(data)  # (put there since: not one of the revision's files)
    with pytest.warns(SourceNotCheckedWarning, match="not one of the snapshot's files") as caught:
        parallel_dcp.convert(hub_pt, tmp_path / "out", workers=1)
    assert "repointed" not in str(caught[0].message)
    problems = parallel_dcp.verify(hub_pt, workers=1).problems
    assert len(problems) == 1 and "not one of the snapshot's files" in problems[0], problems


def test_a_plain_file_below_a_linked_folder_is_not_named_as_a_link(tmp_path: Path) -> None:
    """``/data -> /mnt/data``: ``/data/m.pt`` is no link; its refusal named it "/data/m.pt ->
    /mnt/data/m.pt" as if it were one."""
    dcp = tmp_path / "made_dcp"
    parallel_dcp.save(_state(), dcp, workers=1)
    (tmp_path / "real").mkdir()
    parallel_dcp.convert(dcp, tmp_path / "real" / "m.pt", workers=1)
    _flip_inside(tmp_path / "real" / "m.pt", _state()["layer1.weight"])
    (tmp_path / "linked").symlink_to(tmp_path / "real")
    with pytest.raises(SourceChecksumError) as caught:
        parallel_dcp.convert(tmp_path / "linked" / "m.pt", tmp_path / "out", workers=1)
    assert str(caught.value).startswith(f"{tmp_path / 'linked' / 'm.pt'}: its bytes are not"), caught.value


def test_verify_reports_a_stale_record_where_unchecked_conversions_are_errors(tmp_path: Path) -> None:
    """A caller that turns SourceNotCheckedWarning into errors around its conversions got verify
    raising on a stale record instead of its report."""
    src = tmp_path / "src"
    save_with_a_stale_manifest(src)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SourceNotCheckedWarning)
        report = parallel_dcp.verify(src, workers=1)
        with pytest.raises(SourceNotCheckedWarning, match="stale"):  # (a conversion still says it)
            parallel_dcp.convert(src, tmp_path / "out", workers=1, to="safetensors")
    assert report.ok and report.manifest_stale and not report.manifest
    assert any("stale" in w and "no file was checked" in w for w in report.warnings), report.warnings


def test_a_shard_added_to_our_folder_after_its_record_is_refused_and_reported(ours: Path, tmp_path: Path) -> None:
    save_file({"extra": torch.full((16, 32), 1.5)}, ours / "model-extra.safetensors")
    index = json.loads((ours / "model.safetensors.index.json").read_text())
    index["weight_map"]["extra"] = "model-extra.safetensors"
    (ours / "model.safetensors.index.json").write_text(json.dumps(index))
    # (the recorded index changed: refused by it, naming the added shard; the shard alone is no damage)
    added = r"index\.json: its bytes are not the ones .* also open model-extra\.safetensors, which the record does"
    with pytest.raises(SourceChecksumError, match=added):
        parallel_dcp.convert(ours, tmp_path / "out", workers=2)
    assert not (tmp_path / "out").exists()
    report = parallel_dcp.verify(ours, workers=1)
    assert [p.split(":")[0] for p in report.problems] == ["file model.safetensors.index.json"], report.problems
    assert any(w.startswith("file model-extra.safetensors: not in the manifest") for w in report.warnings)
    parallel_dcp.convert(ours, tmp_path / "anyway", workers=2, check_source=False)
    assert torch.equal(parallel_dcp.load(tmp_path / "anyway", workers=1)["extra"], torch.full((16, 32), 1.5))


def test_a_recorded_index_that_changed_is_refused_by_name(ours: Path, tmp_path: Path) -> None:
    """The index decides which shard each key is read from and holds no key, so no task hashed it."""
    index = ours / "model.safetensors.index.json"
    document = json.loads(index.read_text())
    document["metadata"]["total_size"] += 1
    index.write_text(json.dumps(document, indent=2))
    with pytest.raises(SourceChecksumError, match=r"model\.safetensors\.index\.json: its bytes are not the ones"):
        parallel_dcp.convert(ours, tmp_path / "out", workers=1)
    assert [p.split(":")[0] for p in parallel_dcp.verify(ours, workers=1).problems] == [
        "file model.safetensors.index.json"
    ]
