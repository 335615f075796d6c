"""Each worker receives only its own tasks' keys (issue 30: no step O(keys x workers)).

A Saver's workers (and save()'s kept workers) receive the job's shell once and each task's keys
with the task; forked workers inherit the job and build nothing per key of the whole job.
"""

from __future__ import annotations

import os
import pickle
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

import parallel_dcp
from parallel_dcp.engine import pool as pool_module
from parallel_dcp.formats.remote_memory_source import RemoteMemorySource, _layout
from parallel_dcp.jobs.targets import Job
from parallel_dcp.jobs.task_parts import JobParts, ValuedPart, load_part, part_job
from tests.conftest import assert_same, shards_by_task


def _state(keys: int) -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model": {f"layer{i}.w": torch.randn(8, 4) for i in range(keys)},
        "big": torch.randn(256, 1024),  # 1 MiB: split into chunks below
        "view": torch.randn(64, 96)[:, ::3],
        "optim": {"step": 3, "param_groups": [{"lr": 0.1, "params": list(range(keys))}]},
        "name": "run",
    }


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, Any]]:
    """Every message the coordinator sends a worker, by connection; a handler as the worker loads it."""
    sent: list[tuple[int, Any]] = []
    real = pool_module._send

    def spy(conn: Any, message: Any) -> None:
        if isinstance(message, pool_module._NewHandler):  # its bytes live only while the run does
            data = message.pickled.fetch()
            sent.append((id(conn), (len(data), pickle.loads(data))))
        elif isinstance(message, pool_module._PartAt):  # a task and its part, as where their bytes lie
            sent.append((id(conn), message.load()))
        else:
            sent.append((id(conn), message))
        real(conn, message)

    monkeypatch.setattr(pool_module, "_send", spy)
    return sent


def _metadata(path: Path) -> tuple[list[str], dict[str, Any], dict[Any, tuple[int, int, int]]]:
    """``.metadata``'s entries in order, planner data, and where each record lies (task, offset, length)."""
    with open(path / ".metadata", "rb") as file:
        metadata: Metadata = pickle.load(file)
    where = {}
    for index, info in (metadata.storage_data or {}).items():
        match = re.fullmatch(r"__(\d+)_\w+_0\.distcp", info.relative_path)
        assert match, info.relative_path
        where[index] = (int(match.group(1)), info.offset, info.length)
    return list(metadata.state_dict_metadata), metadata.planner_data, where


def test_each_saver_worker_receives_only_its_own_tasks_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small, large = _state(50), _state(2000)
    with parallel_dcp.Saver(workers=3) as saver:
        saver.save(small, tmp_path / "warm")  # the workers and their buffers, before counting
        sent = _spy(monkeypatch)
        saver.save(small, tmp_path / "s", chunk_size="256KiB")
        handlers_small = [m for _, m in sent if isinstance(m, tuple)]
        sent.clear()
        result = saver.save(large, tmp_path / "l", chunk_size="256KiB")
    handlers = [m for _, m in sent if isinstance(m, tuple)]
    assert len(handlers) == 3
    for _, handler in handlers:  # the shell: no key, no value, no path in the nesting
        assert handler.job.keys == () and handler.job.chunks == {}
        assert handler.job.source.entries == {} and handler.job.source.values == {}
        assert handler.job.source.mapping == {} and handler.job.source._layouts == {}
    # What every worker receives once does not grow with the keys (2,000 keys: ~100 KB before).
    assert abs(handlers[0][0] - handlers_small[0][0]) < 64
    parts = [m for _, m in sent if isinstance(m, pool_module._TaskPart)]
    assert len(parts) == result.tasks >= 3
    # Each task's part holds its own units and the columns of their source keys, nothing else.
    received: Counter[str] = Counter()
    for message in parts:
        units, part = message.task.keys, load_part(message.part)
        assert len(part.positions) == len(units)
        keys = {part.chunks[u].key if u in part.chunks else u for u in units}
        assert set(part.source.keys) | set(part.source.values) == keys
        assert set(part.source.mapping) == keys
        received.update(part.source.keys)
        received.update(list(part.source.values))
    chunked = {k for k, n in received.items() if n > 1}
    assert any(load_part(message.part).chunks for message in parts)  # "big" was split
    assert chunked <= {"big"}  # a split tensor's key goes with each task holding a chunk of it
    assert len(received) == result.keys  # every key sent, each once but for the split one
    # Each worker's loading of the shell is reported, outside its tasks' seconds.
    assert len(result.per_worker) == 3 and all(w.setup_seconds > 0 for w in result.per_worker)
    # The bytes and .metadata are what save() writes with forked workers.
    reference = parallel_dcp.save(large, tmp_path / "ref", workers=3, chunk_size="256KiB", executor="processes")
    assert result.tasks == reference.tasks
    assert shards_by_task(tmp_path / "l") == shards_by_task(tmp_path / "ref")
    assert _metadata(tmp_path / "l") == _metadata(tmp_path / "ref")
    assert_same(parallel_dcp.load(tmp_path / "l"), large)
    assert parallel_dcp.verify(tmp_path / "l").ok


def test_a_source_part_reads_as_the_whole_source_does() -> None:
    wide = torch.randn(64, 96)
    sd = {"a": torch.randn(4, 5), "b": {"c": wide[:, ::3], "d": wide[10:20]}, "n": 3, "t": torch.randn(6, 2).t()}
    source = RemoteMemorySource("x", state_dict=sd)
    shell = pickle.loads(pickle.dumps(source.shell()))
    assert shell.entries == {} and shell.values == {} and shell.mapping == {} and shell._flat == {}
    keys = ["b.c", "n", "t"]
    worker = shell.with_part(pickle.loads(pickle.dumps(source.part(keys))))
    assert list(worker.entries) == ["b.c", "t"] and worker.values == {"n": 3}
    assert worker.mapping == {"b.c": ("b", "c"), "n": ("n",), "t": ("t",)}
    for key in ("b.c", "t"):
        tensor = source._flat[key]
        assert worker.entries[key] == source.entries[key]
        assert worker._layouts[key] == _layout(
            tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size()
        )
    # the coordinator's source is untouched by its shell
    assert list(source.entries) == ["a", "b.c", "b.d", "t"] and source.values == {"n": 3}


def test_forked_workers_build_nothing_per_key_of_the_whole_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Forked workers inherit the job; each unit's place in it (.metadata order) is built before
    # the forks, not once per worker.
    log = tmp_path / "calls"
    coordinator = os.getpid()
    real = Job.positions

    def positions(self: Job) -> dict[str, int]:
        if os.getpid() != coordinator:
            with open(log, "a") as file:
                file.write("built\n" if not self._positions else "inherited\n")
        return real(self)

    monkeypatch.setattr(Job, "positions", positions)
    sd = {f"k{i}": torch.full((4,), float(i)) for i in range(3000)}
    result = parallel_dcp.save(sd, tmp_path / "ckpt", workers=2, executor="processes")
    assert result.workers == 2
    assert all(w.setup_seconds == 0 for w in result.per_worker)  # nothing to load: inherited
    calls = log.read_text().split()
    assert calls and set(calls) == {"inherited"}
    assert_same(parallel_dcp.load(tmp_path / "ckpt"), sd)


def test_parts_are_made_ahead_in_dispatch_order_and_again_for_a_retried_task() -> None:
    from parallel_dcp.engine.partition import Task

    sd = {f"k{i}": torch.full((3,), float(i)) for i in range(9)} | {"n": 5}
    source = RemoteMemorySource("x", state_dict=sd)
    job = Job(source, source.keys())
    tasks = [Task(i, tuple(source.keys()[3 * i : 3 * i + 3]), 36) for i in range(3)] + [Task(3, ("n",), 0)]
    parts = JobParts(job, source, tasks)
    first = parts(tasks[0])
    parts.ahead()  # the worker runs task 0: task 1's part is made meanwhile
    assert list(parts._made) == [1]
    assert parts(tasks[1]) == parts._make(tasks[1]) and parts._made == {}
    parts.ahead()
    parts.ahead()  # task 2, then the value-only task 3
    assert list(parts._made) == [2, 3]
    parts.ahead()  # nothing left to make
    assert parts(tasks[0]) == first  # a retried task gets its part again
    worker = part_job(pickle.loads(pickle.dumps(parts.shell)), parts(tasks[3]), tasks[3])
    assert worker.keys == ("n",) and worker.source.values == {"n": 5} and worker.source.entries == {}
    assert worker.positions() == {"n": 9}
    worker = part_job(pickle.loads(pickle.dumps(parts.shell)), parts(tasks[2]), tasks[2])
    assert worker.positions() == {"k6": 6, "k7": 7, "k8": 8}
    assert {k: v.tolist() for k, v in worker.read(worker.keys).items()} == {f"k{i}": [float(i)] * 3 for i in (6, 7, 8)}


def test_a_kept_part_with_values_is_not_pickled_again_and_sends_its_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from parallel_dcp.engine.partition import Task
    from parallel_dcp.jobs import task_parts

    tensors = {f"k{i}": torch.full((3,), float(i)) for i in range(6)}
    source = RemoteMemorySource("x", state_dict=tensors | {"step": 1, "lr": [0.1]})
    job = Job(source, source.keys())
    tasks = [Task(0, ("k0", "step", "k1", "k2"), 36), Task(1, ("k3", "k4", "k5", "lr"), 36)]
    kept: dict[int, Any] = {}
    first = [part_job(job, JobParts(job, source, tasks, kept)(t), t) for t in tasks]
    assert all(isinstance(kept[t.index], ValuedPart) for t in tasks)
    assert [w.source.values for w in first] == [{"step": 1}, {"lr": [0.1]}]
    pickled = dict(kept)

    # The next save of the layout: the same tensors, new values; the parts are not made again.
    made: list[int] = []
    real = task_parts.JobParts._part
    monkeypatch.setattr(task_parts.JobParts, "_part", lambda self, task: made.append(task.index) or real(self, task))
    later = RemoteMemorySource("x", state_dict=tensors | {"step": 2, "lr": [0.05]})
    job = Job(later, later.keys())
    parts = JobParts(job, later, tasks, kept)
    second = [part_job(job, parts(t), t) for t in tasks]
    assert made == [] and all(kept[t.index] is pickled[t.index] for t in tasks)
    assert [w.source.values for w in second] == [{"step": 2}, {"lr": [0.05]}]
    assert [list(w.source.values) + list(w.source.entries) for w in second] == [
        ["step", "k0", "k1", "k2"],
        ["lr", "k3", "k4", "k5"],
    ]
    read = second[0].read(second[0].keys)
    assert read["step"] == 2 and {k: v.tolist() for k, v in read.items() if k != "step"} == {
        "k0": [0.0] * 3,
        "k1": [1.0] * 3,
        "k2": [2.0] * 3,
    }
