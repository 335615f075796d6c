"""Every job whose workers run under a memory limit plans the coordinator's own growth.

While its workers run, the coordinator grows too (the pool's pipes and threads, the watchdog, the
workers' results: 1.7-2.9 MiB measured, engine.memory.COORDINATOR_RUN_BYTES), and the limit counts
it. Saves and conversions set it aside before planning; verify, diff and load with workers did not,
so their plans could fill the limit to the byte with the workers alone, and the watchdog then found
the coordinator's growth over it. Each row runs a job and reads what its plan had set aside when its
workers started.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import parallel_dcp
from parallel_dcp.engine.memory import COORDINATOR_RUN_BYTES
from parallel_dcp.engine.pool import WorkerPool

LIMIT = "256MiB"
JOBS: list[Any] = [
    pytest.param(
        lambda c, t: parallel_dcp.save({"w": torch.ones(64)}, t / "out", workers=2, memory_limit=LIMIT), id="save"
    ),
    pytest.param(
        lambda c, t: parallel_dcp.convert(c, t / "out.safetensors", workers=2, memory_limit=LIMIT), id="convert"
    ),
    pytest.param(lambda c, t: parallel_dcp.verify(c, workers=2, memory_limit=LIMIT), id="verify"),
    pytest.param(lambda c, t: parallel_dcp.verify(c, against=c, workers=2, memory_limit=LIMIT), id="verify-against"),
    pytest.param(lambda c, t: parallel_dcp.diff(c, c, workers=2, memory_limit=LIMIT), id="diff"),
    pytest.param(lambda c, t: parallel_dcp.load(c, workers=2, memory_limit=LIMIT, retries=1), id="load-workers"),
]


@pytest.mark.parametrize("job", JOBS)
def test_the_coordinators_growth_is_set_aside_before_the_workers_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, job: Callable[[Path, Path], Any]
) -> None:
    ckpt = tmp_path / "ckpt"
    parallel_dcp.save({f"w{i}": torch.randn(256, 64) for i in range(4)}, ckpt, workers=2)
    held: list[tuple[int, int]] = []
    run = WorkerPool.run

    def watched(self: WorkerPool, tasks: Any, **kwargs: Any) -> Any:
        governor = kwargs.get("governor")
        assert governor is not None, "workers ran with no memory governor"
        held.append((governor.coordinator, governor.reserved))
        return run(self, tasks, **kwargs)

    monkeypatch.setattr(WorkerPool, "run", watched)
    job(ckpt, tmp_path)
    assert held, "no workers ran"
    assert all(coordinator == COORDINATOR_RUN_BYTES <= reserved for coordinator, reserved in held), held
