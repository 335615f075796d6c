"""Every output is verifiable on its own (issue 31, item 3).

A single safetensors file carries its checksums in its header's ``__metadata__`` (stock readers
ignore it); a torch.save file has a sidecar ``NAME.manifest.json``; a sharded Hugging Face folder
has the directory manifest. ``verify`` finds a flipped byte in each without ``against``; a file
without checksums is reported as such (not OK) unless ``against`` is given.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import parallel_dcp
from parallel_dcp.cli import main


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {f"layer{i}.weight": torch.randn(64 + i, 32, generator=gen) for i in range(5)} | {
        "ids": torch.arange(40, dtype=torch.int64)
    }


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x5A
    path.write_bytes(bytes(data))


def _data_start(path: Path) -> int:
    (size,) = struct.unpack("<Q", path.read_bytes()[:8])
    return 8 + size


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """The command run in this process (main(argv), what ``python -m parallel_dcp`` runs): its
    exit code and stdout."""
    code = main(list(args))
    return code, capsys.readouterr().out


@pytest.fixture
def dcp_dir(tmp_path: Path) -> Path:
    parallel_dcp.save(_state(), tmp_path / "ckpt", workers=1)
    return tmp_path / "ckpt"


def test_single_safetensors_carries_checksums_that_stock_readers_ignore(dcp_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.safetensors"
    parallel_dcp.convert(dcp_dir, out, workers=1)
    loaded = load_file(out)
    assert set(loaded) == set(_state())
    for key, tensor in _state().items():
        assert torch.equal(loaded[key], tensor)
    with safe_open(out, framework="pt") as f:
        metadata = f.metadata()
    assert metadata["format"] == "pt"
    assert "parallel_dcp" in metadata
    recorded = json.loads(metadata["parallel_dcp"])
    assert recorded["checksum"] == "xxh3_64"
    report = parallel_dcp.verify(out, workers=1)
    assert report.ok, report.problems
    assert report.manifest and report.files_checked == 1


def test_a_single_safetensors_file_is_hashed_once(
    dcp_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its checksums live in its header: the bytes written are not hashed a second time for a
    digest nothing records. The log is a file, so the writing worker (a fork) adds to it too."""
    from parallel_dcp.storage import manifest

    log = tmp_path / "hashed.log"
    update = manifest.Hasher.update

    def counting(self: manifest.Hasher, data: object) -> None:
        if self._hash is not None:
            with open(log, "a") as f:
                f.write(f"{memoryview(data).nbytes}\n")  # type: ignore[arg-type]
        update(self, data)

    monkeypatch.setattr(manifest.Hasher, "update", counting)
    out = tmp_path / "x.safetensors"
    parallel_dcp.convert(dcp_dir, out, workers=1)
    hashed = sum(int(line) for line in log.read_text().split())
    data_bytes = sum(t.numel() * t.element_size() for t in _state().values())
    assert data_bytes <= hashed < 1.5 * data_bytes
    assert parallel_dcp.verify(out, workers=1).ok


def test_verify_finds_a_flipped_byte_in_a_single_safetensors_file(
    dcp_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.safetensors"
    parallel_dcp.convert(dcp_dir, out, workers=1)
    _flip(out, _data_start(out) + 1000)
    report = parallel_dcp.verify(out, workers=1)
    assert not report.ok
    assert any("x.safetensors" in p and "checksum" in p and "corrupted" in p for p in report.problems), report.problems
    code, out_text = _cli(capsys, "verify", str(out), "--workers", "1")
    assert code == 1, out_text
    assert "FAILED" in out_text and "corrupted" in out_text


def test_verify_finds_a_renamed_key_in_a_single_safetensors_header(dcp_dir: Path, tmp_path: Path) -> None:
    """The header is covered too: a flipped letter in a key name is not a valid file of other keys."""
    out = tmp_path / "x.safetensors"
    parallel_dcp.convert(dcp_dir, out, workers=1)
    data = out.read_bytes()
    at = data.index(b"layer3.weight")
    out.write_bytes(data[:at] + b"lazer3.weight" + data[at + len(b"layer3.weight") :])
    report = parallel_dcp.verify(out, workers=1)
    assert not report.ok
    assert any("header" in p for p in report.problems), report.problems


def test_verify_finds_a_flipped_byte_in_a_torch_file_through_its_sidecar(dcp_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.pt"
    parallel_dcp.convert(dcp_dir, out, workers=1)
    sidecar = tmp_path / "x.pt.manifest.json"
    assert sidecar.is_file()
    document = json.loads(sidecar.read_bytes())
    assert set(document["files"]) == {"x.pt"}
    assert document["files"]["x.pt"]["size"] == out.stat().st_size
    assert parallel_dcp.verify(out, workers=1).ok
    _flip(out, out.stat().st_size // 2)
    report = parallel_dcp.verify(out, workers=1)
    assert not report.ok
    assert any(p.startswith("file x.pt: checksum") for p in report.problems), report.problems


def test_a_torch_file_overwritten_gets_a_new_sidecar(dcp_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.pt"
    parallel_dcp.convert(dcp_dir, out, workers=1)
    parallel_dcp.convert(dcp_dir, out, workers=1, dtype="bfloat16", overwrite=True)
    assert parallel_dcp.verify(out, workers=1).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "x.pt", "x.pt.manifest.json"]


def test_a_stale_sidecar_without_its_file_is_not_replaced_without_overwrite(dcp_dir: Path, tmp_path: Path) -> None:
    sidecar = tmp_path / "x.pt.manifest.json"
    sidecar.write_text("{}")
    with pytest.raises(parallel_dcp.CheckpointExistsError, match=r"x\.pt\.manifest\.json"):
        parallel_dcp.convert(dcp_dir, tmp_path / "x.pt", workers=1)
    assert sidecar.read_text() == "{}"
    assert not (tmp_path / "x.pt").exists()


def test_a_planted_sidecar_symlink_is_not_written_through(dcp_dir: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    parallel_dcp.convert(dcp_dir, tmp_path / "x.pt", workers=1)
    sidecar = tmp_path / "x.pt.manifest.json"
    sidecar.unlink()
    os.symlink(victim, sidecar)
    parallel_dcp.convert(dcp_dir, tmp_path / "x.pt", workers=1, overwrite=True)
    assert victim.read_text() == "keep"
    assert not sidecar.is_symlink() and parallel_dcp.verify(tmp_path / "x.pt", workers=1).ok


def test_a_file_without_checksums_is_not_ok_unless_against(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    foreign = tmp_path / "foreign.safetensors"
    save_file(_state(), foreign)
    report = parallel_dcp.verify(foreign, workers=1)
    assert not report.ok
    assert any("no checksums" in p for p in report.problems), report.problems
    code, out_text = _cli(capsys, "verify", str(foreign), "--workers", "1")
    assert code == 1
    assert "no checksums" in out_text and "--against" in out_text
    reference = tmp_path / "ref.safetensors"
    save_file(_state(), reference)
    assert parallel_dcp.verify(foreign, against=reference, workers=1).ok
    torch.save(_state(), tmp_path / "foreign.pt")
    report = parallel_dcp.verify(tmp_path / "foreign.pt", workers=1)
    assert any("no checksums" in p for p in report.problems), report.problems


def test_sharded_folder_outputs_are_verifiable(dcp_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    parallel_dcp.convert(dcp_dir, out, to="safetensors", shard_size=10_000, workers=1)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1
    assert parallel_dcp.verify(out, workers=1).ok
    _flip(shards[1], _data_start(shards[1]) + 100)
    report = parallel_dcp.verify(out, workers=1)
    assert any(p.startswith(f"file {shards[1].name}: checksum") for p in report.problems), report.problems
