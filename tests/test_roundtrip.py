"""Round trips, bit for bit, read back with stock DCP readers and with parallel_dcp.load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

import parallel_dcp
from tests.conftest import assert_same, empty_like_state

DTYPES = [
    torch.float32,
    torch.float16,
    torch.float64,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(shape, generator=gen, dtype=torch.float32) * 10).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen, dtype=torch.int64).to(dtype)


def stock_load(sd: dict[str, Any], path: Path) -> dict[str, Any]:
    target = empty_like_state(sd)
    dcp_load(target, checkpoint_id=str(path), no_dist=True)
    return target


def stock_torch_save(path: Path, tmp_path: Path) -> Any:
    out = tmp_path / "consolidated.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


EXECUTORS = ["processes", "threads"]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips(dtype: torch.dtype, workers: int, executor: str, tmp_path: Path) -> None:
    sd = {f"t{i}": random_tensor((7, 5 + i), dtype, seed=i) for i in range(6)}
    sd["scalar"] = random_tensor((), dtype, seed=99)
    result = parallel_dcp.save(sd, tmp_path / "ckpt", workers=workers, executor=executor)
    assert result.executor == executor
    assert_same(stock_load(sd, tmp_path / "ckpt"), sd)
    assert_same(stock_torch_save(tmp_path / "ckpt", tmp_path), sd)
    assert_same(parallel_dcp.load(tmp_path / "ckpt", workers=workers), sd)


def odd_shapes() -> dict[str, torch.Tensor]:
    big = torch.arange(10_000, dtype=torch.float32).reshape(100, 100)
    return {
        "zero_dim": torch.tensor(3.5),
        "zero_size": torch.empty(0, 4),
        "zero_size_int": torch.empty(3, 0, dtype=torch.int32),
        "transposed": big.t(),
        "column": big[:, 7],
        "strided": big[::3, ::7],
        "small_slice_of_large_storage": big[42, 10:13],
        "expanded": torch.ones(1, 5).expand(4, 5),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    }


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_shapes_and_views_round_trip(workers: int, executor: str, tmp_path: Path) -> None:
    sd = odd_shapes()
    result = parallel_dcp.save(sd, tmp_path / "ckpt", workers=workers, executor=executor)
    assert_same(stock_load(sd, tmp_path / "ckpt"), sd)
    assert_same(stock_torch_save(tmp_path / "ckpt", tmp_path), sd)
    assert_same(parallel_dcp.load(tmp_path / "ckpt", workers=workers), sd)
    # A view is saved as its own elements, never its whole 40 kB storage (records cost < 4 kB each).
    view_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    shard_bytes = sum(p.stat().st_size for p in (tmp_path / "ckpt").glob("*.distcp"))
    assert shard_bytes < view_bytes + 4096 * len(sd), "a view dragged its whole storage into the checkpoint"
    assert result.bytes == view_bytes


def nested_state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(16, 8, generator=gen)
    return {
        "model": {
            "embed.weight": weight,
            "layers": {"0": {"w": torch.randn(8, 8, generator=gen)}, "1": {"w": torch.randn(8, 8, generator=gen)}},
            "head.weight": weight,  # tied: the same tensor under two keys
        },
        "optimizer": {
            "state": {"0": {"step": torch.tensor(10.0), "exp_avg": torch.zeros(16, 8)}},
            "param_groups": [{"lr": 0.001, "betas": [0.9, 0.95], "params": [0, 1, 2], "name": "adamw"}],
        },
        "step": 1234,
        "loss": 2.5,
        "run": "nightly",
        "schedule": [1, 2, 3],
        "buffers": [torch.ones(3), torch.zeros(2, dtype=torch.int64)],
    }


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_nested_state_dict_keeps_its_nesting(workers: int, executor: str, tmp_path: Path) -> None:
    sd = nested_state()
    parallel_dcp.save(sd, tmp_path / "ckpt", workers=workers, executor=executor)
    assert_same(stock_load(sd, tmp_path / "ckpt"), sd)
    assert_same(stock_torch_save(tmp_path / "ckpt", tmp_path), sd)
    assert_same(parallel_dcp.load(tmp_path / "ckpt", workers=workers), sd)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_odd_key_names(workers: int, tmp_path: Path) -> None:
    sd = {
        "ünïcödé.权重": torch.ones(2),
        "with space": torch.zeros(3),
        "dots.in.the.name": torch.arange(4),
        "slash/in/name": torch.full((2, 2), 7.0),
        "emoji 🚀": torch.tensor([1, 2, 3], dtype=torch.int16),
        "": torch.tensor(1.0),
        "nested": {"a.b": torch.ones(1), "c/d": {"ü": torch.zeros(1)}},
    }
    parallel_dcp.save(sd, tmp_path / "ckpt", workers=workers)
    assert_same(stock_load(sd, tmp_path / "ckpt"), sd)
    assert_same(stock_torch_save(tmp_path / "ckpt", tmp_path), sd)
    assert_same(parallel_dcp.load(tmp_path / "ckpt", workers=workers), sd)


def test_load_a_subset_keeps_nesting(tmp_path: Path) -> None:
    sd = nested_state()
    parallel_dcp.save(sd, tmp_path / "ckpt", workers=2)
    part = parallel_dcp.load(tmp_path / "ckpt", keys=["model.layers.1.w", "step", "buffers.1"], workers=2)
    assert part.keys() == {"model", "step", "buffers"}
    assert_same(part["model"]["layers"]["1"]["w"], sd["model"]["layers"]["1"]["w"])
    assert part["step"] == 1234
    # Only element 1 of the list was asked for; DCP's nesting rules rebuild a list around it.
    assert_same(part["buffers"][1], sd["buffers"][1])


def test_load_unknown_key_is_a_clear_error(tmp_path: Path) -> None:
    parallel_dcp.save({"a": torch.ones(1)}, tmp_path / "ckpt", workers=1)
    with pytest.raises(KeyError, match="nope"):
        parallel_dcp.load(tmp_path / "ckpt", keys=["a", "nope"])


def test_save_result_reports_the_work(tmp_path: Path) -> None:
    sd = {f"w{i}": torch.randn(256, 256) for i in range(16)}
    result = parallel_dcp.save(sd, tmp_path / "ckpt", workers=2)
    assert result.bytes == 16 * 256 * 256 * 4
    assert result.files == len(list((tmp_path / "ckpt").glob("*.distcp"))) + 1  # and .metadata
    assert result.tasks >= 2 and result.workers == 2
    assert result.gib_per_s > 0 and result.seconds > 0
    assert sum(w.bytes for w in result.per_worker) == result.bytes
    assert sum(w.tasks for w in result.per_worker) == result.tasks
    assert {w.worker for w in result.per_worker} <= {0, 1}


def test_empty_state_dict_makes_an_empty_checkpoint(tmp_path: Path) -> None:
    result = parallel_dcp.save({}, tmp_path / "ckpt", workers=2)
    assert (tmp_path / "ckpt" / ".metadata").is_file()
    assert result.bytes == 0 and result.tasks == 0
    assert parallel_dcp.load(tmp_path / "ckpt") == {}
