"""Writer threads and worker processes: which one a job gets, and that threads fail cleanly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch

import parallel_dcp
from parallel_dcp import RemoteTraceback, WorkerError
from parallel_dcp.formats import open_source
from parallel_dcp.formats.memory_format import MemorySource
from parallel_dcp.jobs.pipeline import choose_executor
from parallel_dcp.jobs.targets import Job
from parallel_dcp.options import Options
from tests.conftest import assert_same, empty_like_state
from tests.faults import RaiseInWorker
from tests.memory_probe import PeakSampler

MiB = 2**20


def job_of(state_dict: dict[str, Any]) -> Job:
    source = MemorySource("x", state_dict=state_dict)
    return Job(source, tuple([*source.entries, *source.values]))


LARGE = {"a": torch.zeros(1024, 512), "b": torch.zeros(2048, 256), "step": 3, "cfg": {"lr": 0.1}}
SMALL = {f"s{i}": torch.zeros(8) for i in range(100)}

CHOICES = [
    pytest.param(LARGE, {}, "threads", id="large-tensors"),
    pytest.param(SMALL, {}, "processes", id="many-small"),
    pytest.param(LARGE, {"retries": 1}, "processes", id="retries-need-processes"),
    pytest.param(LARGE, {"task_timeout": 5.0}, "processes", id="timeouts-need-processes"),
    pytest.param({**LARGE, "obj": RaiseInWorker()}, {}, "processes", id="user-objects-stay-out"),
    pytest.param(SMALL, {"executor": "threads"}, "threads", id="explicit-threads"),
    pytest.param(LARGE, {"executor": "processes"}, "processes", id="explicit-processes"),
]


@pytest.mark.parametrize(("state_dict", "options", "expected"), CHOICES)
def test_auto_picks_threads_only_for_large_plain_in_memory_state(
    state_dict: dict[str, Any], options: dict[str, Any], expected: str
) -> None:
    assert choose_executor(job_of(state_dict), Options(**options)) == expected


def test_sources_on_disk_always_use_processes(tmp_path: Path) -> None:
    st.save_file({"w": torch.zeros(1024, 1024)}, tmp_path / "m.safetensors")
    source = open_source(tmp_path / "m.safetensors")
    assert choose_executor(Job(source, ("w",)), Options()) == "processes"


def test_an_unknown_executor_is_refused() -> None:
    with pytest.raises(ValueError, match="executor must be"):
        Options(executor="gpu")


def test_a_failing_thread_reports_its_traceback_and_commits_nothing(tmp_path: Path) -> None:
    state = {"w": torch.randn(512, 512), "bad": RaiseInWorker()}
    with pytest.raises(WorkerError, match=r"writer thread \d raised .*injected failure") as info:
        parallel_dcp.save(state, tmp_path / "ckpt", workers=2, executor="threads")
    assert "bad" in str(info.value) and isinstance(info.value.__cause__, RemoteTraceback)
    assert "__reduce__" in str(info.value.__cause__)
    assert list(tmp_path.iterdir()) == []


def test_threads_write_large_state_that_stock_dcp_reads(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"model": {"embed": torch.randn(2048, 256), "head": torch.randn(512, 1024)}, "step": 9}
    result = parallel_dcp.save(state, tmp_path / "ckpt", workers=2)
    assert result.executor == "threads" and result.tasks >= 2
    target = empty_like_state(state)
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert_same(target["model"], state["model"])
    assert parallel_dcp.verify(tmp_path / "ckpt").ok


@pytest.mark.parametrize("executor", ["processes", "threads"])
def test_view_copies_stay_under_the_limit_with_either_executor(executor: str, tmp_path: Path) -> None:
    base = torch.randn(48, 2048, 1024)
    state = {f"view{i}": base[i, :, ::2] for i in range(48)}  # 4 MiB each, copied before writing
    limit = 64 * MiB
    with PeakSampler() as sampler:
        result = parallel_dcp.save(state, tmp_path / "ckpt", workers=2, memory_limit=limit, executor=executor)
    assert result.executor == executor
    assert sampler.peak < limit, f"tree added {sampler.peak / MiB:.1f} MiB, limit {limit / MiB:.0f} MiB"
