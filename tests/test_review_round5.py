"""What the fifth review round broke, each pinned by a test: safetensors files of uint16/32/64,
the fnuz float8s and float8_e8m0fnu (the MX scale type), which the safetensors library writes
and reads, were refused as "which torch cannot hold", and a conversion of such tensors (or of
complex128, which safetensors cannot hold) to safetensors failed in a worker with a bare KeyError
after the job had started."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

import parallel_dcp
from parallel_dcp.errors import CorruptCheckpointError

_SAFETENSORS_DTYPES = [
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
]


def _random_bits(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Every bit pattern possible: random bytes viewed as ``dtype``."""
    count = dtype.itemsize * int(torch.tensor(shape).prod())
    raw = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    return raw.view(dtype).reshape(shape)


def _header_dtypes(path: Path) -> dict[str, str]:
    data = path.read_bytes()
    header = json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]])
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", _SAFETENSORS_DTYPES, ids=str)
def test_safetensors_dtypes_the_library_holds_load_and_convert_both_ways(tmp_path: Path, dtype: torch.dtype) -> None:
    tensor = _random_bits(dtype, (3, 8))
    src = tmp_path / "in.safetensors"
    st.save_file({"a": tensor}, src)
    loaded = parallel_dcp.load(src)["a"]
    assert loaded.dtype == dtype and torch.equal(_bits(loaded), _bits(tensor))
    parallel_dcp.convert(src, tmp_path / "dcp", workers=1)
    out = tmp_path / "out.safetensors"
    parallel_dcp.convert(tmp_path / "dcp", out, workers=1)
    assert _header_dtypes(out) == _header_dtypes(src)  # the name stock writes
    back = st.load_file(out)["a"]
    assert back.dtype == dtype and torch.equal(_bits(back), _bits(tensor))
    assert parallel_dcp.verify(out, against=src).ok


@pytest.mark.parametrize("dtype", [torch.complex128, torch.float4_e2m1fn_x2], ids=str)
def test_a_dtype_safetensors_cannot_hold_is_refused_by_name_before_anything_is_written(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    parallel_dcp.save({"fine": torch.ones(2), "odd": _random_bits(dtype, (2, 2))}, tmp_path / "dcp", workers=1)
    for out in (tmp_path / "one.safetensors", tmp_path / "sharded"):
        with pytest.raises(ValueError, match=rf"safetensors cannot hold these dtypes: {str(dtype)[6:]} \(odd\)"):
            parallel_dcp.convert(tmp_path / "dcp", out, to="safetensors", workers=1)
        assert not out.exists()
    with pytest.raises(ValueError, match="cannot hold"):
        parallel_dcp.convert(tmp_path / "dcp", tmp_path / "dry", to="safetensors", dry_run=True)
    parallel_dcp.convert(tmp_path / "dcp", tmp_path / "fine.safetensors", keys=["fine"], workers=1)  # the way out


def test_a_packed_float4_safetensors_file_is_refused_as_unsupported_not_as_beyond_torch(tmp_path: Path) -> None:
    src = tmp_path / "f4.safetensors"
    st.save_file({"w": _random_bits(torch.float4_e2m1fn_x2, (2, 3))}, src)
    with pytest.raises(CorruptCheckpointError, match=r"dtype F4 .*which parallel_dcp does not read") as caught:
        parallel_dcp.load(src)
    assert "torch cannot hold" not in str(caught.value)
