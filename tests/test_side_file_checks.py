"""The files a conversion copies beside the weights are checked against the source folder's record.

A Hugging Face folder parallel_dcp wrote records every file in its ``.parallel_dcp.json``, its
copied ``config.json``, tokenizer files, model card and module folders (``1_Pooling/config.json``)
included. Its weights and its recorded index were checked when it was converted again, but the
side files were copied unchecked: a damaged or changed ``config.json`` went into the output, whose
own new record then blessed it (``verify`` of the source fails on it). Now:

- a recorded side file with other bytes is refused before any task runs (nothing written), by
  name and with both ways out; ``--no-source-checks`` converts it;
- a recorded documentation file (``README.md``) with other bytes is copied with a warning, as
  ``verify`` reports it (a warning line, not a problem);
- the bytes read at the commit are the bytes checked: a same-size rewrite while the job runs is
  refused there, nothing committed;
- a side file the record does not list is copied as before (unchecked, no warning);
- the same for ``--copy-files-from`` a recorded folder, and a hub snapshot of our folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import parallel_dcp
from parallel_dcp import SourceChecksumError, SourceNotCheckedWarning
from parallel_dcp.cli import main
from parallel_dcp.jobs import pipeline

CONFIG = '{"model_type": "bert", "hidden_size": 32}'


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {f"layer{i}.weight": torch.randn(32 + i, 16, generator=gen) for i in range(3)}


@pytest.fixture
def ours(tmp_path: Path) -> Path:
    """A Hugging Face folder parallel_dcp wrote by converting a model folder: its record lists
    its shards and the side files it copied (config.json, tokenizer.json, README.md and a module
    folder's 1_Pooling/config.json)."""
    model = tmp_path / "model"
    (model / "1_Pooling").mkdir(parents=True)
    save_file(_state(), model / "model.safetensors")
    (model / "config.json").write_text(CONFIG)
    (model / "tokenizer.json").write_text('{"version": "1.0"}')
    (model / "README.md").write_text("# a model\n")
    (model / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    folder = tmp_path / "ours"
    parallel_dcp.convert(model, folder, workers=1, to="safetensors")
    record = json.loads((folder / ".parallel_dcp.json").read_text())
    recorded = {*record["files"], *record["folder_files"]}
    assert {"config.json", "tokenizer.json", "README.md", "1_Pooling/config.json"} <= recorded, recorded
    return folder


def _rewrite_same_size(path: Path) -> None:
    """Other bytes of the same length (a flipped digit: a damaged copy, or an edit that kept the size)."""
    data = bytearray(path.read_bytes())
    at = data.index(b"32") if b"32" in data else len(data) // 2
    data[at] = ord("4") if data[at] != ord("4") else ord("5")
    path.write_bytes(bytes(data))


def _tree(folder: Path) -> dict[str, bytes]:
    return {
        os.fspath(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()
    }


def _no_task_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, any task run fails the test: a refusal must come before the workers start."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a task ran")

    monkeypatch.setattr(pipeline, "run_tasks", refuse)


@pytest.mark.parametrize("changed", ["config.json", "tokenizer.json", "1_Pooling/config.json"])
def test_a_changed_recorded_side_file_is_refused_before_anything_is_written(
    ours: Path, tmp_path: Path, changed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (ours / changed).write_text('{"edited": "after the record"}')
    _no_task_runs(monkeypatch)
    with pytest.raises(SourceChecksumError) as caught:
        parallel_dcp.convert(ours, tmp_path / "out", workers=1, to="safetensors")
    message = str(caught.value)
    assert message.startswith(f"{ours / changed}: its bytes are not the ones its checksum in .parallel_dcp.json"), (
        message
    )
    assert "--no-source-checks" in message and "check_source=False" in message and "restore it" in message, message
    assert not os.path.lexists(tmp_path / "out")


def test_an_existing_destination_is_left_as_it_was(ours: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    out.mkdir()
    parallel_dcp.convert(tmp_path / "model", out, workers=1, to="safetensors", overwrite=True)
    before = _tree(out)
    _rewrite_same_size(ours / "config.json")
    _no_task_runs(monkeypatch)
    with pytest.raises(SourceChecksumError, match=r"ours/config\.json: its bytes are not .* \(xxh3_64 "):
        parallel_dcp.convert(ours, out, workers=1, to="safetensors", overwrite=True)
    assert _tree(out) == before


def test_no_source_checks_converts_the_changed_file(
    ours: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (ours / "config.json").write_text('{"model_type": "bert", "edited": true}')
    code = main(["convert", os.fspath(ours), os.fspath(tmp_path / "refused"), "--to", "safetensors", "-q"])
    assert code == 1 and "ours/config.json: its bytes are not" in capsys.readouterr().err
    assert not os.path.lexists(tmp_path / "refused")
    code = main(
        ["convert", os.fspath(ours), os.fspath(tmp_path / "out"), "--to", "safetensors", "--no-source-checks", "-q"]
    )
    assert code == 0
    assert (tmp_path / "out" / "config.json").read_text() == '{"model_type": "bert", "edited": true}'
    parallel_dcp.convert(ours, tmp_path / "api", workers=1, to="safetensors", check_source=False)
    assert (tmp_path / "api" / "config.json").read_bytes() == (ours / "config.json").read_bytes()


def test_an_edited_model_card_is_copied_with_a_warning(ours: Path, tmp_path: Path) -> None:
    """verify's rule: a documentation file (``*.md``, ``.gitattributes``, ``LICENSE*``) that changed
    is a warning line, not damage (the hub edits model cards after an upload)."""
    (ours / "README.md").write_text("# a model\n\nEdited on the hub.\n")
    assert parallel_dcp.verify(ours, workers=1).ok
    said = r"ours/README\.md: .*not the ones its checksum .* copied as it is"
    with pytest.warns(SourceNotCheckedWarning, match=said):
        parallel_dcp.convert(ours, tmp_path / "out", workers=1, to="safetensors")
    assert (tmp_path / "out" / "README.md").read_text() == "# a model\n\nEdited on the hub.\n"
    assert parallel_dcp.verify(tmp_path / "out", workers=1).ok


def test_an_unrecorded_side_file_is_copied_unchecked_beside_checked_ones(ours: Path, tmp_path: Path) -> None:
    """A file put beside the record after it was written is copied as before, with no word; the
    recorded ones beside it are checked (a changed model card warned of, by its name alone)."""
    (ours / "notes.txt").write_text("added after the record")
    (ours / "README.md").write_text("# edited\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallel_dcp.convert(ours, tmp_path / "out", workers=1, to="safetensors")
    said = [str(w.message) for w in caught if issubclass(w.category, SourceNotCheckedWarning)]
    assert len(said) == 1 and "README.md" in said[0] and "notes.txt" not in said[0], said
    assert (tmp_path / "out" / "notes.txt").read_text() == "added after the record"


def _rewrite_while_the_job_runs(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """``path`` rewritten with other bytes of its size as the job's tasks start: after the check
    before them, before the commit reads it."""
    run_tasks = pipeline.run_tasks

    def rewrite_then_run(*args: Any, **kwargs: Any) -> Any:
        _rewrite_same_size(path)
        return run_tasks(*args, **kwargs)

    monkeypatch.setattr(pipeline, "run_tasks", rewrite_then_run)


@pytest.mark.parametrize("rewritten", ["config.json", "1_Pooling/config.json"])
def test_a_same_size_rewrite_while_the_job_runs_is_refused_at_the_commit(
    ours: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rewritten: str
) -> None:
    _rewrite_while_the_job_runs(monkeypatch, ours / rewritten)
    out = tmp_path / "out"
    with pytest.raises(SourceChecksumError) as caught:
        parallel_dcp.convert(ours, out, workers=1, to="safetensors")
    message = str(caught.value)
    assert message.startswith(f"{ours / rewritten}: its bytes are not the ones its checksum"), message
    assert "changed while the job ran" in message and "nothing was committed" in message, message
    assert not os.path.lexists(out)


def test_a_model_card_rewritten_while_the_job_runs_is_committed_with_a_warning(
    ours: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _rewrite_while_the_job_runs(monkeypatch, ours / "README.md")
    with pytest.warns(SourceNotCheckedWarning, match=r"README\.md: .*changed while the job ran\): copied as it is"):
        parallel_dcp.convert(ours, tmp_path / "out", workers=1, to="safetensors")
    assert (tmp_path / "out" / "README.md").read_bytes() == (ours / "README.md").read_bytes() != b"# a model\n"
    assert parallel_dcp.verify(tmp_path / "out", workers=1).ok


def test_copy_files_from_a_recorded_folder_is_checked_alike(
    ours: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dcp = tmp_path / "trained"
    parallel_dcp.save(_state(), dcp, workers=1)
    (ours / "tokenizer.json").write_text('{"version": "2.0"}')
    _no_task_runs(monkeypatch)
    with pytest.raises(SourceChecksumError, match=r"ours/tokenizer\.json: its bytes are not .*restore it"):
        parallel_dcp.convert(dcp, tmp_path / "out", workers=1, to="safetensors", copy_files_from=ours)
    assert not os.path.lexists(tmp_path / "out")


def _hub(folder: Path, root: Path) -> Path:
    """``folder``'s files (its subfolders' too) laid out as huggingface_hub lays out a download:
    each file a link into the repository's ``blobs/``; returns the snapshot's folder."""
    repo = root / "hub" / "models--org--ours"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "5eed"
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        relative = path.relative_to(folder)
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / relative).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / relative).symlink_to(Path(*[".."] * (len(relative.parts) + 1), "blobs", blob.name))
    return snapshot


def test_a_hub_snapshot_of_our_folder_is_checked_through_its_links(ours: Path, tmp_path: Path) -> None:
    snapshot = _hub(ours, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SourceNotCheckedWarning)
        parallel_dcp.convert(snapshot, tmp_path / "clean", workers=1, to="safetensors")
    assert _tree(tmp_path / "clean")["1_Pooling/config.json"] == (ours / "1_Pooling" / "config.json").read_bytes()

    blob = Path(os.path.realpath(snapshot / "config.json"))
    _rewrite_same_size(blob)
    with pytest.raises(SourceChecksumError) as caught:
        parallel_dcp.convert(snapshot, tmp_path / "out", workers=1, to="safetensors")
    message = str(caught.value)
    assert message.startswith(f"{snapshot / 'config.json'} -> {blob}: its bytes are not"), message
    assert "its uploader replaced it on the hub" in message and "--no-source-checks" in message, message
    assert message.endswith(f"download it again (force_download=True, or delete {blob} first)"), message
    assert not os.path.lexists(tmp_path / "out")


def test_a_later_sources_changed_side_file_is_refused_before_the_first_is_converted(
    ours: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With several sources, each source's recorded side files are checked before any source is
    converted: a later source's changed config.json was found only when its own conversion began,
    after the earlier outputs were committed."""
    import shutil

    later = tmp_path / "later"
    shutil.copytree(ours, later)
    parallel_dcp.verify(later)  # (a copy of a recorded folder is as recorded)
    _rewrite_same_size(later / "config.json")
    _no_task_runs(monkeypatch)
    with pytest.raises(SourceChecksumError, match=r"later/config\.json: its bytes are not"):
        parallel_dcp.convert([ours, later], tmp_path / "out", workers=1, to="safetensors")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("gone", ["tokenizer.json", "1_Pooling/config.json"])
def test_a_recorded_side_file_that_is_gone_is_refused(
    ours: Path, tmp_path: Path, gone: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file the record lists and the copy would take, deleted from the folder: the output lacked
    it and its own record blessed that, while verify of the source fails on it (review s17 F5)."""
    (ours / gone).unlink()
    _no_task_runs(monkeypatch)
    with pytest.raises(SourceChecksumError, match=rf"{gone}: listed in .parallel_dcp.json, but gone from the folder"):
        parallel_dcp.convert(ours, tmp_path / "out", workers=1, to="safetensors")
    assert not os.path.lexists(tmp_path / "out")


def test_a_recorded_model_card_that_is_gone_is_warned_of(ours: Path, tmp_path: Path) -> None:
    (ours / "README.md").unlink()
    with pytest.warns(SourceNotCheckedWarning, match=r"README\.md: listed in .*, but gone from the folder"):
        parallel_dcp.convert(ours, tmp_path / "out", workers=1, to="safetensors")
    assert not (tmp_path / "out" / "README.md").exists()
    parallel_dcp.verify(tmp_path / "out")
