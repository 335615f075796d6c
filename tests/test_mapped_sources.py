"""safetensors sources hand workers tensors mapped from the file (no copy), equal to the library's."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from parallel_dcp.engine.chunks import split
from parallel_dcp.formats.safetensors_format import SafetensorsSource
from tests.test_roundtrip import DTYPES, random_tensor


def test_mapped_tensors_equal_the_librarys(tmp_path: Path) -> None:
    sd = {f"{dtype}".removeprefix("torch."): random_tensor((5, 3), dtype) for dtype in DTYPES}
    sd["odd_bf16"] = random_tensor((3,), torch.bfloat16)
    sd["empty"] = torch.empty(0, 4)
    save_file(sd, tmp_path / "m.safetensors")
    source = SafetensorsSource(str(tmp_path / "m.safetensors"))
    got = source.read(list(sd))
    expected = load_file(tmp_path / "m.safetensors")
    for key, tensor in got.items():
        assert tensor.dtype == expected[key].dtype and torch.equal(
            tensor.view(torch.uint8), expected[key].view(torch.uint8)
        )
        # An alias over exactly its own bytes: DCP writes it without cloning it first.
        assert tensor.untyped_storage().nbytes() == tensor.nbytes
    source.release()
    assert torch.equal(got["float32"].view(torch.uint8), expected["float32"].view(torch.uint8))  # still alive


def test_mapped_chunk_rows(tmp_path: Path) -> None:
    big = torch.randn(40, 6)
    save_file({"big": big}, tmp_path / "m.safetensors")
    source = SafetensorsSource(str(tmp_path / "m.safetensors"))
    for chunk in split(source.entries["big"], big.nbytes // 3):
        piece = source.read_chunk(chunk)
        assert torch.equal(piece, chunk.of(big)) and piece.untyped_storage().nbytes() == piece.nbytes


def test_an_unaligned_tensor_is_read_by_the_library(tmp_path: Path) -> None:
    a, b = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16), torch.tensor([7.5])
    header = {
        "a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
        "b": {"dtype": "F32", "shape": [1], "data_offsets": [6, 10]},  # 4-byte floats at byte 6
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + a.view(torch.uint8).numpy().tobytes() + b.numpy().tobytes())
    source = SafetensorsSource(str(path))
    assert "b" not in source._starts and "a" in source._starts
    got = source.read(["a", "b"])
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
