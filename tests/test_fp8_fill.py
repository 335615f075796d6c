"""FP8 weights dequantized straight into a DCP writer's buffers (issue 32 item 3).

A unit of an FP8 -> bf16 conversion to DCP is a PendingTensor whose fill dequantizes the bytes
the writer asks for where it wants them (formats/fp8_fill.py): no output tensor per unit, so the
unit's charge and its real temporaries are bounded by the strip, not by the weight.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import parallel_dcp
from parallel_dcp.formats import open_source
from parallel_dcp.formats.dequantized_source import dequantized_source
from parallel_dcp.formats.fp8_fill import fp8_pending
from parallel_dcp.formats.quantized import DEQUANTIZE_WORK_BYTES, dequantize_fp8, dequantize_work_bytes
from parallel_dcp.jobs import convert as convert_job
from parallel_dcp.jobs.quantization import write_computed
from parallel_dcp.jobs.targets import Job, target_for
from parallel_dcp.options import Options
from parallel_dcp.storage.pending import PendingTensor
from tests.memory_probe import PeakSampler
from tests.quantized_checkpoints import deepseek_config, write_hf

MiB = 1024 * 1024


def fp8_pair(rows: int, cols: int, block: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    scale = torch.rand(math.ceil(rows / block[0]), math.ceil(cols / block[1]), generator=g) * 0.01 + 1e-4
    return weight, scale


def filled(pending: PendingTensor, pieces: list[int], shift: int) -> torch.Tensor:
    """``pending``'s bytes, filled piece by piece into a buffer ``shift`` bytes past an aligned address."""
    buffer = torch.zeros(pending.nbytes + shift, dtype=torch.uint8)
    offset = 0
    for n in pieces:
        pending.fill(offset, n, buffer.data_ptr() + shift + offset)
        offset += n
    assert offset == pending.nbytes
    return buffer[shift:]


def cut(nbytes: int, seed: int, largest: int) -> list[int]:
    rng = random.Random(seed)
    pieces = []
    while sum(pieces) < nbytes:
        pieces.append(min(nbytes - sum(pieces), rng.randint(1, largest)))
    return pieces


@pytest.mark.parametrize("block", [(128, 128), (3, 5), (1, 128), (64, 3), (128, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_filled_bytes_are_dequantize_fp8s_for_any_pieces(block: tuple[int, int], dtype: torch.dtype) -> None:
    """Pieces of any length at any offset (a record's bytes start anywhere in the writer's
    buffer, odd offsets included), for a whole weight and for an unaligned piece of one."""
    weight, scale = fp8_pair(389, 517, block)
    cases = [(weight, 0, 0), (weight[5:300].contiguous(), 5, 0), (weight[:, 129:400].contiguous(), 0, 129)]
    for part, row0, col0 in cases:
        expected = dequantize_fp8(part, scale, dtype, block, row0=row0, col0=col0).view(-1).view(torch.uint8)
        pending = fp8_pending(part, scale, dtype, block, row0=row0, col0=col0)
        assert (pending.dtype, pending.shape, pending.nbytes) == (dtype, tuple(part.shape), expected.numel())
        for seed, largest, shift in [(0, 1 << 20, 0), (1, 40999, 1), (2, 9999, 3)]:
            assert torch.equal(filled(pending, cut(pending.nbytes, seed, largest), shift), expected)


def test_a_filled_weight_holds_no_temporary_of_its_size() -> None:
    """The temporaries of a unit are bounded by the strip: filling a 22 MiB bf16 output into the
    writer's (already faulted) buffer, 1 MiB at a time from an odd offset as the direct writer
    does, adds at most DEQUANTIZE_WORK_BYTES (a materialized output would add 22 MiB)."""
    weight, scale = fp8_pair(5504, 2048, (128, 128))
    expected = dequantize_fp8(weight, scale, torch.bfloat16).view(-1).view(torch.uint8)
    destination = torch.ones(expected.numel() + 1, dtype=torch.uint8)  # faulted in before the baseline
    fp8_pending(weight[:256], scale, torch.bfloat16, (128, 128)).fill(0, 1001, destination.data_ptr())  # first use
    pending = fp8_pending(weight, scale, torch.bfloat16, (128, 128))
    with PeakSampler(interval=0.0005) as sampler:
        offset = 0
        for n in [MiB - 7] + [MiB] * (expected.numel() // MiB + 1):
            n = min(n, pending.nbytes - offset)
            if n:
                pending.fill(offset, n, destination.data_ptr() + 1 + offset)
            offset += n
    assert sampler.peak <= DEQUANTIZE_WORK_BYTES + 2 * MiB < expected.numel(), sampler.peak / MiB
    assert torch.equal(destination[1:], expected)


@pytest.fixture
def one_intra_op_thread() -> Iterator[None]:
    """torch's arithmetic on one thread. With 2 OpenMP threads in a process whose cores are taken
    (the suite's 2 processes on 2 cores, and more), each small operation of a fill waits on its
    threads' barrier: with 3 busy processes beside it, 5.5-12.3 s a case instead of 0.6-1.3 s. What
    a fill holds is counted by the fill (``held()``), not sampled, so the count of threads leaves it
    unchanged."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("rows", "cols", "block"),
    [
        (5504, 2048, (128, 128)),
        (16, 24, (128, 128)),
        (3, 300, (2, 2)),
        (130, 70_000, (128, 128)),
        (2, 300_000, (1, 128)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.usefixtures("one_intra_op_thread")
def test_what_a_fill_holds_is_within_the_units_work_bound(
    rows: int, cols: int, block: tuple[int, int], dtype: torch.dtype
) -> None:
    """Counted: every buffer a fill keeps between pieces (index, tiled offsets, scratch, table) sums
    to at most dequantize_work_bytes of the weight's elements, the work its unit is charged, for
    large, small, wide and small-block weights, pieces aligned or not; all of it goes with the last piece."""
    weight, scale = fp8_pair(rows, cols, block)
    pending = fp8_pending(weight, scale, dtype, block)
    bound = dequantize_work_bytes(weight.numel())
    destination = torch.empty(pending.nbytes + 1, dtype=torch.uint8)
    offset, most = 0, 0
    for n in cut(pending.nbytes, 3, 1 << 20):
        pending.fill(offset, n, destination.data_ptr() + 1 + offset)
        offset += n
        if offset < pending.nbytes:
            most = max(most, pending.fill.held())  # type: ignore[attr-defined]
    assert most <= bound, (most, bound)
    assert pending.fill.held() == 0  # type: ignore[attr-defined]
    expected = dequantize_fp8(weight, scale, dtype, block).view(-1).view(torch.uint8)
    assert torch.equal(destination[1:], expected)


def _source(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}
    for name, (rows, cols) in {"big.weight": (1100, 700), "small.weight": (16, 24)}.items():
        tensors[name], tensors[name + "_scale_inv"] = fp8_pair(rows, cols, (128, 128))
    tensors["norm.weight"] = torch.ones(24, dtype=torch.bfloat16)
    shards = [["big.weight", "small.weight_scale_inv", "norm.weight"], ["small.weight", "big.weight_scale_inv"]]
    return write_hf(tmp_path / "src", tensors, shards, deepseek_config()), tensors


def test_a_computed_unit_is_charged_its_reads_and_its_strip_only(tmp_path: Path) -> None:
    """Admission counts what the unit holds: its FP8 input, its scale and the strip, no output."""
    src, tensors = _source(tmp_path)
    view = dequantized_source(open_source(str(src)), torch.bfloat16)
    try:
        before = view.copied_bytes("big.weight")
        view.computed_writes = True
        inner = view.inner
        assert inner is not None
        read = inner.copied_bytes("big.weight") + inner.copied_bytes("big.weight_scale_inv")
        elements = tensors["big.weight"].numel()
        assert view.copied_bytes("big.weight") == read + min(DEQUANTIZE_WORK_BYTES, 16 * elements)
        assert before - view.copied_bytes("big.weight") == 2 * elements  # the bf16 output is no longer held
        data = view.read(["big.weight", "norm.weight"])
        assert isinstance(data["big.weight"], PendingTensor)
        assert isinstance(data["norm.weight"], torch.Tensor)
    finally:
        view.close()


def test_only_a_templated_dcp_output_computes_into_the_writer(tmp_path: Path) -> None:
    src, _ = _source(tmp_path)
    cases = [("dcp", Options(), None, True), ("safetensors", Options(), None, False)]
    cases += [("dcp", Options(crc32=True), None, False), ("dcp", Options(), torch.float16, False)]
    for to, options, dtype, computed in cases:
        view = dequantized_source(open_source(str(src)), torch.bfloat16)
        try:
            target = target_for(tmp_path / f"out-{to}", to)
            write_computed(Job(view, tuple(view.entries), dtype), target, options)
            assert view.computed_writes is computed, (to, options.crc32, dtype)
        finally:
            view.close()


def _parts(directory: Path) -> dict[int, bytes]:
    found = {}
    for path in directory.glob("*.distcp"):
        match = re.match(r"__(\d+)_", path.name)
        assert match is not None
        found[int(match.group(1))] = path.read_bytes()
    return found


def test_computed_records_are_the_bytes_of_a_materialized_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same shards, byte for byte, whether the writer computed each FP8 record or wrote a tensor."""
    src, _ = _source(tmp_path)
    parallel_dcp.convert(src, tmp_path / "computed", dequantize=True, workers=2)
    monkeypatch.setattr(convert_job, "write_computed", lambda *args: None)
    parallel_dcp.convert(src, tmp_path / "tensors", dequantize=True, workers=2)
    computed, tensors = _parts(tmp_path / "computed"), _parts(tmp_path / "tensors")
    assert len(computed) == 2 and computed == tensors
