"""What the seventh review round named, each pinned by a test: in a shared destination (a sticky
``/scratch``), files another user planted decided what this user's save deleted or adopted.
``--resume`` adopted another user's owner, job and done records, so their shards became this
user's checkpoint, still theirs to rewrite; an index they planted naming this user's
``adapter_model.safetensors`` got it deleted by an overwrite; their dead save's leftovers were
removed by this user's next save. Only this user's records and files decide anything now
(``parallel_dcp.storage.layout.written_by_us``).

Another user is played by root giving files to uid 12345 (``os.chown``): the rule compares a
file's owner with the effective uid, whoever that is.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import parallel_dcp
from parallel_dcp import ResumeError
from parallel_dcp.cli import main
from tests.conftest import finished_task_records
from tests.test_resume import _fail_midway, _source

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to another user"),
]

OTHER = 12345


def _state(where: Path) -> dict[str, tuple[int, bytes]]:
    """Every file in ``where``: its owner and bytes."""
    return {p.name: (p.stat().st_uid, p.read_bytes()) for p in where.iterdir() if p.is_file()}


def _shared(path: Path) -> Path:
    path.mkdir()
    os.chmod(path, 0o1777)  # what /scratch is: anyone may add files, only their owner removes them
    return path


def _give_away(where: Path, names: list[str] | None = None) -> None:
    for name in os.listdir(where) if names is None else names:
        os.chown(where / name, OTHER, OTHER)


def test_a_resume_never_adopts_another_users_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another user's dead conversion, with matching records: refused, naming the file and its
    owner, and nothing on disk changes; the kept shards stayed theirs after the commit before."""
    src, _ = _source(tmp_path)
    out = _shared(tmp_path / "out")
    _fail_midway(monkeypatch, src, out, "dcp")
    _give_away(out)
    before = _state(out)
    with pytest.raises(ResumeError, match=r"\.parallel_dcp\.(owner|job)\.[0-9a-f]{12} belongs to uid 12345"):
        parallel_dcp.convert(src, out, workers=2, shard_size=600_000, resume=True)
    assert _state(out) == before
    assert main(["convert", str(src), str(out), "--resume", "--shard-size", "600000", "-q"]) == 1
    assert "belongs to uid 12345, not to you" in capsys.readouterr().err
    assert _state(out) == before


def test_a_resume_never_keeps_another_users_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This user's records, one finished shard given to another user: refused, naming it, and
    nothing on disk changes (it is neither adopted nor deleted)."""
    src, _ = _source(tmp_path)
    out = _shared(tmp_path / "out")
    _fail_midway(monkeypatch, src, out, "safetensors")
    save_id = finished_task_records(out)[0].split(".")[3]
    shard = sorted(n for n in os.listdir(out) if n.endswith(f".{save_id}.tmp"))[0]
    _give_away(out, [shard])
    before = _state(out)
    with pytest.raises(ResumeError, match=rf"{shard.replace('.', '[.]')} belongs to uid 12345"):
        parallel_dcp.convert(src, out, to="safetensors", workers=2, shard_size=600_000, resume=True)
    assert _state(out) == before


def test_an_overwrite_never_deletes_a_file_on_another_users_index(tmp_path: Path) -> None:
    """A Hugging Face index planted by another user, naming this user's adapter: by the layout's
    rule the adapter was a shard of the checkpoint replaced, and the overwrite deleted it."""
    src = tmp_path / "src.safetensors"
    save_file({"a": torch.ones(4)}, str(src))
    out = _shared(tmp_path / "out")
    save_file({"lora": torch.zeros(2)}, str(out / "adapter_model.safetensors"))  # this user's
    adapter = (out / "adapter_model.safetensors").read_bytes()
    index = out / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"x": "adapter_model.safetensors"}}))
    _give_away(out, [index.name])
    parallel_dcp.convert(src, out, to="safetensors", workers=1, overwrite=True)
    assert (out / "adapter_model.safetensors").read_bytes() == adapter
    assert torch.equal(load_file(out / "model.safetensors")["a"], torch.ones(4))


def test_an_overwrite_keeps_another_users_shards_named_by_this_users_index(tmp_path: Path) -> None:
    """This user's index, one of its shards another user's: that shard is not deleted either."""
    src = tmp_path / "src.safetensors"
    save_file({"a": torch.ones(4096), "b": torch.zeros(4096)}, str(src))
    out = _shared(tmp_path / "out")
    parallel_dcp.convert(src, out, to="safetensors", workers=1, shard_size=20_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) == 2
    _give_away(out, shards[:1])
    parallel_dcp.convert(src, out, to="safetensors", workers=1, overwrite=True)
    assert (out / shards[0]).exists() and not (out / shards[1]).exists()


def test_another_users_dead_save_is_left_as_it_is(tmp_path: Path) -> None:
    """Another user's leftovers beside a single-file output: not this user's to judge or remove
    (removed before, by root; in a sticky directory an ordinary user's save failed on them)."""
    folder = _shared(tmp_path / "models")
    save_id = "0123456789ab"
    record = {"host": socket.gethostname(), "pid": 0, "start": None, "save_id": save_id}
    (folder / f".parallel_dcp.owner.{save_id}").write_text(json.dumps(record))
    (folder / f".b.pt.{save_id}.tmp").write_bytes(b"their half-written file")
    _give_away(folder)
    before = _state(folder)
    src = tmp_path / "src.safetensors"
    save_file({"a": torch.ones(4)}, str(src))
    parallel_dcp.convert(src, folder / "a.pt", workers=1)
    assert {k: v for k, v in _state(folder).items() if k in before} == before
    assert torch.equal(parallel_dcp.load(folder / "a.pt")["a"], torch.ones(4))


def test_an_overwrite_says_which_files_of_another_user_it_kept(tmp_path: Path) -> None:
    """Root's old shards in a directory of this user's, overwritten by this user: kept (only their
    owner deletes them), and the run says so, naming them, instead of exiting quietly (review R1)."""
    out = tmp_path / "out"
    parallel_dcp.save({"w": torch.ones(64)}, out, workers=1)
    shards = sorted(p.name for p in out.glob("*.distcp"))
    _give_away(out, [*shards, ".metadata"])
    with pytest.warns(UserWarning, match=rf"not yours \({shards[0]}"):
        parallel_dcp.save({"w": torch.zeros(64)}, out, workers=1, overwrite=True)
    assert all((out / name).exists() for name in shards)
    assert torch.equal(parallel_dcp.load(out)["w"], torch.zeros(64))


def test_a_lock_file_of_another_user_is_named_with_its_owner(tmp_path: Path) -> None:
    """Another user's lock left in a shared directory: the error names whose it is (review R2)."""
    from parallel_dcp.storage.lock import _whose

    where = _shared(tmp_path / "shared")
    (where / ".lock").write_text("{}")
    _give_away(where, [".lock"])
    fd = os.open(where, os.O_RDONLY)
    try:
        assert "uid 12345" in _whose(fd, ".lock") and "only that user or root" in _whose(fd, ".lock")
        os.chown(where / ".lock", os.geteuid(), -1)
        assert _whose(fd, ".lock") == ""
    finally:
        os.close(fd)


def test_another_users_checkpoint_in_a_sticky_directory_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a file's owner may replace it in a sticky directory another user owns: an overwrite of
    another user's checkpoint there did all the work and then failed at the commit with a bare
    EPERM (review R4). Now it is refused first, naming the file and its owner. (Played with a
    pretended euid: root itself may replace anything.)"""
    from parallel_dcp.errors import InvalidDestinationError
    from parallel_dcp.storage.local_staging import check_replaceable

    where = _shared(tmp_path / "shared")
    os.chown(where, OTHER, OTHER)
    (where / ".metadata").write_bytes(b"x")  # root's: not the pretended user's
    monkeypatch.setattr(os, "geteuid", lambda: 54321)
    with pytest.raises(InvalidDestinationError, match=r"belongs to uid 0.*nothing was written"):
        check_replaceable(where, [".metadata"])
    os.chown(where / ".metadata", 54321, 54321)
    check_replaceable(where, [".metadata"])  # the user's own file: replaceable
    os.chown(where, 54321, 54321)
    os.chown(where / ".metadata", 0, 0)
    check_replaceable(where, [".metadata"])  # the user's own directory: anything in it is


def test_the_refusals_over_another_users_dead_conversion_lead_somewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Over another user's dead conversion, the ResumeError advised "convert without resume",
    which then failed as "a non-empty directory that is not a DCP checkpoint" without saying whose
    files those were (review R3). Now the ResumeError advises another destination or
    their owner, and the plain run's and the overwrite's refusal name the other user's leftovers,
    their owner and the way out; both hold once their owner removed them."""
    from parallel_dcp.errors import InvalidDestinationError

    src, _ = _source(tmp_path)
    out = _shared(tmp_path / "out")
    _fail_midway(monkeypatch, src, out, "dcp")
    _give_away(out)
    save_id = finished_task_records(out)[0].split(".")[3]
    before = _state(out)
    with pytest.raises(ResumeError) as caught:
        parallel_dcp.convert(src, out, workers=2, shard_size=600_000, resume=True)
    assert "without resume" not in str(caught.value)
    assert "convert to another destination, or have uid 12345 resume that conversion" in str(caught.value)
    theirs = rf"it holds the files uid 12345's conversion \(save {save_id}, stopped on .*\) left: \d+ files"
    for overwrite in (False, True):
        with pytest.raises(InvalidDestinationError, match=theirs + r".*have their owner resume that job"):
            parallel_dcp.convert(src, out, workers=2, overwrite=overwrite)
    assert main(["convert", str(src), str(out), "-q"]) == 1
    assert "uid 12345's conversion" in capsys.readouterr().err
    assert _state(out) == before
    parallel_dcp.convert(src, tmp_path / "elsewhere", workers=2)  # the first way out
    for name in os.listdir(out):  # the second: their owner removes them
        if save_id in name:
            os.remove(out / name)
    parallel_dcp.convert(src, out, workers=2)
