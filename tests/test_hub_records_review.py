"""Review s15 rev1 of the hub-record change (F1-F4, F6, F7, F10): what a record covers is decided
by where a name leads and by which files the job reads.

- F4, F2: a snapshot's file named through the user's own link (``~/m.pt -> snapshots/<rev>/m.pt``)
  converted its damaged bytes without a word (the record was looked for beside the typed name
  only); the snapshot's link on the way now decides.
- F1: a recorded folder that also holds a file the record does not list (the hub's safetensors bot
  puts ``model.safetensors`` beside recorded ``.bin`` shards) was refused "restore it": such a file
  is checked against its own record, or read unchecked with a warning naming it.
- F10: a model card edited on the hub failed verify of a clean download "(bytes appended?)".
- F3: a mismatch in the cache said "damaged; restore it" where the uploader may have left the
  record stale; F6: a header-record failure named the blob's hash only; F7: a dangling record link
  in a plain folder was explained as a file of the cache.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
from safetensors.torch import save_file

import parallel_dcp
from parallel_dcp import SourceChecksumError, SourceNotCheckedWarning
from tests.test_convert_checks_shared_files import _flip_inside
from tests.test_hub_records import _hub, _state, hub_pt, ours

__all__ = ["hub_pt", "ours"]  # (fixtures, used by name)


def test_a_snapshot_shard_named_through_the_users_link_is_checked(ours: Path, tmp_path: Path) -> None:
    model = _hub(ours, tmp_path)
    shard = sorted(model.glob("*.safetensors"))[-1]
    mine = tmp_path / "mine.safetensors"
    mine.symlink_to(shard)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SourceNotCheckedWarning)
        assert parallel_dcp.verify(mine, workers=1).ok
    blob = Path(os.path.realpath(shard))
    _flip_inside(blob, _state()["layer3.weight"])
    with pytest.raises(SourceChecksumError, match=rf"mine\.safetensors -> {blob}: its bytes are not .*\.parallel_dcp"):
        parallel_dcp.convert(mine, tmp_path / "out", workers=1)
    problems = parallel_dcp.verify(mine, workers=1).problems
    assert len(problems) == 1 and problems[0].startswith(f"file mine.safetensors -> {blob}: checksum"), problems


def test_a_snapshot_torch_file_named_through_the_users_link_is_checked_against_its_sidecar(
    hub_pt: Path, tmp_path: Path
) -> None:
    latest = tmp_path / "latest.pt"
    latest.symlink_to(hub_pt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SourceNotCheckedWarning)  # ("a plain file, put there since")
        parallel_dcp.convert(latest, tmp_path / "clean", workers=1)
        report = parallel_dcp.verify(latest, workers=1)
    assert report.ok and report.files_checked == 1, report.problems
    blob = Path(os.path.realpath(hub_pt))
    _flip_inside(blob, _state()["layer2.weight"])
    with pytest.raises(SourceChecksumError, match=rf"latest\.pt -> {blob}: its bytes are not") as caught:
        parallel_dcp.convert(latest, tmp_path / "damaged", workers=1)
    # (F3: in the cache, the uploader may have left the record stale: both, and the way out of each)
    message = str(caught.value)
    assert "its uploader replaced it on the hub" in message and "--no-source-checks" in message, message
    assert message.endswith(f"download it again (force_download=True, or delete {blob} first)"), message


@pytest.fixture
def bin_folder(tmp_path: Path) -> Path:
    """Our torch Hugging Face folder (its record lists the .bin shards and their index)."""
    dcp = tmp_path / "made_dcp"
    parallel_dcp.save(_state(), dcp, workers=1)
    folder = tmp_path / "bin"
    parallel_dcp.convert(dcp, folder, workers=1, to="torch", shard_size="12KB")
    assert len(list(folder.glob("*.bin"))) > 1
    return folder


@pytest.mark.parametrize("hub", [False, True], ids=["local", "snapshot"])
def test_a_safetensors_file_the_bot_added_beside_recorded_bin_shards_is_read_with_a_warning(
    hub: bool, bin_folder: Path, tmp_path: Path
) -> None:
    save_file(_state(), bin_folder / "model.safetensors")  # (no record of its own, as the bot writes it)
    model = _hub(bin_folder, tmp_path) if hub else bin_folder
    with pytest.warns(SourceNotCheckedWarning, match=r"model\.safetensors, which its reads open, is not in its"):
        parallel_dcp.convert(model, tmp_path / "out", workers=1)
    report = parallel_dcp.verify(model, workers=1)
    assert report.ok, report.problems
    assert [w.split(":")[0] for w in report.warnings] == ["file model.safetensors"], report.warnings


def test_our_own_safetensors_file_beside_recorded_bin_shards_is_checked_by_its_header(
    bin_folder: Path, tmp_path: Path
) -> None:
    parallel_dcp.convert(bin_folder, bin_folder / "model.safetensors", workers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SourceNotCheckedWarning)
        parallel_dcp.convert(bin_folder, tmp_path / "clean", workers=1)
        report = parallel_dcp.verify(bin_folder, workers=1)
    assert report.ok and not report.warnings, (report.problems, report.warnings)
    _flip_inside(bin_folder / "model.safetensors", _state()["layer1.weight"])
    with pytest.raises(SourceChecksumError, match=r"model\.safetensors: its bytes are not .* in its header"):
        parallel_dcp.convert(bin_folder, tmp_path / "damaged", workers=1)
    assert [p.split(":")[0] for p in parallel_dcp.verify(bin_folder, workers=1).problems] == ["file model.safetensors"]


def test_a_model_card_edited_on_the_hub_is_a_warning_of_verify_not_a_failure(ours: Path, tmp_path: Path) -> None:
    (ours / "README.md").write_text("# ours\n")
    out = tmp_path / "with_card"
    parallel_dcp.convert(ours, out, workers=1, to="safetensors")  # (README.md copied and recorded)
    assert "README.md" in json.loads((out / ".parallel_dcp.json").read_text())["files"]
    (out / "README.md").write_text("---\nlicense: mit\n---\n# ours, edited on the hub\n")
    model = _hub(out, tmp_path)
    report = parallel_dcp.verify(model, workers=1)
    assert report.ok, report.problems
    assert len(report.warnings) == 1 and report.warnings[0].startswith("file README.md -> "), report.warnings
    assert "documentation" in report.warnings[0] and "appended" not in report.warnings[0]
    (out / "config.json").write_text('{"model_type": "gpt2"}')  # (a file loads read: still a failure)
    assert [p.split(":")[0] for p in parallel_dcp.verify(out, workers=1).problems] == ["file config.json"]


def test_a_header_record_failure_in_a_snapshot_names_the_link_and_the_blob(tmp_path: Path) -> None:
    dcp = tmp_path / "made_dcp"
    parallel_dcp.save(_state(), dcp, workers=1)
    (tmp_path / "one").mkdir()
    parallel_dcp.convert(dcp, tmp_path / "one" / "model.safetensors", workers=1)
    file = _hub(tmp_path / "one", tmp_path) / "model.safetensors"
    blob = Path(os.path.realpath(file))
    data = blob.read_bytes()
    blob.write_bytes(data.replace(b'"layer0.weight"', b'"layer9.weight"', 1))
    problems = parallel_dcp.verify(file, workers=1).problems
    assert problems[0].startswith(f"file model.safetensors -> {blob}: its header"), problems
    with pytest.raises(SourceChecksumError) as caught:
        parallel_dcp.convert(file, tmp_path / "out", workers=1)
    assert str(caught.value).startswith(f"{file} -> {blob}: its header"), caught.value


def test_a_dangling_record_link_in_a_plain_folder_is_not_called_a_file_of_the_cache(ours: Path, tmp_path: Path) -> None:
    record = ours / ".parallel_dcp.json"
    (ours / "store").mkdir()
    record.rename(ours / "store" / "record.json")
    record.symlink_to(Path("store") / "record.json")
    (ours / "store" / "record.json").unlink()
    with pytest.warns(SourceNotCheckedWarning, match="which does not exist") as caught:
        parallel_dcp.convert(ours, tmp_path / "out", workers=1)
    assert "cache" not in str(caught[0].message) and "moved or deleted" in str(caught[0].message)


def test_several_sources_a_changed_index_is_refused_before_the_first_is_written(ours: Path, tmp_path: Path) -> None:
    """F8: a later source's changed recorded index needs no hashing, so it is refused before the
    first source is converted; F6 (API): damage found later names the committed outputs in the error."""
    good, changed = tmp_path / "good", tmp_path / "changed"
    shutil.copytree(ours, good)
    shutil.copytree(ours, changed)
    index = changed / "model.safetensors.index.json"
    index.write_text(index.read_text() + " ")
    with pytest.raises(SourceChecksumError, match=r"changed/model\.safetensors\.index\.json: its bytes are not"):
        parallel_dcp.convert([good, changed], tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")

    shutil.rmtree(changed)
    shutil.copytree(ours, changed)
    _flip_inside(sorted(changed.glob("*.safetensors"))[-1], _state()["layer3.weight"])
    with pytest.raises(SourceChecksumError) as caught:
        parallel_dcp.convert([good, changed], tmp_path / "out2", workers=1)
    assert str(caught.value).endswith(f"(converted and committed before it: {tmp_path / 'out2' / 'good'})")


def test_a_link_into_the_cache_beside_a_folder_record_naming_it_is_warned_of(ours: Path, tmp_path: Path) -> None:
    """An old ``local_dir`` download (huggingface_hub 0.17-0.22, symlinks "auto"): big files are
    links into the cache's blobs, ``.parallel_dcp.json`` a copy beside them. One named alone was
    converted unchecked without a word; the record beside the link is not its (a link may have
    been repointed), but it is said."""
    model = _hub(ours, tmp_path)
    local = tmp_path / "local"
    local.mkdir()
    shard = sorted(model.glob("*.safetensors"))[0]
    (local / shard.name).symlink_to(os.path.realpath(shard))
    shutil.copy(model / ".parallel_dcp.json", local / ".parallel_dcp.json")
    with pytest.warns(SourceNotCheckedWarning, match=r"the \.parallel_dcp\.json beside the link .* records a file"):
        parallel_dcp.convert(local / shard.name, tmp_path / "out", workers=1)
    problems = parallel_dcp.verify(local / shard.name, workers=1).problems
    assert len(problems) == 1 and "records a file of its name, but is not used" in problems[0], problems
