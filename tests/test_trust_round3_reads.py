"""Issue 31, items 5 and 6: one rule for opening anything a job reads, on every read path.

Every path that reads a shard (our fast path, and the fallbacks through torch's
``FileSystemReader``: pickled values, ``load(retries=)``, convert and diff of DCP sources) opens it
as a regular file, never through a symlink planted in its place, never blocking on a FIFO; a
shard that vanishes during a read is a ``ParallelDCPError`` naming the concurrent change.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import parallel_dcp
from parallel_dcp import CorruptCheckpointError, ParallelDCPError, UnsafeCheckpointError
from parallel_dcp.formats.compressed_read import bounded_reader
from parallel_dcp.partial import partial_load
from parallel_dcp.storage.location import dcp_reader

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent
ENV = os.environ | {"PYTHONPATH": str(ROOT)}


def _stock(path: Path, state: dict[str, Any]) -> Path:
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def _inner(exc: BaseException) -> list[BaseException]:
    """What stock DCP wrapped in a CheckpointException (or the error itself)."""
    if isinstance(exc, CheckpointException):
        return [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
    return [exc]


def _fast_reader_values(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = {"step": 0, "name": ""}
    dcp.load(state, storage_reader=parallel_dcp.FastReader(path, workers=1), no_dist=True)
    return state


def _fast_reader_tensors(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = {"w": torch.empty(64), "step": 0}
    dcp.load(state, storage_reader=parallel_dcp.FastReader(path, workers=1), no_dist=True)
    return state


# A reader, the state the checkpoint holds (the planted link leads to the same structure with
# other values), and how the reader is run.
VALUES = ({"step": 3, "name": "aaaa"}, {"step": 4, "name": "bbbb"})
TENSORS = ({"w": torch.zeros(64), "step": 3}, {"w": torch.ones(64), "step": 4})
READERS: list[Any] = [
    pytest.param(VALUES, lambda c, o: parallel_dcp.load(c, workers=1), id="load-values"),
    pytest.param(TENSORS, lambda c, o: parallel_dcp.load(c, workers=1, retries=1), id="load-retries"),
    pytest.param(VALUES, lambda c, o: _fast_reader_values(c), id="fastreader-values"),
    pytest.param(TENSORS, lambda c, o: _fast_reader_tensors(c), id="fastreader-tensors"),
    pytest.param(TENSORS, lambda c, o: parallel_dcp.convert(c, o / "out", workers=1), id="convert-dcp"),
    pytest.param(VALUES, lambda c, o: parallel_dcp.convert(c, o / "out.pt", workers=1), id="convert-torch"),
    pytest.param(TENSORS, lambda c, o: parallel_dcp.diff(c, o / "other", workers=1), id="diff"),
    pytest.param(VALUES, lambda c, o: parallel_dcp.diff(c, o / "other", workers=1), id="diff-values"),
    # torch's reader itself, given ours (no shard check before it: the seam alone must hold)
    pytest.param(TENSORS, lambda c, o: _partial(c), id="partial-tensors"),
    pytest.param(VALUES, lambda c, o: _partial(c), id="partial-values"),
    pytest.param(TENSORS, lambda c, o: _bounded(c), id="bounded-reader"),
]


def _partial(path: Path) -> dict[str, Any]:
    return partial_load(parallel_dcp.load_metadata(dcp_reader(path)), dcp_reader(path))


def _bounded(path: Path) -> dict[str, Any]:
    return partial_load(parallel_dcp.load_metadata(dcp_reader(path)), bounded_reader(path))


@pytest.mark.parametrize(("states", "read"), READERS)
def test_a_shard_replaced_by_a_symlink_to_another_checkpoint_is_refused(
    states: tuple[dict[str, Any], dict[str, Any]], read: Callable[[Path, Path], Any], tmp_path: Path
) -> None:
    ckpt = _stock(tmp_path / "ckpt", states[0])
    other = _stock(tmp_path / "other", states[1])
    (shard,) = ckpt.glob("*.distcp")
    (theirs,) = other.glob("*.distcp")
    shard.unlink()
    shard.symlink_to(theirs)
    with pytest.raises(BaseException) as caught:  # the inner error is checked below
        read(ckpt, tmp_path)
    inner = _inner(caught.value)
    assert all(isinstance(e, UnsafeCheckpointError) for e in inner), inner
    assert any("symlink" in str(e) and shard.name in str(e) for e in inner), inner
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.pt").exists()


def test_verify_reports_a_shard_replaced_by_a_symlink(tmp_path: Path) -> None:
    ckpt = _stock(tmp_path / "ckpt", dict(TENSORS[0]))
    other = _stock(tmp_path / "other", dict(TENSORS[1]))
    (shard,) = ckpt.glob("*.distcp")
    shard.unlink()
    shard.symlink_to(next(other.glob("*.distcp")))
    report = parallel_dcp.verify(ckpt, workers=1)
    assert not report.ok and any("symlink" in p and shard.name in p for p in report.problems), report.problems


FIFO_READERS: list[Any] = [
    pytest.param(lambda c: _fast_reader_values(c), id="fastreader"),
    pytest.param(lambda c: parallel_dcp.load(c, workers=1), id="load"),
    pytest.param(lambda c: parallel_dcp.load(c, workers=1, retries=1), id="load-retries"),
    pytest.param(lambda c: parallel_dcp.diff(c, c, workers=1), id="diff"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("read", FIFO_READERS)
def test_a_fifo_in_place_of_a_values_shard_is_refused_not_blocked_on(
    read: Callable[[Path], Any], tmp_path: Path
) -> None:
    ckpt = _stock(tmp_path / "ckpt", dict(VALUES[0]))
    (shard,) = ckpt.glob("*.distcp")
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(BaseException) as caught:
        read(ckpt)
    inner = _inner(caught.value)
    assert all(isinstance(e, UnsafeCheckpointError) for e in inner), inner
    assert any("not a regular file" in str(e) for e in inner), inner


@pytest.mark.timeout(60)
def test_a_fifo_planted_as_metadata_does_not_block_an_overwrite(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    parallel_dcp.save({"w": torch.zeros(8)}, ckpt, workers=1)
    (ckpt / ".metadata").unlink()
    os.mkfifo(ckpt / ".metadata")
    with pytest.raises(ParallelDCPError, match="not a regular file"):
        parallel_dcp.save({"w": torch.ones(8)}, ckpt, workers=1, overwrite=True)
    assert (ckpt / ".metadata").is_fifo()


@pytest.mark.parametrize("reader", [dcp_reader, bounded_reader], ids=["dcp_reader", "bounded_reader"])
def test_a_shard_gone_under_torchs_reader_is_a_clear_error(reader: Any, tmp_path: Path) -> None:
    """torch's reader opens shards by name: one removed after ``.metadata`` was read (a concurrent
    overwrite) is a ParallelDCPError naming it and the concurrent change, not a raw FileNotFoundError."""
    ckpt = _stock(tmp_path / "ckpt", dict(TENSORS[0]))
    metadata = parallel_dcp.load_metadata(dcp_reader(ckpt))
    (shard,) = ckpt.glob("*.distcp")
    shard.unlink()
    with pytest.raises(BaseException) as caught:
        partial_load(metadata, reader(ckpt))
    (inner,) = _inner(caught.value)
    assert isinstance(inner, ParallelDCPError), inner
    assert re.search(r"vanished.*another process", str(inner)) and shard.name in str(inner), inner


def test_a_shard_gone_before_a_load_is_named(tmp_path: Path) -> None:
    ckpt = _stock(tmp_path / "ckpt", dict(TENSORS[0]))
    (shard,) = ckpt.glob("*.distcp")
    shard.unlink()
    for retries in (0, 1):
        with pytest.raises(ParallelDCPError, match=shard.name):
            parallel_dcp.load(ckpt, workers=1, retries=retries)


OVERWRITER = textwrap.dedent(
    """
    import sys, torch, parallel_dcp
    # every overwrite gives new shard names: the old .metadata's shards vanish at each publish
    states = [{"w": torch.full((64, 64), float(i)), "v": torch.full((300,), float(i))} for i in range(2)]
    for i in range(int(sys.argv[2])):
        parallel_dcp.save(states[i % 2], sys.argv[1], workers=2, overwrite=True)
    """
)


def _one_save(loaded: dict[str, Any]) -> bool:
    """Both keys from one save (the saves differ in every value)."""
    value = float(loaded["w"].flatten()[0])
    return bool((loaded["w"] == value).all()) and bool((loaded["v"] == value).all())


@pytest.mark.timeout(300)
def test_a_load_during_overwrites_returns_one_save_or_names_the_overwrite(tmp_path: Path) -> None:
    """Two processes: one overwrites the checkpoint 80 times (new shard names each time), this one
    loads it over and over until the writer ends (bounded by the writer's count). Every load
    returns the values of one save, or raises a ParallelDCPError that names the concurrent change;
    never a raw OSError."""
    dest = tmp_path / "ckpt"
    parallel_dcp.save({"w": torch.full((64, 64), 1.0), "v": torch.full((300,), 1.0)}, dest, workers=1)
    writer = subprocess.Popen([sys.executable, "-c", OVERWRITER, str(dest), "80"], cwd=ROOT, env=ENV)
    loads = changed = 0
    try:
        while writer.poll() is None:
            for retries in (0, 1):
                try:
                    loaded = parallel_dcp.load(dest, workers=2, retries=retries)
                except ParallelDCPError as exc:
                    # (the message without the test's folder, whose name says "overwrites")
                    said = str(exc).replace(str(tmp_path), "<tmp>")
                    assert re.search(r"changed while|another process|vanished|overwrit", said), exc
                    changed += 1
                    continue
                assert _one_save(loaded), {k: v.flatten()[:3] for k, v in loaded.items()}
                loads += 1
    finally:
        if writer.poll() is None:
            writer.kill()
        writer.wait(timeout=120)
    assert writer.returncode == 0
    assert loads + changed >= 1
    assert _one_save(parallel_dcp.load(dest, workers=1))


@pytest.mark.timeout(60)
def test_a_fifo_planted_as_a_resume_record_is_refused_not_blocked_on(tmp_path: Path) -> None:
    from parallel_dcp.storage.manifest import FileDigest
    from parallel_dcp.storage.resume import read_sealed, verify_file

    os.mkfifo(tmp_path / ".parallel_dcp.done.0123456789ab.0")
    os.mkfifo(tmp_path / "__0_0123456789ab_0.distcp")
    assert read_sealed(tmp_path, ".parallel_dcp.done.0123456789ab.0") is None
    assert verify_file(tmp_path, "__0_0123456789ab_0.distcp", FileDigest(0, "0" * 16)) is False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plant", ["symlink", "fifo"])
def test_a_manifest_replaced_by_a_link_or_a_fifo_is_refused_by_name(plant: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    parallel_dcp.save({"w": torch.zeros(64)}, ckpt, workers=1)
    forged = tmp_path / "forged.json"
    forged.write_bytes((ckpt / ".parallel_dcp.json").read_bytes())
    (ckpt / ".parallel_dcp.json").unlink()
    if plant == "symlink":
        (ckpt / ".parallel_dcp.json").symlink_to(forged)
    else:
        os.mkfifo(ckpt / ".parallel_dcp.json")
    with pytest.raises(UnsafeCheckpointError, match=r"\.parallel_dcp\.json"):
        parallel_dcp.verify(ckpt, workers=1)


def test_a_shard_gone_with_an_overwrite_names_the_overwrite_and_one_gone_alone_the_damage(tmp_path: Path) -> None:
    """A load that read ``.metadata`` before another save replaced the checkpoint finds its shards
    gone: that is the overwrite, not damage (it was called "damaged: shard ... is missing"); a
    shard missing while ``.metadata`` still names it is damage."""
    from parallel_dcp.storage.location import locate
    from parallel_dcp.storage.metadata import check_shards, read_metadata

    dest = tmp_path / "ckpt"
    parallel_dcp.save({"w": torch.zeros(64)}, dest, workers=1)
    read_before = read_metadata(dest)
    parallel_dcp.save({"w": torch.ones(64)}, dest, workers=1, overwrite=True)
    with pytest.raises(CorruptCheckpointError, match="changed while reading: another save overwrote it"):
        check_shards(locate(dest), read_before)
    check_shards(locate(dest), read_metadata(dest))
    for shard in dest.glob("*.distcp"):
        shard.unlink()
    with pytest.raises(CorruptCheckpointError, match=r"is damaged: shard .* is missing"):
        check_shards(locate(dest), read_metadata(dest))
