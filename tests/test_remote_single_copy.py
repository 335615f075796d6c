"""A Saver's workers copy the caller's tensors once, straight into the writer's buffers.

The worker does not read a large tensor into fresh memory and then copy it again into the aligned
write buffers: the writer fills its own buffers with ``process_vm_readv`` and hashes them there
(storage/pending.py). So a task's memory is its buffers, not its bytes, and a worker that lives on
between saves faults in no fresh page for them.
"""

from __future__ import annotations

import io
import resource
from pathlib import Path

import pytest
import torch

import parallel_dcp
from parallel_dcp import _compat
from parallel_dcp.engine.chunks import Chunk
from parallel_dcp.formats.remote_memory_source import PENDING_MIN_BYTES, RemoteMemorySource
from parallel_dcp.storage import direct_write, records
from parallel_dcp.storage.io_mode import resolve_io
from parallel_dcp.storage.pending import PendingTensor
from parallel_dcp.storage.writers import ShardWriter
from tests.conftest import assert_same

# Savers in every test: their workers are forked from one fork server kept for the module.
pytestmark = pytest.mark.usefixtures("kept_fork_server")

MiB = 2**20


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.fixture
def crc_off() -> object:
    _compat.set_crc32(False)
    yield
    _compat.set_crc32(True)


def test_large_tensors_are_charged_nothing_copied_ones_their_copy() -> None:
    wide = torch.randn(1024, 768)
    sd = {
        "big": torch.randn(1024, 512),  # 2 MiB, contiguous: written from the caller's pages
        "transposed": torch.randn(512, 256).t(),  # storage exactly its bytes
        "strided": wide[:, ::3],  # gaps: span copied, then DCP's copy
        "small": torch.ones(8),  # gathered into one buffer, as before
    }
    source = RemoteMemorySource("x", state_dict=sd)
    assert source.copied_bytes("big") == 0
    assert source.copied_bytes("transposed") == 0
    strided = sd["strided"]
    span = ((strided.shape[0] - 1) * strided.stride(0) + (strided.shape[1] - 1) * strided.stride(1) + 1) * 4
    assert source.copied_bytes("strided") == span + strided.nbytes
    assert source.copied_bytes("small") == 32
    rows = Chunk("big", 0, 0, 256, (1024, 512))
    cols = Chunk("big", 1, 0, 256, (1024, 512))
    assert source.chunk_memory(rows) == 0
    assert source.chunk_memory(cols) > 0
    read = source.read(list(sd))
    assert isinstance(read["big"], PendingTensor) and isinstance(read["transposed"], PendingTensor)
    assert isinstance(read["strided"], torch.Tensor) and isinstance(read["small"], torch.Tensor)
    assert torch.equal(read["big"].materialize(), sd["big"])
    assert torch.equal(read["transposed"].materialize(), sd["transposed"])
    assert isinstance(source.read_chunk(rows), PendingTensor)
    assert torch.equal(source.read_chunk(cols), sd["big"][:, :256])


@pytest.mark.parametrize(
    ("shape", "dtype", "transpose"),
    [((2048, 1024), torch.float32, False), ((3000, 1001), torch.bfloat16, False), ((4096, 1536), torch.int8, True)],
)
def test_a_large_class_template_is_what_torch_save_writes(
    crc_off: object, shape: tuple[int, int], dtype: torch.dtype, transpose: bool
) -> None:
    tensor = (torch.randn(shape) * 100).to(dtype)
    tensor = tensor.t() if transpose else tensor
    template = records.class_template(tensor.dtype, tuple(tensor.shape), tensor.stride())
    assert template is not None and tensor.nbytes > records.LEAN_MAX_BYTES
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    stock = buffer.getvalue()
    mine = template.prefix + records.storage_bytes(tensor).tobytes() + template.suffix
    assert len(mine) == len(stock)
    # the same record but for the serialization id (random in torch.save, derived here)
    differing = [i for i, (a, b) in enumerate(zip(mine, stock, strict=True)) if a != b]
    assert not differing or (differing[-1] - differing[0] < 64 and differing[0] > len(template.prefix) + tensor.nbytes)
    loaded = torch.load(io.BytesIO(mine), weights_only=True)
    assert torch.equal(loaded, tensor) and loaded.stride() == tensor.stride()


@pytest.mark.parametrize("direct", [True, False])
def test_the_writer_fills_its_own_buffers_and_faults_in_no_fresh_memory(
    tmp_path: Path, crc_off: object, direct: bool
) -> None:
    if direct and resolve_io("auto", tmp_path, writing=True) == "buffered":
        pytest.skip("O_DIRECT is refused here")
    tensor = torch.randn(16 * MiB)  # 64 MiB
    source = RemoteMemorySource("x", state_dict={"big": tensor})
    direct_write.keep_buffers(direct_write.DEPTH)  # as a Saver's worker does
    try:
        for attempt in range(2):  # the first file pays the buffers' pages and the template
            writer = ShardWriter(tmp_path / str(attempt), sync_files=False, direct=direct)
            (tmp_path / str(attempt)).mkdir()
            pending = source.read(["big"])["big"]
            assert isinstance(pending, PendingTensor)
            before = _faults()
            placed = writer.write_records("shard", [], [pending])
            faults = _faults() - before
    finally:
        direct_write.keep_buffers(0)
    # 64 MiB read into fresh memory faults in 16,384 pages; the buffers are already there
    assert faults < 1024
    data = (tmp_path / "1" / "shard").read_bytes()
    offset, length = placed[0]
    assert torch.equal(torch.load(io.BytesIO(data[offset : offset + length]), weights_only=True), tensor)
    assert writer.digests()["shard"].size == len(data)


def test_a_saver_writes_a_tensor_larger_than_its_memory_limit(tmp_path: Path) -> None:
    sd = {"big": torch.randn(32 * MiB), "small": torch.arange(10)}  # 128 MiB, one key, never split
    with parallel_dcp.Saver(workers=1, memory_limit="96MiB") as saver:
        result = saver.save(sd, tmp_path / "ckpt", chunk_size="1GiB")
    assert result.executor == "saver"
    assert result.peak_memory <= 96 * MiB
    assert_same(parallel_dcp.load(tmp_path / "ckpt"), sd)
    assert parallel_dcp.verify(tmp_path / "ckpt").ok


def test_tensors_from_the_pending_size_up_are_written_from_the_caller() -> None:
    # the rule's boundary: just under it is gathered (a copy), at it is written from the caller
    under = torch.zeros(PENDING_MIN_BYTES - 1, dtype=torch.uint8)
    sd = {"under": under, "at": torch.zeros(PENDING_MIN_BYTES, dtype=torch.uint8)}
    source = RemoteMemorySource("x", state_dict=sd)
    read = source.read(["under", "at"])
    assert isinstance(read["under"], torch.Tensor) and isinstance(read["at"], PendingTensor)


@pytest.mark.parametrize(("compress", "crc32"), [("zstd", False), (None, True)])
def test_compressed_records_and_crc_records_read_what_the_caller_holds(
    tmp_path: Path, compress: str | None, crc32: bool
) -> None:
    # compressed: each large tensor streamed through the scratch into its zstd frame; with the CRC
    # on, no template: each tensor copied here (and charged) and written by torch.save
    sd = {"big": torch.randn(512, 1024), "cols": torch.randn(256, 2048)[:, :1024], "small": torch.ones(3)}
    source = RemoteMemorySource("x", state_dict=sd, pending_writes=not crc32)
    assert source.copied_bytes("big") == (sd["big"].nbytes if crc32 else 0)
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(sd, tmp_path / "ckpt", compress=compress, crc32=crc32, chunk_size="1MiB")
    assert_same(parallel_dcp.load(tmp_path / "ckpt"), sd)
    assert parallel_dcp.verify(tmp_path / "ckpt").ok
