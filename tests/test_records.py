"""Differential tests of the lean record writer (parallel_dcp.storage.records) against torch.save itself."""

from __future__ import annotations

import io
import subprocess
import sys
import tracemalloc
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import parallel_dcp
from parallel_dcp.storage import records
from tests.test_roundtrip import DTYPES, nested_state, odd_shapes, random_tensor

ID_RECORD = ".data/serialization_id"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def crc_off() -> Iterator[None]:
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    yield
    torch.serialization.set_crc32_options(before)


def as_dcp_writes(tensor: torch.Tensor) -> torch.Tensor:
    """What DCP hands to torch.save: detached, and cloned unless its storage is exactly its bytes."""
    tensor = tensor.detach()
    return tensor.clone() if tensor.untyped_storage().nbytes() != tensor.nbytes else tensor


def matrix() -> list[tuple[str, torch.Tensor]]:
    """Every dtype/shape/stride case of tests/test_roundtrip.py."""
    cases = [(f"{dtype}-t{i}", random_tensor((7, 5 + i), dtype, seed=i)) for dtype in DTYPES for i in range(6)]
    cases += [(f"{dtype}-scalar", random_tensor((), dtype, seed=99)) for dtype in DTYPES]
    cases += [(f"odd-{name}", t) for name, t in odd_shapes().items()]
    nested = nested_state()
    cases += [("nested-embed", nested["model"]["embed.weight"])]
    cases += [("nested-step", nested["optimizer"]["state"]["0"]["step"])]
    cases += [(f"nested-buffer{i}", t) for i, t in enumerate(nested["buffers"])]
    return cases


def lean_record(tensor: torch.Tensor) -> bytes:
    template = records.template_for(tensor)
    assert template is not None
    return template.prefix + records.storage_bytes(tensor).tobytes() + template.suffix


def serialization_id(record: bytes) -> bytes:
    """The id record's bytes, read by its offsets (the CRC is off: zipfile would refuse them)."""
    with zipfile.ZipFile(io.BytesIO(record)) as archive:
        (info,) = [i for i in archive.infolist() if i.filename.endswith(ID_RECORD)]
    at = info.header_offset
    name_length, extra_length = (int.from_bytes(record[at + i : at + i + 2], "little") for i in (26, 28))
    start = at + 30 + name_length + extra_length
    return record[start : start + info.file_size]


def torch_save_bytes(tensor: torch.Tensor, id_length: int) -> bytes:
    """torch.save's record; drawn again until its random serialization id has ``id_length`` digits."""
    for _ in range(100):
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        if len(serialization_id(buffer.getvalue())) == id_length:
            return buffer.getvalue()
    raise AssertionError("torch.save never drew a serialization id of the template's length")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if (a.dtype, a.shape, a.stride()) != (b.dtype, b.shape, b.stride()):
        return False
    return a.nbytes == 0 or records.storage_bytes(a).tobytes() == records.storage_bytes(b).tobytes()


@pytest.mark.parametrize(("name", "original"), matrix(), ids=[n for n, _ in matrix()])
def test_lean_record_is_what_torch_save_writes(name: str, original: torch.Tensor, crc_off: None) -> None:
    tensor = as_dcp_writes(original)
    record = lean_record(tensor)
    loaded = torch.load(io.BytesIO(record), weights_only=True)
    assert same_bits(loaded, tensor), name
    ours = serialization_id(record)
    stock = torch_save_bytes(tensor, len(ours))
    assert stock.replace(serialization_id(stock), ours) == record


def test_records_of_one_class_share_the_template(crc_off: None) -> None:
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    assert records.template_for(a) is records.template_for(b)
    assert lean_record(a) != lean_record(b)
    assert torch.equal(torch.load(io.BytesIO(lean_record(b)), weights_only=True), b)


@pytest.mark.parametrize("nbytes", [records.LEAN_MAX_BYTES, 3 * 1024 * 1024 + 512])
def test_building_a_template_holds_no_copy_of_the_tensors_bytes(nbytes: int, crc_off: None) -> None:
    """A template was torch.save of a whole tensor of the class into a buffer, taken out, sliced,
    compared and joined again: four to five copies of its bytes at once (a 3 MiB class, 12-16 MiB
    in a worker that had counted none of them, and an MXFP4 dequantize went over its limit). The
    tensor's bytes are left out as torch.save writes them: building holds only the small rest."""
    tensor = torch.empty(nbytes // 2 - 7, dtype=torch.bfloat16)  # a class no other test builds
    tracemalloc.start()
    try:
        template = records.template_for(tensor)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert template is not None and template.nbytes == tensor.nbytes
    assert peak < 256 * 1024, f"{peak / 2**20:.1f} MiB held to build the template of a {nbytes / 2**20:.1f} MiB class"
    tensor.copy_(torch.arange(tensor.numel()))
    assert torch.equal(torch.load(io.BytesIO(lean_record(tensor)), weights_only=True), tensor)


@pytest.mark.parametrize(
    "tensor",
    [torch.ones(1, dtype=torch.uint8), torch.ones(2, dtype=torch.bool), torch.ones(6, dtype=torch.int8), torch.ones(0)],
    ids=["1-byte", "2-byte", "6-byte", "empty"],
)
def test_a_tiny_class_keeps_torch_saves_own_small_writes(tensor: torch.Tensor, crc_off: None) -> None:
    """torch.save writes 1-, 2- and 6-byte pieces of its zip before a tensor's bytes: only the write
    right after the storage member's header is the tensor's, whatever its size."""
    record = lean_record(tensor)
    ours = serialization_id(record)
    stock = torch_save_bytes(tensor, len(ours))
    assert stock.replace(serialization_id(stock), ours) == record


BUILD_ELSEWHERE = (
    "import sys, torch; from parallel_dcp.storage import records; "
    "torch.serialization.set_crc32_options(False); "
    "t = records.template_for(torch.empty(3, 4, dtype=torch.bfloat16)); "
    "sys.stdout.write((t.prefix + t.suffix).hex())"
)


def test_a_class_gets_the_same_record_in_every_process(crc_off: None) -> None:
    """torch.save draws a random serialization id; a template built in one worker and not in
    another once made two saves of one state dict differ by it (a flaky byte comparison)."""
    built = [
        subprocess.run(
            [sys.executable, "-c", BUILD_ELSEWHERE], capture_output=True, text=True, check=True, cwd=ROOT
        ).stdout
        for _ in range(2)
    ]
    template = records.template_for(torch.empty(3, 4, dtype=torch.bfloat16))
    assert template is not None
    assert built[0] == built[1] == (template.prefix + template.suffix).hex()
    ours = serialization_id(lean_record(torch.ones(3, 4, dtype=torch.bfloat16)))
    assert ours.isdigit() and len(ours) == len(serialization_id(torch_save_bytes(torch.ones(1), len(ours))))


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(4, dtype=torch.float64).to(torch.complex128),  # a dtype outside the tested ones
        torch.zeros(records.LEAN_MAX_BYTES // 4 + 1),  # larger than the lean path takes
        torch.arange(10.0)[2:5],  # storage larger than the tensor (DCP clones it first)
        torch.randn(3, requires_grad=True),
        torch.nn.Parameter(torch.randn(3)),
        torch.randn(3, dtype=torch.complex64).conj(),
    ],
    ids=["complex128", "large", "offset", "requires_grad", "parameter", "conj"],
)
def test_untested_cases_fall_back_to_torch_save(tensor: torch.Tensor, crc_off: None) -> None:
    assert records.template_for(tensor) is None


def test_crc_on_falls_back_to_torch_save() -> None:
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)
    try:
        assert records.template_for(torch.randn(3)) is None
    finally:
        torch.serialization.set_crc32_options(before)


def shard_records(path: Path) -> list[bytes]:
    """Every torch.save record in a checkpoint's shards, cut out by the offsets .metadata records."""
    metadata = FileSystemReader(str(path)).read_metadata()
    out = []
    for info in metadata.storage_data.values():
        data = (path / info.relative_path).read_bytes()
        out.append(data[info.offset : info.offset + info.length])
    return out


@pytest.mark.parametrize("crc32", [False, True])
def test_saved_records_carry_a_crc_only_when_asked(crc32: bool, tmp_path: Path) -> None:
    sd = {f"t{i}": torch.randn(5, 3 + i) for i in range(4)} | {"big": torch.randn(records.LEAN_MAX_BYTES // 4 + 8)}
    parallel_dcp.save(sd, tmp_path / "ckpt", workers=1, crc32=crc32, executor="processes")
    found = shard_records(tmp_path / "ckpt")
    assert len(found) == len(sd)
    for record in found:
        with zipfile.ZipFile(io.BytesIO(record)) as archive:
            crcs = {info.filename: info.CRC for info in archive.infolist()}
            if crc32:
                assert archive.testzip() is None  # every record's CRC is right
            else:
                assert set(crcs.values()) == {0}  # what torch.save writes with the CRC off
    loaded = parallel_dcp.load(tmp_path / "ckpt", workers=1)
    for key, tensor in sd.items():
        assert torch.equal(loaded[key], tensor)
