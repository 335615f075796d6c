"""verify reads each shard once: checksums taken during the read-back, records checked on the way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import parallel_dcp
from parallel_dcp.formats.dcp_format import DcpSource
from parallel_dcp.jobs import verify as verify_job


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a second read of the shards")


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_verify_reads_every_shard_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, io: str) -> None:
    sd = {f"w{i}": torch.randn(300 + i, 257) for i in range(6)} | {"empty": torch.empty(0), "step": 3}
    parallel_dcp.save(sd, tmp_path / "ckpt", workers=2)
    # The two reads verify made before: whole-file hashing, then every tensor read back. The
    # workers are forked after the patch, so they would report either as a problem.
    monkeypatch.setattr(verify_job, "file_digest", _refuse)
    monkeypatch.setattr(DcpSource, "read", _refuse)
    monkeypatch.setattr(DcpSource, "read_chunk", _refuse)
    report = parallel_dcp.verify(tmp_path / "ckpt", workers=2, io=io)
    assert report.ok, report.problems
    assert report.manifest and report.files_checked == 3  # two shards and .metadata
    assert report.keys_checked == len(sd)
    assert report.bytes_checked == sum(v.nbytes for v in sd.values() if isinstance(v, torch.Tensor))


def test_one_pass_finds_a_flipped_byte_and_a_truncated_shard(tmp_path: Path) -> None:
    sd = {f"w{i}": torch.randn(512, 256) for i in range(4)}
    parallel_dcp.save(sd, tmp_path / "ckpt", workers=2)
    first, second = sorted((tmp_path / "ckpt").glob("*.distcp"))
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 0x40
    first.write_bytes(bytes(data))
    report = parallel_dcp.verify(tmp_path / "ckpt", workers=2)
    assert not report.ok
    assert any(p.startswith(f"file {first.name}: checksum") for p in report.problems), report.problems
    second.write_bytes(second.read_bytes()[:1000])
    report = parallel_dcp.verify(tmp_path / "ckpt", workers=2)
    assert any(f"file {second.name}: 1000 bytes" in p for p in report.problems), report.problems


def test_one_pass_finds_a_record_that_contradicts_metadata(tmp_path: Path) -> None:
    """A shard rewritten with another dtype and its manifest entry forged to match: the checksum
    passes, the record check does not."""
    import json

    from parallel_dcp.storage.manifest import file_digest

    parallel_dcp.save({"w": torch.randn(64, 64)}, tmp_path / "a", workers=1)
    parallel_dcp.save({"w": torch.randn(64, 64).double()}, tmp_path / "b", workers=1)
    shard_a, shard_b = next((tmp_path / "a").glob("*.distcp")), next((tmp_path / "b").glob("*.distcp"))
    shard_a.write_bytes(shard_b.read_bytes())  # same record offsets: values first, then "w"
    manifest = tmp_path / "a" / ".parallel_dcp.json"
    document = json.loads(manifest.read_text())
    forged = file_digest(shard_a)
    document["files"][shard_a.name] = {"size": forged.size, "xxh3_64": forged.digest}
    manifest.write_text(json.dumps(document))
    report = parallel_dcp.verify(tmp_path / "a", workers=1)
    assert not report.ok
    assert any(p.startswith("w: ") and ("float64" in p or "damaged" in p or "bytes" in p) for p in report.problems), (
        report.problems
    )
