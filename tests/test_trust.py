"""Attacks on the readers: a hostile checkpoint never runs code, never reads outside itself, and
every failure is a ParallelDCPError naming the file or key."""

from __future__ import annotations

import json
import pickle
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

import parallel_dcp
from parallel_dcp import (
    CorruptCheckpointError,
    MemoryLimitExceeded,
    ParallelDCPError,
    UnsafeCheckpointError,
    cli,
)
from parallel_dcp.partial import partial_load
from parallel_dcp.storage.location import dcp_reader
from tests.conftest import assert_same
from tests.faults import RunsCode

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def hostile(tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint written by stock dcp.save whose value 'evil' creates ``marker`` when unpickled."""
    marker = tmp_path / "code-ran"
    ckpt = tmp_path / "hostile"
    state = {"w": torch.arange(6.0), "step": 3, "evil": RunsCode(str(marker))}
    dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
    assert not marker.exists()
    return ckpt, marker


def test_the_attack_is_real_when_the_user_trusts_it(hostile: tuple[Path, Path]) -> None:
    ckpt, marker = hostile
    parallel_dcp.load(ckpt, workers=1, trust_pickle=True)
    assert marker.exists(), "trust_pickle=True unpickles as torch does: the hostile value runs"


READERS = [
    pytest.param(lambda c, o: parallel_dcp.load(c, workers=1), id="load"),
    pytest.param(lambda c, o: parallel_dcp.verify(c, workers=1), id="verify"),
    pytest.param(lambda c, o: parallel_dcp.convert(c, o / "out", workers=1), id="convert-dcp"),
    pytest.param(lambda c, o: parallel_dcp.convert(c, o / "out.pt", workers=1), id="convert-torch"),
    pytest.param(lambda c, o: partial_load(parallel_dcp.load_metadata(dcp_reader(c)), dcp_reader(c)), id="partial"),
]


@pytest.mark.parametrize("read", READERS)
def test_a_hostile_value_is_refused_by_name_and_never_runs(read: Any, hostile: tuple[Path, Path]) -> None:
    ckpt, marker = hostile
    with pytest.raises(UnsafeCheckpointError, match=r"'evil'.*trust_pickle"):
        read(ckpt, ckpt.parent)
    assert not marker.exists()
    assert not (ckpt.parent / "out").exists() and not (ckpt.parent / "out.pt").exists()


def test_keys_selecting_only_tensors_never_touch_the_hostile_value(hostile: tuple[Path, Path]) -> None:
    ckpt, marker = hostile
    out = ckpt.parent / "w.safetensors"
    parallel_dcp.convert(ckpt, out, keys="w", workers=1)
    assert_same(parallel_dcp.load(ckpt, keys=["w", "step"], workers=1), {"w": torch.arange(6.0), "step": 3})
    info = parallel_dcp.inspect(ckpt)
    assert {v["key"] for v in info["values"]} == {"step", "evil"} and all(v["bytes"] > 0 for v in info["values"])
    assert not marker.exists()


def test_the_cli_never_runs_it(hostile: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, marker = hostile
    assert cli.main(["inspect", str(ckpt)]) == 0
    assert "value evil" in capsys.readouterr().out
    assert cli.main(["verify", str(ckpt), "-q"]) == 1
    assert cli.main(["convert", str(ckpt), str(ckpt.parent / "o"), "-q"]) == 1
    err = capsys.readouterr().err
    assert "'evil'" in err and "Traceback" not in err
    assert cli.main(["convert", str(ckpt), str(ckpt.parent / "o.safetensors"), "--keys", "w", "-q"]) == 0
    done = subprocess.run(
        [sys.executable, "-m", "parallel_dcp", "inspect", str(ckpt), "--json"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0 and json.loads(done.stdout)["committed"]
    assert not marker.exists()


def _rewrite_metadata(ckpt: Path, change: Any) -> None:
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    assert isinstance(metadata, Metadata)
    change(metadata)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def _set_path(name: str) -> Any:
    def change(metadata: Metadata) -> None:
        for info in (metadata.storage_data or {}).values():
            info.relative_path = name

    return change


@pytest.mark.parametrize("escape", ["../other/__0_0.distcp", "/ABS/other/__0_0.distcp", "sub/x", "..", "a\0b"])
def test_names_leaving_the_checkpoint_are_refused_before_any_read(escape: str, tmp_path: Path) -> None:
    other = tmp_path / "other"
    dcp.save({"w": torch.full((4,), 7.0)}, checkpoint_id=str(other), no_dist=True)
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.zeros(4)}, checkpoint_id=str(ckpt), no_dist=True)
    _rewrite_metadata(ckpt, _set_path(escape.replace("/ABS", str(tmp_path))))
    for read in (
        lambda: parallel_dcp.load(ckpt, workers=1),
        lambda: parallel_dcp.convert(ckpt, tmp_path / "out", workers=1),
        lambda: parallel_dcp.verify(ckpt, workers=1),
        lambda: parallel_dcp.inspect(ckpt),
    ):
        with pytest.raises(CorruptCheckpointError, match="not a plain file name"):
            read()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("outside", ["/etc/hostname", "/proc/self/pagemap", "../other/.metadata"])
def test_a_manifest_naming_outside_files_is_refused(outside: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    parallel_dcp.save({"w": torch.ones(4)}, ckpt, workers=1)
    manifest = json.loads((ckpt / ".parallel_dcp.json").read_text())
    manifest["files"][outside] = {"size": 1}
    (ckpt / ".parallel_dcp.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError, match="not a plain file name"):
        parallel_dcp.verify(ckpt, workers=1)


IMPOSSIBLE = [
    pytest.param(lambda m: setattr(next(iter(m.storage_data.values())), "length", -5), "offset|length", id="neg-len"),
    pytest.param(lambda m: setattr(next(iter(m.storage_data.values())), "offset", -1), "offset|length", id="neg-off"),
    pytest.param(
        lambda m: setattr(m.state_dict_metadata["w"], "size", torch.Size([10**12])), "impossible", id="huge-tensor"
    ),
    pytest.param(lambda m: setattr(m.state_dict_metadata["w"], "size", torch.Size([-4])), "impossible", id="neg-size"),
]


@pytest.mark.parametrize(("change", "pattern"), IMPOSSIBLE)
def test_impossible_sizes_are_corrupt_checkpoint_errors(change: Any, pattern: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.zeros(4)}, checkpoint_id=str(ckpt), no_dist=True)
    _rewrite_metadata(ckpt, change)
    with pytest.raises(CorruptCheckpointError, match=pattern):
        parallel_dcp.load(ckpt, workers=1)


def test_a_truncated_shard_is_found_before_reading_everywhere(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    parallel_dcp.save({"w": torch.randn(256, 64), "v": torch.ones(3)}, ckpt, workers=1)
    shard = next(p for p in ckpt.iterdir() if p.suffix == ".distcp")
    with open(shard, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CorruptCheckpointError, match=rf"{shard.name} has 100 bytes"):
        parallel_dcp.convert(ckpt, tmp_path / "out.safetensors", workers=1)
    info = parallel_dcp.inspect(ckpt)
    assert info["committed"] is True and shard.name in info["damaged"]  # committed, DAMAGED (issue 31)
    report = parallel_dcp.verify(ckpt, workers=1)
    assert not report.ok and any("truncated" in p for p in report.problems)
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize(
    "content",
    [b"\xff" * 64, struct.pack("<Q", 2**40) + b"{}", struct.pack("<Q", 8) + b"not json", b""],
    ids=["garbage", "huge-header", "not-json", "empty"],
)
def test_garbage_safetensors_is_a_corrupt_checkpoint(
    content: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(content)
    with pytest.raises(CorruptCheckpointError, match=r"bad\.safetensors"):
        parallel_dcp.inspect(bad)
    assert cli.main(["inspect", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "bad.safetensors" in err and "Traceback" not in err


@pytest.mark.parametrize("content", [b"\0" * 64, b"just some text\n"], ids=["zeros", "text"])
def test_a_file_that_is_not_torch_save_never_suggests_trusting_it(content: bytes, tmp_path: Path) -> None:
    bad = tmp_path / "x.pt"
    bad.write_bytes(content)
    for read in (lambda: parallel_dcp.inspect(bad), lambda: parallel_dcp.convert(bad, tmp_path / "o", workers=1)):
        with pytest.raises(CorruptCheckpointError, match=r"not a torch\.save file") as info:
            read()
        assert not isinstance(info.value, UnsafeCheckpointError) and "trust" not in str(info.value)


def test_non_tensor_values_are_sized_for_admission(tmp_path: Path) -> None:
    blob = b"x" * (48 * 2**20)
    with pytest.raises(MemoryLimitExceeded, match="blob"):
        parallel_dcp.save({"blob": blob, "w": torch.ones(4)}, tmp_path / "ckpt", memory_limit="40MiB", workers=1)
    assert list(tmp_path.iterdir()) == []


def test_every_reader_error_is_a_parallel_dcp_error(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    parallel_dcp.save({"w": torch.ones(4)}, ckpt, workers=1)
    (ckpt / ".parallel_dcp.json").write_text("{not json")
    with pytest.raises(ParallelDCPError):
        parallel_dcp.verify(ckpt, workers=1)
