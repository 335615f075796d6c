"""A save deletes or replaces only what it wrote or what the checkpoint it replaces owns; one
writer at a time; a crash at any instant leaves the old or the new checkpoint; leftovers are cleaned."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import parallel_dcp
from parallel_dcp import CheckpointExistsError, DestinationBusyError, WorkerError
from tests.conftest import assert_same, empty_like_state
from tests.faults import CreateInWorker, RaiseInWorker

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(180)


def _tree(path: Path) -> dict[str, bytes | None]:
    """Every file (bytes) and directory (None) under ``path``, by relative name."""
    return {str(p.relative_to(path)): (None if p.is_dir() else p.read_bytes()) for p in sorted(path.rglob("*"))}


def _stock_load(path: Path, like: dict[str, Any]) -> dict[str, Any]:
    target = empty_like_state(like)
    dcp.load(target, checkpoint_id=str(path), no_dist=True)
    return target


def test_overwrite_keeps_a_trainers_files_beside_the_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "step"
    parallel_dcp.save({"w": torch.ones(8), "old": torch.zeros(2)}, ckpt, workers=2)
    old_shards = {p.name for p in ckpt.glob("*.distcp")}
    (ckpt / "dataloader").mkdir()
    (ckpt / "dataloader" / "rank0.bin").write_bytes(os.urandom(64))
    (ckpt / "train_state.json").write_text('{"step": 1000}')
    extras = {k: v for k, v in _tree(ckpt).items() if k.startswith(("dataloader", "train_state"))}
    new = {"w": torch.full((8,), 3.0), "fresh": torch.arange(5)}
    parallel_dcp.save(new, ckpt, workers=2, overwrite=True)
    after = _tree(ckpt)
    assert {k: after[k] for k in extras} == extras, "the trainer's files are byte-identical"
    assert not old_shards & set(after), "the old checkpoint's shards are gone"
    assert sorted(k for k in after if k not in extras and not k.endswith(".distcp")) == [
        ".metadata",
        ".parallel_dcp.columns",  # the side index (storage/side_index.py)
        ".parallel_dcp.json",
    ]
    assert_same(parallel_dcp.load(ckpt), new)
    assert_same(_stock_load(ckpt, new), new)
    assert parallel_dcp.verify(ckpt, workers=1).ok


def test_overwrite_keeps_config_and_tokenizer_in_a_hugging_face_directory(tmp_path: Path) -> None:
    src = tmp_path / "src"
    state = {f"model.l{i}": torch.randn(64, 64) for i in range(6)}
    parallel_dcp.save(state, src, workers=2)
    hf = tmp_path / "hf"
    parallel_dcp.convert(src, hf, to="safetensors", shard_size=40_000, workers=2)
    assert (hf / "model.safetensors.index.json").exists() and len(list(hf.glob("*.safetensors"))) > 2
    for name, text in {"config.json": '{"a": 1}', "tokenizer.json": "{}", "README.md": "# model"}.items():
        (hf / name).write_text(text)
    kept = {k: v for k, v in _tree(hf).items() if k in ("config.json", "tokenizer.json", "README.md")}
    parallel_dcp.convert(src, hf, to="safetensors", overwrite=True, workers=2)  # one shard now: no index
    after = _tree(hf)
    assert {k: after[k] for k in kept} == kept
    assert sorted(after) == [".parallel_dcp.json", "README.md", "config.json", "model.safetensors", "tokenizer.json"]
    assert_same(load_file(str(hf / "model.safetensors")), state)


def test_converting_a_subdirectory_into_its_parent_never_touches_the_source(tmp_path: Path) -> None:
    outer = tmp_path / "outer"
    parallel_dcp.save({"a": torch.ones(3)}, outer, workers=1)
    sub = outer / "sub_ckpt"
    state = {"b": torch.arange(10.0)}
    parallel_dcp.save(state, sub, workers=1)
    source = _tree(sub)
    parallel_dcp.convert(sub, outer, overwrite=True, workers=2)
    assert _tree(sub) == source
    assert_same(parallel_dcp.load(outer), state)
    assert_same(parallel_dcp.load(sub), state)


def test_a_source_file_is_never_replaced(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    from safetensors.torch import save_file

    save_file({"w": torch.ones(4)}, str(hf / "model.safetensors"))
    before = (hf / "model.safetensors").read_bytes()
    with pytest.raises(parallel_dcp.InvalidDestinationError, match="source"):
        parallel_dcp.convert(hf / "model.safetensors", hf, to="safetensors", overwrite=True, workers=1)
    assert (hf / "model.safetensors").read_bytes() == before


HOLD_SCRIPT = textwrap.dedent(
    """
    import sys, torch, parallel_dcp
    from tests.faults import WaitForFile
    sd = {"w%d" % i: torch.full((8,), float(i)) for i in range(4)}
    sd["slow"] = WaitForFile(sys.argv[1] + ".release", float(sys.argv[2]))
    print("saving", flush=True)
    try:
        parallel_dcp.save(sd, sys.argv[1], workers=2, executor="processes", overwrite=sys.argv[3] == "1")
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
    print("saved", flush=True)
    """
)


def _start_holder(dest: Path, seconds: float, overwrite: bool = False) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_SCRIPT, str(dest), str(seconds), "1" if overwrite else "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "saving"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the lock is taken before any worker starts
        if len(psutil.Process(proc.pid).children()) >= 2:
            return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the holder's workers never started")


def test_a_second_save_fails_at_once_naming_the_holder(tmp_path: Path) -> None:
    dest = tmp_path / "ckpt"
    first = _start_holder(dest, 120.0)  # holds its lock until dest.release exists
    try:
        # The second save runs here (another process than the holder; a fresh interpreter for it
        # only imported torch again first).
        with pytest.raises(DestinationBusyError, match=f"pid {first.pid}") as busy:
            parallel_dcp.save({"w": torch.zeros(8)}, dest, workers=1)
        assert socket.gethostname() in str(busy.value)
        assert first.poll() is None, "both saves failed while the first still held the destination"
        Path(f"{dest}.release").touch()
        assert first.wait(timeout=60) == 0
        assert first.stdout is not None and first.stdout.read().strip() == "saved"
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    loaded = parallel_dcp.load(dest, trust_pickle=True)  # the first save's checkpoint, not replaced
    assert loaded["slow"] == "released" and torch.equal(loaded["w3"], torch.full((8,), 3.0))
    assert sorted(p.name for p in dest.iterdir() if not p.name.endswith(".distcp")) == [
        ".metadata",
        ".parallel_dcp.columns",
        ".parallel_dcp.json",
    ]


def test_a_checkpoint_that_appears_mid_save_is_never_replaced(tmp_path: Path) -> None:
    dest = tmp_path / "ckpt"
    dest.mkdir()
    theirs = {str(dest / ".metadata"): b"another writer's commit", str(dest / "theirs"): None}
    sd = {"w": torch.ones(4), "hook": CreateInWorker(theirs)}
    with pytest.raises(CheckpointExistsError, match="appeared"):
        parallel_dcp.save(sd, dest, workers=1, executor="processes")
    assert (dest / ".metadata").read_bytes() == b"another writer's commit"
    assert (dest / "theirs").is_dir()
    assert sorted(p.name for p in dest.iterdir()) == [".metadata", "theirs"], "only this save's files were removed"


def test_a_file_that_appears_at_a_single_file_destination_is_never_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src"
    parallel_dcp.save({"w": torch.ones(4)}, src)
    import dataclasses

    from parallel_dcp.formats import FILE_FORMATS, torch_format

    def another_writer_first(tensors: Any, path: Any, mapping: Any = None) -> None:
        (tmp_path / "x.pt").write_bytes(b"theirs")  # in the worker, while this save writes
        torch_format.write_file(tensors, path, mapping)

    monkeypatch.setitem(FILE_FORMATS, "torch", dataclasses.replace(torch_format.FORMAT, write=another_writer_first))
    with pytest.raises(CheckpointExistsError, match="appeared"):
        parallel_dcp.convert(src, tmp_path / "x.pt", workers=1)
    assert (tmp_path / "x.pt").read_bytes() == b"theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "x.pt"]


def test_a_failed_save_removes_only_its_own_files(tmp_path: Path) -> None:
    dest = tmp_path / "ckpt"
    old = {"w": torch.arange(4.0)}
    parallel_dcp.save(old, dest, workers=1)
    (dest / "notes.txt").write_text("mine")
    before = _tree(dest)
    with pytest.raises(WorkerError):
        parallel_dcp.save({"w": torch.ones(4), "bad": RaiseInWorker()}, dest, workers=2, overwrite=True)
    assert _tree(dest) == before


def test_a_symlink_destination_stays_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real"
    parallel_dcp.save({"w": torch.ones(2)}, real, workers=1)
    link = tmp_path / "link"
    link.symlink_to(real)
    parallel_dcp.save({"w": torch.zeros(2)}, link, workers=1, overwrite=True)
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    assert_same(parallel_dcp.load(real), {"w": torch.zeros(2)})
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(parallel_dcp.InvalidDestinationError, match="broken symbolic link"):
        parallel_dcp.save({"w": torch.zeros(2)}, dangling, workers=1)


def _kill_holder(proc: subprocess.Popen[str], sig: int) -> int:
    workers = psutil.Process(proc.pid).children()
    time.sleep(0.3)
    proc.send_signal(sig)
    code = proc.wait(timeout=90)
    psutil.wait_procs(workers, timeout=60)
    return code


def test_sigkill_mid_overwrite_leaves_the_old_checkpoint_and_the_next_save_cleans_up(tmp_path: Path) -> None:
    dest = tmp_path / "ckpt"
    old = {"w0": torch.full((8,), -1.0)}
    parallel_dcp.save(old, dest, workers=1)
    committed = _tree(dest)
    proc = _start_holder(dest, 60.0, overwrite=True)
    assert _kill_holder(proc, signal.SIGKILL) == -signal.SIGKILL
    assert_same(_stock_load(dest, old), old)  # stock dcp.load: the old checkpoint, whole
    info = parallel_dcp.inspect(dest)
    assert info["committed"] and len(info["leftovers"]) == 1
    leftover = info["leftovers"][0]
    assert leftover["pid"] == proc.pid and leftover["running"] is False and leftover["files"]
    assert all(committed[k] == v for k, v in _tree(dest).items() if k in committed)
    new = {"w0": torch.full((8,), 5.0)}
    with pytest.warns(UserWarning, match=rf"removed \d+ leftover files? of save {leftover['save_id']}"):
        parallel_dcp.save(new, dest, workers=1, overwrite=True)
    names = {p.name for p in dest.iterdir()}
    assert not any(leftover["save_id"] in n for n in names)
    assert {n for n in names if not n.endswith(".distcp")} == {
        ".metadata",
        ".parallel_dcp.columns",
        ".parallel_dcp.json",
    }
    assert_same(_stock_load(dest, new), new)


CRASH_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, torch, parallel_dcp
    from parallel_dcp.storage import local_staging as destination
    where = sys.argv[2]
    if where == "publish":  # after the commit, before the old shards are removed
        destination._LocalStaging.publish = lambda self: os.kill(os.getpid(), signal.SIGKILL)
    else:  # between the .metadata rename and the manifest's
        rename = destination._LocalStaging._rename_into_place
        def crash(self, name):
            if name == ".parallel_dcp.json":  # the manifest
                os.kill(os.getpid(), signal.SIGKILL)
            rename(self, name)
        destination._LocalStaging._rename_into_place = crash
    parallel_dcp.save({"w": torch.full((8,), 9.0)}, sys.argv[1], workers=1, overwrite=True)
    """
)


@pytest.mark.parametrize("where", ["publish", "manifest"])
def test_sigkill_after_the_commit_leaves_the_new_checkpoint(where: str, tmp_path: Path) -> None:
    dest = tmp_path / "ckpt"
    parallel_dcp.save({"w": torch.zeros(8)}, dest, workers=1)
    old_shards = {p.name for p in dest.glob("*.distcp")}
    done = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(dest), where], cwd=ROOT)
    assert done.returncode == -signal.SIGKILL
    new = {"w": torch.full((8,), 9.0)}
    assert_same(_stock_load(dest, new), new)
    if where == "manifest":  # the old manifest beside the new .metadata: stale, not corruption
        report = parallel_dcp.verify(dest, workers=1)  # (said in its report, not warned of)
        assert report.ok and not report.manifest and report.manifest_stale
        assert any("stale" in warning for warning in report.warnings)
    with pytest.warns(UserWarning, match="leftover"):
        parallel_dcp.save({"w": torch.ones(8)}, dest, workers=1, overwrite=True)
    names = {p.name for p in dest.iterdir()}
    assert not names & old_shards and len({n for n in names if n.endswith(".distcp")}) == 1
    assert parallel_dcp.verify(dest, workers=1).ok


def test_sigterm_is_handled_like_ctrl_c(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = _start_holder(out / "ckpt", 60.0)
    workers = psutil.Process(proc.pid).children()
    assert _kill_holder(proc, signal.SIGTERM) == 130
    assert proc.stdout is not None and proc.stdout.read().strip() == "interrupted"
    for worker in workers:
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    assert list(out.iterdir()) == [], "this save's files and the directory it created are gone"


def test_the_lock_survives_the_unlink_race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder that removes the lock file between our open and our flock: we retry on the new file."""
    import fcntl

    from parallel_dcp.storage import lock as destination
    from parallel_dcp.storage.ownership import owner_record
    from parallel_dcp.storage.safe_files import open_directory

    lock = tmp_path / ".parallel_dcp.lock"
    directory = open_directory(tmp_path)
    real_flock = fcntl.flock
    raced: list[int] = []

    def flock_after_unlink(fd: int, op: int) -> None:
        if not raced:  # the previous holder finishes now: it unlinks the file we opened
            raced.append(os.fstat(fd).st_ino)
            os.unlink(lock)
        real_flock(fd, op)

    monkeypatch.setattr(destination.fcntl, "flock", flock_after_unlink)
    held = destination.DestinationLock(directory, lock, owner_record("race", tmp_path), tmp_path)
    assert raced and held.fd is not None
    assert os.stat(lock).st_ino == os.fstat(held.fd).st_ino, "the lock we hold is the file at the path"
    monkeypatch.setattr(destination.fcntl, "flock", real_flock)
    with pytest.raises(DestinationBusyError, match=f"pid {os.getpid()} on host {socket.gethostname()}, save race"):
        destination.DestinationLock(directory, lock, owner_record("second", tmp_path), tmp_path)
    held.release()
    os.close(directory)
    assert not lock.exists()
