"""Attacks on the writers (issue 24, items 1, 8, 10, 11, 12), each performed for real: planted
symlinks and hard links in the destination, a crafted ``.metadata``/index/owner record, a real
SIGINT to a real ``parallel-dcp convert``, resume through a symlinked parent, an S3 upload refused
by a real server. A save never writes outside its destination, an overwrite deletes only the
replaced checkpoint's own shards, and an interrupted run blocks nothing that follows."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import parallel_dcp
from parallel_dcp import cli
from parallel_dcp.errors import InvalidDestinationError, ParallelDCPError
from parallel_dcp.storage.local_staging import LocalDirStaging
from parallel_dcp.storage.ownership import LOCK_FILE, MANIFEST_FILE, METADATA_FILE, is_of_save, owner_name, temp_name
from parallel_dcp.storage.resume import done_name, read_sealed, write_sealed
from tests.conftest import assert_same, finished_task_records

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(240)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64, 64, generator=g) for i in range(4)}


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside every destination that no save may change."""
    path = tmp_path / "victim.txt"
    path.write_bytes(b"precious, outside the checkpoint\n")
    return path


VICTIM_BYTES = b"precious, outside the checkpoint\n"


# --- item 1: the lock file ---------------------------------------------------------------------


def _write(target: Path, tmp_path: Path) -> None:
    """A save (a DCP directory) or a conversion (to a single file)."""
    if target.suffix == ".safetensors":
        src = tmp_path / "src.safetensors"
        if not src.exists():
            save_file(_state(), str(src))
        parallel_dcp.convert(src, target, workers=1)
    else:
        parallel_dcp.save(_state(), target, workers=1)


@pytest.mark.parametrize("plant", ["symlink", "dangling symlink", "hard link"])
@pytest.mark.parametrize("output", ["directory", "single file"])
def test_a_planted_lock_file_is_refused_and_what_it_points_to_is_untouched(
    tmp_path: Path, victim: Path, plant: str, output: str
) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    target = dest / "out.safetensors" if output == "single file" else dest / "ckpt"
    if output == "directory":
        target.mkdir()
        lock = target / LOCK_FILE
    else:
        lock = dest / ".out.safetensors.lock"
    nowhere = tmp_path / "not-there"
    if plant == "symlink":
        lock.symlink_to(victim)
    elif plant == "dangling symlink":
        lock.symlink_to(nowhere)
    else:
        os.link(victim, lock)
    with pytest.raises(InvalidDestinationError, match=r"symbolic link|links") as caught:
        _write(target, tmp_path)
    assert str(lock) in str(caught.value)
    assert victim.read_bytes() == VICTIM_BYTES, "the lock record was written through the planted name"
    assert not nowhere.exists(), "the dangling symlink's target was created"
    assert lock.is_symlink() or lock.stat().st_nlink == 2, "the planted name is left for its owner to see"
    assert not (target / METADATA_FILE).exists() and not (dest / "out.safetensors").exists()
    lock.unlink()  # once it is gone, the same save works
    _write(target, tmp_path)
    assert_same(load_file(str(target)) if output == "single file" else parallel_dcp.load(target, workers=1), _state())


def test_an_existing_lock_file_left_by_an_earlier_save_is_used(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / LOCK_FILE).write_text('{"pid": 1}\n')  # a regular file: a lock left behind
    parallel_dcp.save(_state(), target, workers=1)
    assert_same(parallel_dcp.load(target, workers=1), _state())


# --- item 1: every other file a save creates ---------------------------------------------------


def _own_save_id(dest: Path) -> str:
    """What an attacker watching the directory learns: the save id in the owner record's name."""
    (owner,) = [n for n in os.listdir(dest) if n.startswith(".parallel_dcp.owner.")]
    return owner.removeprefix(".parallel_dcp.owner.")


@pytest.mark.parametrize("planted", [METADATA_FILE, MANIFEST_FILE])
def test_a_symlink_planted_at_a_commit_temporary_is_never_written_through(
    tmp_path: Path, victim: Path, planted: str
) -> None:
    dest = tmp_path / "ckpt"
    staging = LocalDirStaging(dest, overwrite=False)
    save_id = _own_save_id(dest)
    assert save_id == staging.save_id
    (dest / temp_name(planted, save_id)).symlink_to(victim)
    with pytest.raises(InvalidDestinationError, match="refusing to write through it"):
        staging.commit(marker=(METADATA_FILE, b"new metadata"), extras={MANIFEST_FILE: b"{}"})
    staging.discard()
    assert victim.read_bytes() == VICTIM_BYTES
    assert not dest.exists() or not [n for n in os.listdir(dest) if not n.startswith(".")]


def test_records_are_written_new_and_never_through_a_planted_name(tmp_path: Path, victim: Path) -> None:
    dest = tmp_path / "ckpt"
    staging = LocalDirStaging(dest, overwrite=False)
    save_id = staging.save_id
    # A done record (written by a worker), over a planted temporary and a planted final name.
    name = done_name(save_id, 0)
    (dest / f"{name}.tmp").symlink_to(victim)
    (dest / name).symlink_to(victim)
    write_sealed(dest, name, {"task": 0})
    assert read_sealed(dest, name) == {"task": 0}
    assert not (dest / name).is_symlink()
    # The owner record rewritten when the save stops (discard_keeping), over a planted temporary.
    (dest / f".{owner_name(save_id)}.tmp").symlink_to(victim)
    staging.discard_keeping({name})
    record = json.loads((dest / owner_name(save_id)).read_bytes())
    assert record["stopped"] is True and not (dest / owner_name(save_id)).is_symlink()
    assert victim.read_bytes() == VICTIM_BYTES


@pytest.mark.parametrize("plant", ["fifo", "symlink"])
def test_a_planted_owner_record_never_blocks_nor_is_followed(
    tmp_path: Path, victim: Path, plant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    parallel_dcp.save(_state(1), ckpt, workers=1)
    planted = [ckpt / owner_name("0123456789ab")]
    for path in planted:
        if plant == "fifo":
            os.mkfifo(path)  # reading it would block forever
        else:
            path.symlink_to(victim)
    assert cli.main(["inspect", str(ckpt), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["committed"] is True
    parallel_dcp.save(_state(2), ckpt, workers=1, overwrite=True)
    assert_same(parallel_dcp.load(ckpt, workers=1), _state(2))
    assert victim.read_bytes() == VICTIM_BYTES


# --- item 12: an overwrite deletes only the replaced checkpoint's own shards -------------------


def test_overwrite_over_a_crafted_metadata_never_deletes_a_name_it_merely_mentions(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    ckpt = tmp_path / "ckpt"
    parallel_dcp.save(_state(1), ckpt, workers=1)
    keep = ckpt / "train_state.json"
    keep.write_text('{"step": 7}')
    elsewhere = tmp_path / "other.distcp"  # a DCP-like name, outside: refused as a name anyway
    elsewhere.write_bytes(b"x")
    # Crafted: one record now "lives" in train_state.json (the file a user keeps beside the shards).
    metadata: Metadata = pickle.loads((ckpt / METADATA_FILE).read_bytes())
    first = next(iter(metadata.storage_data))
    info = metadata.storage_data[first]
    info.relative_path = "train_state.json"
    (ckpt / METADATA_FILE).write_bytes(pickle.dumps(metadata))
    old_shards = {n for n in os.listdir(ckpt) if n.endswith(".distcp")}

    parallel_dcp.save(_state(2), ckpt, workers=1, overwrite=True)
    assert keep.read_text() == '{"step": 7}', "the overwrite deleted a file .metadata merely named"
    assert_same(parallel_dcp.load(ckpt, workers=1), _state(2))
    assert not old_shards & set(os.listdir(ckpt)), "the old checkpoint's own shards were removed"


def test_overwrite_over_a_crafted_index_never_deletes_a_name_it_merely_mentions(tmp_path: Path) -> None:
    src = tmp_path / "model.safetensors"
    sd = {f"w{i}": torch.randn(64, 1024) for i in range(4)}
    save_file(sd, str(src))
    out = tmp_path / "out"
    parallel_dcp.convert(src, out, to="safetensors", shard_size=300_000, workers=1)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"]["w0"] = "train_state.json"
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "train_state.json").write_text('{"step": 7}')
    parallel_dcp.convert(src, out, to="safetensors", shard_size=300_000, workers=1, overwrite=True)
    assert (out / "train_state.json").read_text() == '{"step": 7}'


def test_a_crafted_owner_record_cannot_get_a_file_deleted(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    parallel_dcp.save(_state(1), ckpt, workers=1)
    (ckpt / "train_state.json").write_text('{"step": 7}')
    dead = {"host": os.uname().nodename, "pid": 2**22 + 17, "save_id": "0123456789ab", "replaces": ["train_state.json"]}
    (ckpt / owner_name("0123456789ab")).write_text(json.dumps(dead))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dead save's cleanup warns, as it should
        parallel_dcp.save(_state(2), ckpt, workers=1, overwrite=True)
    assert (ckpt / "train_state.json").read_text() == '{"step": 7}'
    assert not (ckpt / owner_name("0123456789ab")).exists()


# --- item 10: Ctrl-C in the middle of a sharded conversion --------------------------------------

SHARD = 600_000  # two 256 KiB tensors a shard: four shards
FINISHED = 2

# The real command line, in a real process. Tasks from FINISHED on start writing their shard and
# stop in the middle of it (after its first bytes), so the SIGINT finds shards half written.
CONVERT_HELD = textwrap.dedent(
    """
    import sys, time
    from parallel_dcp.cli import main
    from parallel_dcp.jobs import file_writes, targets

    original = targets.ShardedTarget.write

    def write(self, job, task, data, staging, options):
        if task.index >= int(sys.argv[1]):
            hashing_write = file_writes._Hashing.write

            def stall(stream, piece):
                written = hashing_write(stream, piece)
                stream.flush()
                time.sleep(600)  # mid-shard: the first piece is on disk
                return written

            file_writes._Hashing.write = stall
        return original(self, job, task, data, staging, options)

    targets.ShardedTarget.write = write
    sys.exit(main(sys.argv[2:]))
    """
)


def _partial_shards(out: Path) -> list[str]:
    """The staged shards of the tasks held mid-write (those from FINISHED on) that have bytes."""
    held = tuple(f".model-{i + 1:05d}-of-" for i in range(FINISHED, 8))
    return [n for n in os.listdir(out) if n.startswith(held) and n.endswith(".tmp") and (out / n).stat().st_size]


@pytest.fixture
def source(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = {f"w{i}": torch.randn(64, 1024) for i in range(8)}
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path))
    return path, sd


def _interrupt_midway(src: Path, out: Path) -> None:
    args = ["convert", str(src), str(out), "--to", "safetensors", "--shard-size", str(SHARD), "--workers", "4", "-q"]
    proc = subprocess.Popen(
        [sys.executable, "-c", CONVERT_HELD, str(FINISHED), *args], cwd=ROOT, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
            out.is_dir() and len(finished_task_records(out)) >= FINISHED and _partial_shards(out)
        ):
            assert proc.poll() is None, "the conversion ended before it was interrupted"
            time.sleep(0.05)
        assert _partial_shards(out), "no shard was half written when the signal came"
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err


def _read_sharded(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    loaded: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        loaded |= load_file(str(out / shard))
    return loaded


@pytest.mark.parametrize("then", ["--resume", "a fresh run"])
def test_ctrl_c_mid_shard_leaves_nothing_that_blocks_the_next_run(
    tmp_path: Path,
    source: tuple[Path, dict[str, torch.Tensor]],
    then: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src, sd = source
    out = tmp_path / "out"
    _interrupt_midway(src, out)

    names = os.listdir(out)
    assert not [n for n in names if n.startswith(".tmp")], f"a temporary file no cleanup can attribute: {names}"
    save_ids = {n.removeprefix(".parallel_dcp.owner.") for n in names if n.startswith(".parallel_dcp.owner.")}
    assert len(save_ids) == 1
    (save_id,) = save_ids
    assert all(is_of_save(n, save_id) for n in names), names  # only the stopped save's own, kept files
    assert not _partial_shards(out), "the half-written shards were removed"
    assert len(finished_task_records(out)) >= FINISHED

    # inspect tells what is there: an uncommitted safetensors output and the stopped save's files.
    assert cli.main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["committed"] is False and info["format"] == "safetensors"
    (left,) = info["leftovers"]
    assert left["save_id"] == save_id and left["running"] is False and left["resumable"]
    assert left["tasks_done"] >= FINISHED

    args = ["convert", str(src), str(out), "--to", "safetensors", "--shard-size", str(SHARD), "--workers", "2", "-q"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fresh run warns that it removed the stopped save's files
        assert cli.main([*args, "--resume"] if then == "--resume" else args) == 0
    assert_same(_read_sharded(out), sd)
    assert not [n for n in os.listdir(out) if n.startswith(".parallel_dcp.") and n != MANIFEST_FILE]
    assert parallel_dcp.verify(out).ok


def test_inspect_lists_the_leftovers_of_a_single_file_output(tmp_path: Path) -> None:
    """A save to one file killed before its commit: nothing at the name, its temporary beside it."""
    out = tmp_path / "model.pt"
    save_id = "0123456789ab"
    (tmp_path / temp_name(out.name, save_id)).write_bytes(b"half a torch.save file")
    dead = {"host": os.uname().nodename, "pid": 2**22 + 17, "save_id": save_id}
    (tmp_path / owner_name(save_id)).write_text(json.dumps(dead))
    info = parallel_dcp.inspect(out)
    assert info["committed"] is False and info["format"] == "torch"
    (left,) = info["leftovers"]
    assert left["save_id"] == save_id and temp_name(out.name, save_id) in left["files"]


# --- item 11: resume through another spelling of the destination --------------------------------


def test_resume_through_a_symlinked_parent_keeps_the_finished_tasks(
    tmp_path: Path, source: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    from tests.test_resume import _kill_midway

    src, sd = source
    real = tmp_path / "real"
    real.mkdir()
    _kill_midway(src, real / "out", "safetensors")
    finished = finished_task_records(real / "out")
    assert len(finished) >= FINISHED
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)

    resumed = parallel_dcp.convert(src, link / "out", to="safetensors", workers=2, shard_size=SHARD, resume=True)
    assert resumed.resumed, "the dead conversion was not found through the other spelling"
    assert resumed.bytes_kept > 0
    assert_same(_read_sharded(real / "out"), sd)


# --- item 8: object storage ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    from tests.s3_server import moto_endpoint

    with moto_endpoint() as url:
        yield url


def test_s3_overwrite_whose_metadata_upload_fails_keeps_the_old_checkpoint(endpoint: str) -> None:
    import s3fs

    from tests.s3_faults import refusing_proxy

    s3 = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=endpoint)
    bucket = f"pdcp-{uuid.uuid4().hex[:10]}"
    s3.mkdir(bucket)
    url = f"s3://{bucket}/ckpt"
    direct = {"endpoint_url": endpoint}
    parallel_dcp.save(_state(1), url, workers=1, storage_options=direct)
    s3.invalidate_cache()
    before = sorted(s3.ls(f"{bucket}/ckpt", detail=False))

    # The server refuses the new .metadata's upload (403 AccessDenied, over the wire); every other
    # request, the deletes of the clean-up included, reaches it.
    refuse_metadata = lambda method, path: method == "PUT" and path.endswith("/.metadata")  # noqa: E731
    with refusing_proxy(endpoint, refuse_metadata) as (proxy, refused), pytest.raises((ParallelDCPError, OSError)):
        parallel_dcp.save(_state(2), url, workers=1, overwrite=True, storage_options={"endpoint_url": proxy})
    assert refused, "the upload of .metadata was never attempted"
    s3.invalidate_cache()
    assert sorted(s3.ls(f"{bucket}/ckpt", detail=False)) == before, "the failed overwrite changed the prefix"
    assert_same(parallel_dcp.load(url, workers=1, storage_options=direct), _state(1))
    assert parallel_dcp.verify(url, storage_options=direct).ok
