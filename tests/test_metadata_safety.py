"""Our readers never run code from a checkpoint's .metadata."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

import parallel_dcp
from parallel_dcp import CorruptCheckpointError, UnsafeCheckpointError


class Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_malicious_metadata_is_refused_without_running_it(tmp_path: Path) -> None:
    parallel_dcp.save({"w": torch.ones(1)}, tmp_path / "ckpt", workers=1)
    marker = tmp_path / "pwned"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(Exploit(str(marker))))
    with pytest.raises(UnsafeCheckpointError, match="system"):
        parallel_dcp.load(tmp_path / "ckpt")
    assert not marker.exists(), "the payload ran"


@pytest.mark.parametrize("keep", [0, 10, 200], ids=["empty", "10-bytes", "200-bytes"])
def test_truncated_metadata_is_a_clear_error(keep: int, tmp_path: Path) -> None:
    parallel_dcp.save({"w": torch.ones(1)}, tmp_path / "ckpt", workers=1)
    path = tmp_path / "ckpt" / ".metadata"
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupt"):
        parallel_dcp.load(tmp_path / "ckpt")


def test_metadata_of_the_wrong_type(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(CorruptCheckpointError, match="does not hold DCP Metadata"):
        parallel_dcp.load(tmp_path / "ckpt")


def test_loading_a_directory_without_a_commit(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match=r"no \.metadata"):
        parallel_dcp.load(tmp_path / "ckpt")


def test_allowed_classes_built_without_their_fields_are_a_clear_error(tmp_path: Path) -> None:
    # A crafted (or fuzzed) .metadata may hold the right classes with fields missing: every
    # reader says the checkpoint is corrupt, none fails with an AttributeError.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    parallel_dcp.save({"w": torch.ones(4)}, tmp_path / "ckpt", workers=1)
    metadata = FileSystemReader(str(tmp_path / "ckpt")).read_metadata()
    metadata.state_dict_metadata["w"].chunks = [ChunkStorageMetadata.__new__(ChunkStorageMetadata)]
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(metadata))
    for read in (parallel_dcp.load, parallel_dcp.inspect, parallel_dcp.verify):
        with pytest.raises(CorruptCheckpointError, match="malformed metadata"):
            read(tmp_path / "ckpt")
