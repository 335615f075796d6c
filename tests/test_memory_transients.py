"""Every temporary a task makes is bounded and counted before it exists (issue 31, items 1 and 6).

Each test here reproduces one way a job's memory went past what admission counted, measured
from outside by an independent sampler of the process tree (tests/memory_probe.py).
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import parallel_dcp
from parallel_dcp.errors import QuantizationError
from parallel_dcp.formats.quantized import (
    DEQUANTIZE_WORK_BYTES,
    MAX_BLOCK,
    STRIP_ELEMENTS,
    dequantize_fp8,
    quantize_fp8,
    quantize_work_bytes,
)
from tests.conftest import assert_same
from tests.fresh_interpreter import run_fresh
from tests.memory_probe import PeakSampler
from tests.quantized_checkpoints import deepseek_config, write_hf

MiB = 1024 * 1024


def reference_fp8(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: tuple[int, int]
) -> torch.Tensor:
    """Stock's arithmetic, written out: float32(code) * float32(scale of its block), rounded once."""
    rows, cols = weight.shape
    spread = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.to(torch.float32) * spread.to(torch.float32)).to(dtype)


def fp8_pair(rows: int, cols: int, block: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    scale = torch.rand(math.ceil(rows / block[0]), math.ceil(cols / block[1]), generator=g) * 0.01 + 1e-4
    return weight, scale


@pytest.mark.parametrize("block", [(2, 2), (3, 5), (1, 128), (128, 128), (64, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_dequantize_equals_the_reference_for_any_block(block: tuple[int, int], dtype: torch.dtype) -> None:
    weight, scale = fp8_pair(203, 261, block)
    expected = reference_fp8(weight, scale, dtype, block)
    assert_same(dequantize_fp8(weight, scale, dtype, block), expected)
    piece = dequantize_fp8(weight[7:150, 33:250], scale, dtype, block, row0=7, col0=33)
    assert_same(piece, expected[7:150, 33:250].contiguous())


def test_fp8_dequantize_with_small_blocks_holds_no_table_larger_than_its_strip() -> None:
    """A legal ``weight_block_size: [2, 2]`` made a table of 256 products per block: 96 MiB for
    a 512 x 512 weight (0.5 MiB of output). The temporaries are bounded by the strip. Sampled in a
    fresh interpreter: in the suite's process, whose PSS moves as processes sharing its pages start
    and exit (other tests' servers and workers), it sampled 6.43 MiB against 6 in one full run of four."""
    peak, numel = run_fresh("tests.test_memory_transients", "dequantize_small_blocks_peak")
    assert peak <= 8 * numel + 4 * MiB, peak / MiB


def dequantize_small_blocks_peak() -> tuple[int, int]:
    """(In a fresh interpreter) the sampled peak of a [2, 2]-block dequantize, and the weight's
    element count; its output checked against the reference."""
    weight, scale = fp8_pair(512, 512, (2, 2))
    dequantize_fp8(weight[:4], scale, torch.bfloat16, (2, 2))  # torch's own first-use allocations
    with PeakSampler(interval=0.0005) as sampler:
        out = dequantize_fp8(weight, scale, torch.bfloat16, (2, 2))
    assert_same(out, reference_fp8(weight, scale, torch.bfloat16, (2, 2)))
    return sampler.peak, weight.numel()


def test_fp8_dequantize_of_a_wide_weight_bounds_its_strip_in_columns() -> None:
    """One row block of a weight wider than the strip made an int32 index of the whole block row
    (128 x cols x 4 B) beside the output: the strip is cut in columns too."""
    weight, scale = fp8_pair(128, STRIP_ELEMENTS // 16 + 1000, (128, 128))
    out = dequantize_fp8(weight, scale, torch.bfloat16)
    assert_same(out, reference_fp8(weight, scale, torch.bfloat16, (128, 128)))
    assert DEQUANTIZE_WORK_BYTES >= 8 * STRIP_ELEMENTS


def test_fp8_dequantize_temporaries_are_bounded_by_a_small_strip() -> None:
    """Issue 32 item 3: every 4 Mi-element strip allocated a fresh int32 index and a grid of block
    offsets (32 MiB beside the output; two workers under a tight limit held 64 MiB of them). One
    reused index buffer of a cache-sized strip is all that is held beside the output now."""
    peak, nbytes = run_fresh("tests.test_memory_transients", "dequantize_strip_peak")  # (as above)
    assert 4 * MiB >= DEQUANTIZE_WORK_BYTES
    assert peak <= nbytes + DEQUANTIZE_WORK_BYTES + 2 * MiB, peak / MiB


def dequantize_strip_peak() -> tuple[int, int]:
    """(In a fresh interpreter) the sampled peak of a 22 MiB dequantize, and its output's size."""
    weight, scale = fp8_pair(5504, 2048, (128, 128))  # 22 MiB of bfloat16 out
    dequantize_fp8(weight[:256], scale, torch.bfloat16)  # torch's own first-use allocations
    with PeakSampler(interval=0.0005) as sampler:
        out = dequantize_fp8(weight, scale, torch.bfloat16)
    assert_same(out, reference_fp8(weight, scale, torch.bfloat16, (128, 128)))
    return sampler.peak, out.nbytes


def test_a_dequantized_unit_counts_temporaries_bounded_by_the_unit(tmp_path: Path) -> None:
    """What admission counts for a unit's arithmetic: at most DEQUANTIZE_WORK_BYTES for a large
    weight (it was 40 MiB a unit: fewer units fit a tight limit), and never more than the small
    unit's own elements call for."""
    from parallel_dcp.formats import open_source
    from parallel_dcp.formats.dequantized_source import dequantized_source

    tensors: dict[str, torch.Tensor] = {}
    for name, (rows, cols) in {"big.weight": (5504, 2048), "small.weight": (16, 24)}.items():
        tensors[name], tensors[name + "_scale_inv"] = fp8_pair(rows, cols, (128, 128))
    src = write_hf(tmp_path / "src", tensors, [list(tensors)], deepseek_config())
    view = dequantized_source(open_source(str(src)), torch.bfloat16)
    try:
        for name in ("big.weight", "small.weight"):
            elements = tensors[name].numel()
            read = sum(view.inner.copied_bytes(k) for k in (name, name + "_scale_inv"))  # type: ignore[union-attr]
            work = view.copied_bytes(name) - read - 2 * elements  # beside the reads and the bfloat16 output
            assert 0 < work <= min(DEQUANTIZE_WORK_BYTES, 4 * MiB, 16 * elements), (name, work)
    finally:
        view.close()


@pytest.mark.slow
def test_fp8_small_block_conversion_stays_under_its_limit(tmp_path: Path) -> None:
    """The review's reproducer, smaller: FP8 with ``weight_block_size: [2, 2]`` dequantized
    under a tight limit stayed 'successful' at 102 MiB under 64 MiB."""
    weight, scale = fp8_pair(1024, 1024, (2, 2))
    src = write_hf(
        tmp_path / "src",
        {"w.weight": weight, "w.weight_scale_inv": scale},
        [["w.weight"], ["w.weight_scale_inv"]],
        deepseek_config(block=2),
    )
    limit = 48 * MiB
    with PeakSampler() as sampler:
        result = parallel_dcp.convert(src, tmp_path / "out", dequantize=True, workers=1, memory_limit=limit)
    assert isinstance(result, parallel_dcp.SaveResult)
    assert result.peak_memory <= limit
    assert sampler.peak <= limit, f"{sampler.peak / MiB:.1f} MiB under a limit of {limit / MiB:.0f} MiB"


def sparse_safetensors(path: Path, name: str, shape: tuple[int, ...]) -> None:
    """A uint8 tensor of ``shape`` in a safetensors file whose data is a hole (no disk, no RAM)."""
    nbytes = math.prod(shape)
    header = json.dumps({name: {"dtype": "U8", "shape": list(shape), "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + nbytes)


def test_mxfp4_scale_check_reads_scales_in_bounded_pieces(tmp_path: Path) -> None:
    """The coordinator's NaN-exponent check read each whole E8M0 scale tensor before any
    admission (152 MiB under a 32 MiB limit in the review): it reads bounded pieces."""
    src = tmp_path / "mx"
    src.mkdir()
    shape = (8, 1024, 4096)  # 32 MiB of scales; 512 MiB of blocks, a hole on disk
    sparse_safetensors(src / "model-00001-of-00002.safetensors", "e.gate_up_proj_blocks", (*shape, 16))
    g = torch.Generator().manual_seed(0)
    scales = torch.randint(0, 255, shape, dtype=torch.uint8, generator=g)
    scales[-1, -1, -1] = 255  # the NaN exponent, in the last piece
    save_file({"e.gate_up_proj_scales": scales}, str(src / "model-00002-of-00002.safetensors"))
    del scales
    weight_map = {
        "e.gate_up_proj_blocks": "model-00001-of-00002.safetensors",
        "e.gate_up_proj_scales": "model-00002-of-00002.safetensors",
    }
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp4"}}))
    # once unmeasured: torch's and the readers' first-use allocations are not the check's
    with pytest.raises(QuantizationError, match="exponent 255"):
        parallel_dcp.convert(src, tmp_path / "out", dequantize=True, dry_run=True, memory_limit="32MiB")
    with PeakSampler(interval=0.0005) as sampler, pytest.raises(QuantizationError, match="exponent 255"):
        parallel_dcp.convert(src, tmp_path / "out", dequantize=True, dry_run=True, memory_limit="32MiB")
    assert sampler.peak <= 16 * MiB, f"{sampler.peak / MiB:.1f} MiB to check 32 MiB of scales"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"quantize": "fp8-block:" + "9" * 20},
        {"quantize": f"fp8-block:{MAX_BLOCK + 1}"},
        {"dequantize": True, "block_size": 10**20},
    ],
)
def test_an_absurd_block_size_is_refused_before_any_write(tmp_path: Path, kwargs: dict[str, object]) -> None:
    """``quantize="fp8-block:<20 digits>"`` failed in a worker with a TypeError."""
    src = tmp_path / "src.safetensors"
    save_file({"layers.0.w.weight": torch.randn(64, 64)}, str(src))
    with pytest.raises(QuantizationError, match=f"from 1 to {MAX_BLOCK}"):
        parallel_dcp.convert(src, tmp_path / "out", workers=1, **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


def test_a_config_with_an_absurd_block_size_is_refused(tmp_path: Path) -> None:
    weight, scale = fp8_pair(64, 64, (64, 64))
    config = deepseek_config() | {"quantization_config": {"quant_method": "fp8", "weight_block_size": [10**20] * 2}}
    src = write_hf(
        tmp_path / "src",
        {"w.weight": weight, "w.weight_scale_inv": scale},
        [["w.weight", "w.weight_scale_inv"]],
        config,
    )
    with pytest.raises(QuantizationError, match="weight_block_size"):
        parallel_dcp.convert(src, tmp_path / "out", dequantize=True, workers=1)
    assert not (tmp_path / "out").exists()


def test_a_block_larger_than_the_weight_quantizes_as_one_block_without_padding_to_it() -> None:
    """Padding to whole blocks allocated the whole block: a 1M x 1M float32 strip for a 50 x 70 weight."""
    weight = torch.randn(50, 70)
    values, scales = quantize_fp8(weight, (MAX_BLOCK, MAX_BLOCK))
    same_values, same_scales = quantize_fp8(weight, (50, 70))
    assert scales.shape == (1, 1)
    assert_same(values, same_values)
    assert_same(scales, same_scales)
    assert quantize_work_bytes(50, 70, (MAX_BLOCK, MAX_BLOCK)) == 4 * 4 * 50 * 70


def _fp8_release(directory: Path) -> Path:
    """About 68 MiB of FP8 weights, ragged shapes, each scale in another shard (136 MiB of bfloat16 out)."""
    shapes = [(3947, 4061), (3389, 6003), (5459, 3007), (1821, 8050)]
    tensors: dict[str, torch.Tensor] = {}
    names = []
    for i, (rows, cols) in enumerate(shapes):
        name = f"model.layers.{i}.mlp.down_proj.weight"
        names.append(name)
        tensors[name], tensors[name + "_scale_inv"] = fp8_pair(rows, cols, (128, 128), seed=i)
        tensors[name] = tensors[name].view(torch.uint8).clamp_(max=0x7E).view(torch.float8_e4m3fn)  # no NaN codes
    shards = [[name, names[i - 1] + "_scale_inv"] for i, name in enumerate(names)]
    return write_hf(directory, tensors, shards, deepseek_config())


RUNS = 8  # conversions under the ceiling test's limit (its docstring says why 8)


@pytest.mark.slow
def test_the_ceiling_holds_in_every_run_under_load(tmp_path: Path) -> None:
    """The review's reproducer, scaled down: dequantize FP8 with 2 workers under a quarter of the
    output's size, RUNS times in a row while another process keeps a core busy. In every run both the
    reported peak (``SaveResult.peak_memory``, the review saw 133 and 137 MiB against 108 MiB in 2
    runs of 3) and an independent 2 ms sampler's peak, counted the same way, stay under the limit.
    The sampler once read up to 32 MiB over a 24.7 MiB limit: each worker keeps ~6.5 MiB after its
    first task while admission planned 4 MiB idle; workers are now planned at their resting cost
    from the fork on (``WORKER_MEMORY_BYTES``).

    The conversions run in a fresh interpreter (tests/fresh_interpreter.py), as the CLI runs them:
    in the pytest process of the whole suite, forked workers copied enough of its heap to fail the
    ninth run in 2 of 5 suites (37.6 MiB exactly read against 32.2, the governor stopping it; the
    test alone passed every time): a parent that has run a thousand tests is not the caller this
    plan is for (docs/guarantees.md, "The memory ceiling").

    RUNS was 20: every way this test has caught going over showed in most runs (the reported peak
    in 2 of 3, the sampler in 3 of 3; a job planned under 4 times the limit goes over in every
    run), and the ninth-run failure was the suite's process, which the fresh interpreter removed."""
    src = _fp8_release(tmp_path / "fp8")
    output = sum(math.prod(shape) * 2 for k, shape in _shapes(src).items() if not k.endswith("_scale_inv"))
    limit = output // 4
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        peaks = run_fresh(
            "tests.test_memory_transients", "convert_under_a_quarter", str(src), str(tmp_path), str(limit), str(RUNS)
        )
    finally:
        busy.kill()
        busy.wait()
    assert len(peaks) == RUNS
    for run, (reported, sampled) in enumerate(peaks):
        assert reported <= limit, (run, limit / MiB, peaks)
        assert sampled <= limit, (run, limit / MiB, peaks)
    reported, sampled = (max(p[i] for p in peaks) / MiB for i in (0, 1))
    print(f"max reported peak {reported:.1f} MiB, sampled {sampled:.1f} MiB, of {limit / MiB:.1f} MiB")


def convert_under_a_quarter(src: str, folder: str, limit: str, runs: str) -> list[tuple[int, int]]:
    """(In a fresh interpreter) dequantize ``src`` ``runs`` times under ``limit`` bytes with 2
    workers: each run's (reported peak, an independent 2 ms sampler's peak); a run that fails
    raises (and the interpreter's exit status says so)."""
    peaks = []
    for run in range(int(runs)):
        out = Path(folder) / f"out{run}"
        with PeakSampler() as sampler:
            result = parallel_dcp.convert(
                src, out, dequantize=True, dtype="bfloat16", workers=2, memory_limit=int(limit), sync_files=False
            )
        assert isinstance(result, parallel_dcp.SaveResult)
        peaks.append((result.peak_memory, sampler.peak))
        shutil.rmtree(out)
    return peaks


def _shapes(src: Path) -> dict[str, torch.Size]:
    from safetensors import safe_open

    shapes = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            shapes |= {k: torch.Size(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    return shapes
