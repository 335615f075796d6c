"""A conversion checks its source's bytes against the checksums the source carries.

A flipped byte in a checksummed source (a DCP shard under ``.parallel_dcp.json``, a safetensors
file's own header record, a torch.save file's ``NAME.manifest.json``) used to pass through
``convert``: the output got fresh checksums over the damaged data, and ``verify`` of it passed.
Now a file that a task reads whole is hashed as it is read, and a mismatch is a
``SourceChecksumError`` naming the file, with nothing written (no task kept for ``--resume``).
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import parallel_dcp
from parallel_dcp.cli import main


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {f"layer{i}.weight": torch.randn(64 + i, 32, generator=gen) for i in range(4)} | {
        "ids": torch.arange(40, dtype=torch.int64)
    }


def _flip(path: Path, at: int) -> None:
    """A byte flipped as a device flips it: the file's modification time stays (a file written
    after its checksums were recorded may be a rewrite: its refusal says so too)."""
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x5A]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def _dcp_source(tmp: Path) -> Path:
    """A DCP checkpoint with a flipped byte in the tensor data of one of its shards."""
    src = tmp / "src_dcp"
    parallel_dcp.save(_state(), src, workers=1)
    shard = next(p for p in sorted(src.iterdir()) if p.name.endswith(".distcp"))
    _flip(shard, shard.stat().st_size // 2)
    return src


def _safetensors_source(tmp: Path) -> Path:
    """One safetensors file (its checksums in its header) with a flipped byte in its data."""
    src = tmp / "src.safetensors"
    parallel_dcp.convert(_dcp_source_clean(tmp), src, workers=1)
    (size,) = struct.unpack("<Q", src.read_bytes()[:8])
    _flip(src, 8 + size + 100)
    return src


def _torch_source(tmp: Path) -> Path:
    """One torch.save file (its checksum in src.pt.manifest.json) with a flipped byte in a tensor."""
    src = tmp / "src.pt"
    parallel_dcp.convert(_dcp_source_clean(tmp), src, workers=1)
    _flip(src, src.stat().st_size // 2)
    return src


def _dcp_source_clean(tmp: Path) -> Path:
    clean = tmp / "clean_dcp"
    if not clean.exists():
        parallel_dcp.save(_state(), clean, workers=1)
    return clean


def _tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` (or the file itself) by name, with its content's hash."""
    if path.is_file():
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


# source, destination, workers (a DCP output on one worker: one task reads every shard whole)
CASES = [
    pytest.param(_dcp_source, "out.safetensors", 2, id="dcp-shard-to-safetensors"),
    pytest.param(_dcp_source, "out.pt", 2, id="dcp-shard-to-torch"),
    pytest.param(_dcp_source, "out_sharded", 2, id="dcp-shard-to-hf-dir"),
    pytest.param(_safetensors_source, "out_dcp", 1, id="safetensors-to-dcp"),
    pytest.param(_safetensors_source, "out.pt", 2, id="safetensors-to-torch"),
    pytest.param(_torch_source, "out_dcp", 1, id="torch-to-dcp"),
    pytest.param(_torch_source, "out.safetensors", 2, id="torch-to-safetensors"),
]


@pytest.mark.parametrize(("make", "name", "workers"), CASES)
def test_flipped_byte_is_refused_and_nothing_written(tmp_path: Path, make, name: str, workers: int) -> None:
    src = make(tmp_path)
    dst = tmp_path / name
    to = "safetensors" if name == "out_sharded" else None
    with pytest.raises(parallel_dcp.SourceChecksumError) as caught:
        parallel_dcp.convert(src, dst, workers=workers, to=to)
    message = str(caught.value)
    assert "not the ones its checksum" in message
    assert os.fspath(src) in message  # names the damaged file (the source, or the shard in it)
    assert "--no-source-checks" in message
    assert isinstance(caught.value, parallel_dcp.CorruptCheckpointError)
    assert not os.path.lexists(dst)  # nothing written, not even a finished task kept for resume
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == []


@pytest.mark.parametrize(("make", "name", "workers"), [CASES[1], CASES[3], CASES[5]])
def test_an_existing_destination_is_left_as_it_was(tmp_path: Path, make, name: str, workers: int) -> None:
    dst = tmp_path / name
    parallel_dcp.convert(_dcp_source_clean(tmp_path), dst, workers=1)  # the checkpoint there now
    before = _tree(dst)
    src = make(tmp_path)
    with pytest.raises(parallel_dcp.SourceChecksumError):
        parallel_dcp.convert(src, dst, workers=workers, overwrite=True)
    assert _tree(dst) == before
    assert parallel_dcp.verify(dst).ok


def test_the_cli_refuses_with_exit_code_1_and_the_file_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _safetensors_source(tmp_path)
    code = main(["convert", os.fspath(src), os.fspath(tmp_path / "out.pt"), "--workers", "1"])
    err = capsys.readouterr().err
    assert code == 1
    assert "src.safetensors" in err and "not the ones its checksum" in err
    assert not (tmp_path / "out.pt").exists()


def test_check_source_false_converts_the_damaged_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _torch_source(tmp_path)
    parallel_dcp.convert(src, tmp_path / "out.safetensors", workers=1, check_source=False)
    assert parallel_dcp.verify(tmp_path / "out.safetensors").ok  # (what it was: the damage laundered)
    code = main(["convert", os.fspath(src), os.fspath(tmp_path / "cli.safetensors"), "--no-source-checks", "-q"])
    assert code == 0


def test_a_source_without_checksums_converts_as_before(tmp_path: Path) -> None:
    src = tmp_path / "plain.safetensors"
    state = {k: v for k, v in _state().items()}
    save_file(state, src)  # the library's own file: no checksums in its header
    torch.save(state, tmp_path / "plain.pt")  # no sidecar manifest
    for source, out in ((src, "a_dcp"), (tmp_path / "plain.pt", "b.safetensors")):
        parallel_dcp.convert(source, tmp_path / out, workers=1)
        assert parallel_dcp.verify(tmp_path / out, against=source).ok


def test_an_intact_checksummed_source_converts(tmp_path: Path) -> None:
    clean = _dcp_source_clean(tmp_path)
    for out, workers in (("a.safetensors", 2), ("b_dcp", 1), ("c.pt", 2)):
        parallel_dcp.convert(clean, tmp_path / out, workers=workers)
        assert parallel_dcp.verify(tmp_path / out, against=clean).ok


def test_a_file_rewritten_after_its_record_is_refused_naming_both_causes(tmp_path: Path) -> None:
    """A training loop's torch.save over a model.pt we once wrote leaves our sidecar record stale;
    a copy that does not keep modification times makes an intact or a damaged file just as new.
    The time cannot tell them apart, so the file is hashed: the refusal never calls it damaged
    without saying it may be a rewrite, and names the way out of each."""
    src = tmp_path / "model.pt"
    parallel_dcp.convert(_dcp_source_clean(tmp_path), src, workers=1)
    record = src.with_name("model.pt.manifest.json").stat()
    newer = {"w": torch.ones(3)}
    torch.save(newer, src)
    os.utime(src, ns=(record.st_atime_ns, record.st_mtime_ns + 1_000_000_000))  # written after the record
    with pytest.raises(parallel_dcp.SourceChecksumError) as caught:
        parallel_dcp.convert(src, tmp_path / "out", workers=1)
    message = str(caught.value)
    assert "changed after model.pt.manifest.json was written" in message
    assert "rewrote it on purpose" in message and "record is stale" in message and "--no-source-checks" in message
    assert "or it is damaged" in message
    assert not (tmp_path / "out").exists()
    parallel_dcp.convert(src, tmp_path / "out", workers=1, check_source=False)  # the way out it names
    assert torch.equal(parallel_dcp.load(tmp_path / "out")["w"], newer["w"])


def test_a_record_it_cannot_read_converts_with_a_warning(tmp_path: Path) -> None:
    """Another tool's "parallel_dcp" header entry is no checksum record of ours: it proves nothing
    about the data, so the file converts (unchecked, said so)."""
    src = tmp_path / "other.safetensors"
    save_file({"w": torch.ones(3)}, src, metadata={"parallel_dcp": "not ours"})
    with pytest.warns(parallel_dcp.SourceNotCheckedWarning, match="not checked"):
        parallel_dcp.convert(src, tmp_path / "out", workers=1)
    assert torch.equal(parallel_dcp.load(tmp_path / "out")["w"], torch.ones(3))
