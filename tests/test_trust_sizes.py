"""Every size a source claims is admitted before anything is planned or built (issue 31, item 6).

Each test reproduces a finding of the review: a claimed shape that passed the checks and then
failed raw in torch, or made the coordinator plan far past the memory limit.
"""

from __future__ import annotations

import json
import pickle
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

import parallel_dcp
from parallel_dcp.errors import CorruptCheckpointError

HUGE_EMPTY = [0, 1 << 40, 1 << 40]


def _readers(ckpt: Path, out: Path) -> list[Callable[[], Any]]:
    return [
        lambda: parallel_dcp.load(ckpt, workers=1),
        lambda: parallel_dcp.load(ckpt, workers=1, retries=1),
        lambda: parallel_dcp.convert(ckpt, out / "out.safetensors", workers=1),
        lambda: parallel_dcp.verify(ckpt),
    ]


@pytest.mark.parametrize("reader", range(4))
def test_a_zero_size_tensor_with_huge_dimensions_in_metadata_is_refused(tmp_path: Path, reader: int) -> None:
    """It passed the checks and ``load`` raised torch's ``RuntimeError: Stride calculation overflowed``."""
    ckpt = tmp_path / "ckpt"
    parallel_dcp.save({"z": torch.empty(0, 4), "w": torch.ones(3)}, ckpt, workers=1)
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    meta = metadata.state_dict_metadata["z"]
    meta.size = torch.Size(HUGE_EMPTY)
    for chunk in meta.chunks:
        chunk.sizes, chunk.offsets = torch.Size(HUGE_EMPTY), torch.Size([0, 0, 0])
    for index in [k for k in metadata.storage_data if k.fqn == "z"]:
        metadata.storage_data[MetadataIndex("z", torch.Size([0, 0, 0]))] = metadata.storage_data.pop(index)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CorruptCheckpointError, match=r"'z' has the impossible shape \[0, 1099511627776"):
        _readers(ckpt, tmp_path)[reader]()
    assert not (tmp_path / "out.safetensors").exists()


def test_a_zero_size_tensor_with_huge_dimensions_in_a_safetensors_header_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "src.safetensors"
    header = json.dumps({"z": {"dtype": "F32", "shape": HUGE_EMPTY, "data_offsets": [0, 0]}}).encode()
    src.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CorruptCheckpointError, match="'z' has the impossible shape"):
        parallel_dcp.convert(src, tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()
