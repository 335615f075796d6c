"""32 workers on a 2-core machine (oversubscribed): save, convert, verify and a Saver's save give the
right output, stay under the ceiling and finish (pytest's timeout fails a hang)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import parallel_dcp
from tests.conftest import assert_same
from tests.memory_probe import PeakSampler

MiB = 2**20
WORKERS = 32
LIMIT = 1024 * MiB  # 32 workers planned at WORKER_MEMORY_BYTES (10 MiB) each at rest, plus tasks


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {f"layer{i}.weight": torch.randn(64, 256) for i in range(96)}  # 96 x 64 KiB


@pytest.mark.timeout(240)
def test_save_convert_and_verify_with_32_workers(tmp_path: Path) -> None:
    sd = _state()
    with PeakSampler(interval=0.02) as sampler:
        saved = parallel_dcp.save(sd, tmp_path / "ckpt", workers=WORKERS, memory_limit=LIMIT, executor="processes")
        converted = parallel_dcp.convert(
            tmp_path / "ckpt", tmp_path / "st", to="safetensors", workers=WORKERS, memory_limit=LIMIT
        )
        report = parallel_dcp.verify(tmp_path / "ckpt", workers=WORKERS, memory_limit=LIMIT)
    assert saved.tasks >= WORKERS and saved.workers == WORKERS
    assert converted.keys == len(sd)
    assert report.ok
    assert sampler.peak < LIMIT, f"tree added {sampler.peak / MiB:.1f} MiB, limit {LIMIT / MiB:.0f} MiB"
    assert 0 <= saved.peak_memory < LIMIT
    assert_same(parallel_dcp.load(tmp_path / "ckpt"), sd)
    back: dict[str, torch.Tensor] = {}
    for shard in sorted((tmp_path / "st").glob("*.safetensors")):
        back.update(load_file(shard))
    assert_same(back, sd)


@pytest.mark.timeout(240)
def test_a_saver_with_32_workers(tmp_path: Path) -> None:
    sd = _state()
    # The sampler starts after the Saver: the fork server and the idle workers are its baseline.
    with parallel_dcp.Saver(workers=WORKERS, memory_limit=LIMIT) as saver, PeakSampler(interval=0.02) as sampler:
        first = saver.save(sd, tmp_path / "a")
        second = saver.save(sd, tmp_path / "b")
    assert first.tasks >= WORKERS and second.executor == "saver"
    assert 0 <= second.peak_memory < LIMIT
    assert sampler.peak < LIMIT, f"tree added {sampler.peak / MiB:.1f} MiB, limit {LIMIT / MiB:.0f} MiB"
    for name in ("a", "b"):
        assert_same(parallel_dcp.load(tmp_path / name), sd)
