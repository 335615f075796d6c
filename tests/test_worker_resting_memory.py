"""A worker is planned at what it keeps between tasks, for every kind of job (issue 31, item 1).

A forked worker adds ~0.1 MiB until it runs a task; afterwards it keeps the pages its first task
copied from the coordinator or allocated (interpreter and torch heaps, module state). Admission
planned 4 MiB per worker and the idle figure measured at the fork, so every task after a worker's
first was admitted beside less than the workers held (an independent sampler read 32 MiB under
a 24.7 MiB limit). Here each kind of job runs on two worker processes and, once every task is
done and the workers rest, the tree is read as the governor counts it (engine/process_memory.py):
what it added, shared among the workers, is at most ``WORKER_MEMORY_BYTES`` each.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import parallel_dcp
from parallel_dcp.engine import memory, pool
from parallel_dcp.engine.memory import WORKER_MEMORY_BYTES
from tests.fresh_interpreter import run_fresh
from tests.quantized_checkpoints import deepseek_config, write_hf
from tests.test_memory_transients import fp8_pair

MiB = 1024 * 1024


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.w": torch.randn(512, 512, generator=g) for i in range(16)}


def _fp8(directory: Path) -> Path:
    tensors: dict[str, torch.Tensor] = {}
    for i in range(4):
        name = f"model.layers.{i}.mlp.down_proj.weight"
        weight, scale = fp8_pair(700 + 37 * i, 900, (128, 128), seed=i)
        tensors[name] = weight.view(torch.uint8).clamp_(max=0x7E).view(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = scale
    return write_hf(directory, tensors, [list(tensors)[:4], list(tensors)[4:]], deepseek_config())


def _dcp(where: Path) -> Path:
    parallel_dcp.save(_state(), where / "dcp", workers=2)
    return where / "dcp"


def _safetensors(where: Path) -> Path:
    save_file(_state(), str(where / "m.safetensors"))
    return where / "m.safetensors"


KINDS: dict[str, Callable[[Path], Any]] = {
    "save": lambda t: parallel_dcp.save(_state() | {"step": 3}, t / "out", workers=2, executor="processes"),
    "lean save": lambda t: parallel_dcp.save(_state(), t / "out", workers=2, executor="processes"),
    "safetensors to DCP": lambda t: parallel_dcp.convert(_safetensors(t), t / "out", workers=2),
    "DCP to DCP": lambda t: parallel_dcp.convert(_dcp(t), t / "out", workers=2),
    "DCP to safetensors": lambda t: parallel_dcp.convert(_dcp(t), t / "out.safetensors", workers=2),
    "FP8 dequantize": lambda t: parallel_dcp.convert(_fp8(t / "fp8"), t / "out", dequantize=True, workers=2),
    "verify": lambda t: parallel_dcp.verify(_dcp(t), workers=2),
}


def at_rest_after_a_second_run(kind: str, where: str | Path) -> tuple[int, int]:
    """Run ``kind`` twice in this process; what the tree added at rest when the second run's last
    pool closed, as the governor counts it, and how many workers it had."""
    governors: list[memory.MemoryGovernor] = []
    at_rest: list[tuple[int, int]] = []  # (tree's growth, workers) when the last pool closed
    settle, close = memory.MemoryGovernor.settle, pool.WorkerPool.close

    def settling(self: memory.MemoryGovernor, *args: Any, **kwargs: Any) -> None:
        governors.append(self)
        settle(self, *args, **kwargs)

    def closing(self: pool.WorkerPool) -> None:
        time.sleep(0.1)  # every reply is in: the workers are back waiting for a task
        # Exactly: between full reads the governor's reading is an upper bound (a mapped source
        # counted by its resident size in every worker that maps it: process_memory.ChargeReader).
        at_rest.append((governors[-1].read(self.pids, exact=True).added, len(self.pids)))
        close(self)

    where = Path(where)
    KINDS[kind](where)  # first in this process: its one-time imports are not the job's
    memory.MemoryGovernor.settle, pool.WorkerPool.close = settling, closing  # type: ignore[method-assign]
    try:
        (where / "again").mkdir()
        KINDS[kind](where / "again")
    finally:
        memory.MemoryGovernor.settle, pool.WorkerPool.close = settle, close  # type: ignore[method-assign]
    assert at_rest, "the job ran on worker processes"
    return at_rest[-1]


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_resting_worker_holds_no_more_than_it_is_planned(kind: str, tmp_path: Path) -> None:
    # In a fresh interpreter (tests/fresh_interpreter.py): in this long-lived one, inherited malloc
    # arenas add 2-4 MiB a worker (docs/guarantees.md, "The memory ceiling").
    added, workers = run_fresh("tests.test_worker_resting_memory", "at_rest_after_a_second_run", kind, str(tmp_path))
    planned = WORKER_MEMORY_BYTES / MiB
    print(f"{kind}: {added / MiB:.1f} MiB added at rest by {workers} worker(s), {planned:.0f} each planned")
    assert added <= workers * WORKER_MEMORY_BYTES, (added / MiB, workers)
