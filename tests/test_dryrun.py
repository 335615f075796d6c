"""Dry runs: the plan a real run executes, nothing written, and a predicted peak near the measured one."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch

import parallel_dcp
from parallel_dcp import DryRunPlan, MemoryLimitExceeded
from parallel_dcp.cli import main
from parallel_dcp.storage import writers
from tests.memory_probe import PeakSampler
from tests.test_convert import write_hf_safetensors
from tests.test_rename import snapshot

MiB = 2**20
# docs/performance.md quotes the errors this test measures (run with -s to see them).
TOLERANCE = 0.25
# Over-predicting is the safe side (the plan reserves more than the run holds). Whether both
# workers' largest moments meet in a run is timing: the sharded conversion measured 127-131 MiB
# alone on a quiet machine (prediction 148.1: +13%) but 106-118 MiB in all 16 runs of a full
# suite (+26%), where the other test process shares the 2 cores. Runs go on while the error is over
# TOLERANCE; one is accepted up to OVER_TOLERANCE over. (Round eleven: with workers' reads given
# back at once (engine/malloc.py) it measured 98-111 MiB loaded against 143.1 predicted, +41% in 2
# of 4 runs: the plan counted four 8 MiB direct-write buffers for each ~13 MiB shard, which fills
# two. Counted so, 127.1 predicted against 100-120 measured.)
OVER_TOLERANCE = 0.40


def llm_state(layers: int = 4, d: int = 512) -> dict[str, Any]:
    """An LLM training state: bf16 weights (some fused, stored as transposed views, as tied or
    fused layers give), fp32 Adam moments, plain values."""
    g = torch.Generator().manual_seed(0)
    model: dict[str, torch.Tensor] = {"tok_embeddings.weight": torch.randn(8192, d, generator=g).bfloat16()}
    optim: dict[str, Any] = {}
    for i in range(layers):
        model[f"layers.{i}.attention.wqkv.weight"] = torch.randn(d, 3 * d, generator=g).t()  # a view
        model[f"layers.{i}.feed_forward.w13.weight"] = torch.randn(d, 8 * d, generator=g).t()  # a view
        model[f"layers.{i}.feed_forward.w2.weight"] = torch.randn(d, 4 * d, generator=g).bfloat16()
        model[f"layers.{i}.attention_norm.weight"] = torch.ones(d)
    for name, weight in model.items():
        optim[name] = {"exp_avg": torch.zeros(weight.shape), "exp_avg_sq": torch.zeros(weight.shape), "step": 10}
    return {"model": model, "optimizer": {"state": optim, "lr": 3e-4}, "step": 10}


# The prediction is what both workers hold when their largest moments coincide; whether they
# coincide in one run is timing: on a loaded machine 8 runs of the sharded conversion measured
# 72-146 MiB against 130 MiB quiet (5 runs missed it once in a full-suite run: 27-58 MiB against
# 84 MiB alone). So runs go on until one lands within TOLERANCE, at most MAX_RUNS: a peak more
# than TOLERANCE above the prediction fails at once; the highest of MAX_RUNS is held to
# OVER_TOLERANCE.
MIN_RUNS, MAX_RUNS = 2, 10
# A reading of the tree (psutil's smaps of 3 torch processes) takes 30 ms quiet and 150 ms at a
# load of 8 on 2 cores: a peak is held longer than that.
HOLD = 0.25


@pytest.fixture(autouse=True)
def held_peaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every piece a shard writer emits takes 4 ms longer, a large record (8 MiB or more) and
    every shard file are held HOLD once written, the file before it is closed (workers inherit
    all this by fork).

    On a quiet machine a task writes a 30 MiB record from the page cache in a few milliseconds,
    so its peak (the record's buffers, held until the record is written) can come and go between
    two readings of the 2 ms sampler; slowed down, the same buffers are held long enough to be
    seen. A task holds the most while a large record is out (a strided view's copy) or just
    before its file closes (its items, and every aligned buffer of a direct write): held there,
    two workers' peaks overlap in most runs instead of by chance.
    What the tasks hold is unchanged, only for how long.
    """
    emit = writers._RecordingStream._emit
    create = writers._LocalRecording.create_stream

    def slow_emit(self: Any, view: memoryview) -> None:
        time.sleep(0.004)
        emit(self, view)
        if view.nbytes >= 8 * MiB:  # a large record (a strided view's copy) is held a while once written
            time.sleep(HOLD)

    @contextlib.contextmanager
    def held_create(self: Any, path: Any, mode: str) -> Iterator[Any]:
        with create(self, path, mode) as stream:
            yield stream
            time.sleep(HOLD)

    monkeypatch.setattr(writers._RecordingStream, "_emit", slow_emit)
    monkeypatch.setattr(writers._LocalRecording, "create_stream", held_create)


def _measure(plan: Callable[[], Any], real: Callable[[], Any]) -> tuple[DryRunPlan, int, float]:
    """The prediction against the peak of the real run, as the independent sampler measures it
    (the highest of several runs: a sampler reads the tree every 2 ms and can still miss a peak)."""
    predicted = plan()
    assert isinstance(predicted, DryRunPlan)
    peaks: list[int] = []
    for _ in range(3 * MAX_RUNS):
        if len(peaks) >= MAX_RUNS:
            break
        with PeakSampler() as sampler:
            result = real()
        assert isinstance(result, parallel_dcp.SaveResult) and result.tasks == predicted.tasks
        if sampler.readings == 0:
            continue  # (no reading of the tree while the job ran, a loaded machine's: no measurement; was 0 MiB)
        peaks.append(sampler.peak)
        peak = max(peaks)
        error = (predicted.predicted_peak_memory - peak) / peak
        if error < -TOLERANCE or (len(peaks) >= MIN_RUNS and error <= TOLERANCE):
            break
    assert peaks, f"the sampler read the tree in none of {3 * MAX_RUNS} runs"
    print(
        f"\n{predicted.source} -> {predicted.path}: predicted {predicted.predicted_peak_memory / MiB:.1f} MiB, "
        f"measured {peak / MiB:.1f} MiB (runs: {', '.join(f'{p / MiB:.1f}' for p in peaks)}), error {error:+.0%} "
        f"(limit {predicted.memory_limit / MiB:.0f} MiB, "
        f"{predicted.tasks} tasks, {predicted.workers} workers)"
    )
    return predicted, peak, error


def test_llm_like_save(tmp_path: Path) -> None:
    sd = llm_state()
    # attention weights kept as q/k/v column slices of one fused parameter: strided views that
    # DCP's writer copies one at a time (the save's memory beyond its workers' fixed cost)
    g = torch.Generator().manual_seed(1)
    for i in range(2):
        fused = torch.randn(4096, 3 * 2048, generator=g)  # 96 MiB
        for j, name in enumerate("qkv"):
            sd["model"][f"layers.{i}.attention.w{name}.weight"] = fused[:, j * 2048 : (j + 1) * 2048]
    kwargs: dict[str, Any] = {"workers": 2, "executor": "processes", "sync_files": False, "overwrite": True}
    plan, _, error = _measure(
        lambda: parallel_dcp.save(sd, tmp_path / "ckpt", dry_run=True, **kwargs),
        lambda: parallel_dcp.save(sd, tmp_path / "ckpt", **kwargs),
    )
    assert -TOLERANCE <= error <= OVER_TOLERANCE
    assert plan.executor == "processes" and plan.workers == 2 and plan.format == "dcp"


def test_sharded_safetensors_to_dcp_under_a_limit(tmp_path: Path) -> None:
    # large enough (224 MiB) that tasks last long enough for the sampler to see them overlap
    tensors = {k: v.contiguous() for k, v in llm_state(layers=4, d=1024)["model"].items()}
    write_hf_safetensors(tensors, tmp_path / "hf", shards=4)
    kwargs: dict[str, Any] = {"workers": 2, "memory_limit": "160MiB", "sync_files": False, "overwrite": True}
    plan, _, error = _measure(
        lambda: parallel_dcp.convert(tmp_path / "hf", tmp_path / "dcp", dry_run=True, **kwargs),
        lambda: parallel_dcp.convert(tmp_path / "hf", tmp_path / "dcp", **kwargs),
    )
    assert -TOLERANCE <= error <= OVER_TOLERANCE
    assert plan.predicted_peak_memory <= plan.memory_limit == 160 * MiB
    assert plan.chunks, "under this limit the largest tensors are split into chunks"


def test_dcp_to_a_single_file(tmp_path: Path) -> None:
    parallel_dcp.save(llm_state(layers=3), tmp_path / "dcp", workers=2)
    kwargs: dict[str, Any] = {"workers": 2, "keys": "model.*", "sync_files": False, "overwrite": True}
    plan, _, error = _measure(
        lambda: parallel_dcp.convert(tmp_path / "dcp", tmp_path / "model.pt", dry_run=True, **kwargs),
        lambda: parallel_dcp.convert(tmp_path / "dcp", tmp_path / "model.pt", **kwargs),
    )
    assert -TOLERANCE <= error <= OVER_TOLERANCE
    assert plan.tasks == 1 and plan.files[0]["name"] == "model.pt"


def test_dry_run_writes_nothing_and_plans_what_the_run_does(tmp_path: Path) -> None:
    tensors = {f"model.layers.{i}.weight": torch.randn(256, 512) for i in range(12)}
    write_hf_safetensors(tensors, tmp_path / "hf", shards=2)
    (tmp_path / "out").mkdir()
    before = snapshot(tmp_path)
    stat_before = os.stat(tmp_path / "out").st_mtime_ns
    plan = parallel_dcp.convert(
        tmp_path / "hf",
        tmp_path / "out" / "st",
        to="safetensors",
        shard_size=2 * MiB,
        dtype="bf16",
        rename=[(r"model\.(.*)", r"m.\1")],
        workers=2,
        dry_run=True,
    )
    assert snapshot(tmp_path) == before and os.stat(tmp_path / "out").st_mtime_ns == stat_before
    assert isinstance(plan, DryRunPlan)
    assert plan.bytes == sum(t.nbytes for t in tensors.values()) // 2  # bf16
    assert plan.space_needed >= plan.bytes and plan.space_free is not None and plan.space_free > 0
    planned = {f["name"]: f["keys"] for f in plan.files}
    assert sum(w["tasks"] for w in plan.per_worker) == plan.tasks == len(plan.files)

    result = parallel_dcp.convert(
        tmp_path / "hf",
        tmp_path / "out" / "st",
        to="safetensors",
        shard_size=2 * MiB,
        dtype="bf16",
        rename=[(r"model\.(.*)", r"m.\1")],
        workers=2,
    )
    assert isinstance(result, parallel_dcp.SaveResult) and result.bytes == plan.bytes and result.tasks == plan.tasks
    assert not plan.notes
    index = json.loads((tmp_path / "out" / "st" / "model.safetensors.index.json").read_text())["weight_map"]
    written: dict[str, list[str]] = {}
    for key, name in index.items():
        written.setdefault(name, []).append(key)
    assert {n: sorted(k) for n, k in written.items()} == {n: sorted(k) for n, k in planned.items()}


def test_dry_run_notes_an_existing_output(tmp_path: Path) -> None:
    st.save_file({"w": torch.zeros(8)}, tmp_path / "m.safetensors")
    parallel_dcp.convert(tmp_path / "m.safetensors", tmp_path / "dcp")
    plan = parallel_dcp.convert(tmp_path / "m.safetensors", tmp_path / "dcp", dry_run=True)
    assert isinstance(plan, DryRunPlan) and "without overwrite" in plan.notes[0]
    plan = parallel_dcp.convert(tmp_path / "m.safetensors", tmp_path / "dcp", dry_run=True, overwrite=True)
    assert isinstance(plan, DryRunPlan) and "replaces it" in plan.notes[0]


def test_dry_run_refuses_what_the_run_would_refuse(tmp_path: Path) -> None:
    st.save_file({"w": torch.zeros(4096, 1024)}, tmp_path / "m.safetensors")  # 16 MiB
    with pytest.raises(MemoryLimitExceeded):
        parallel_dcp.convert(tmp_path / "m.safetensors", tmp_path / "o.pt", memory_limit="12MiB", dry_run=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_cli_dry_run_json_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command run in this process (main(argv), what ``python -m parallel_dcp`` runs)."""
    st.save_file({f"l.{i}": torch.randn(64, 64) for i in range(8)}, tmp_path / "m.safetensors")
    before = snapshot(tmp_path)
    cli = ["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "dcp")]
    code = main([*cli, "--dry-run", "--json", "--workers", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    [plan] = json.loads(out)
    assert plan["dry_run"] and plan["keys"] == 8 and plan["format"] == "dcp"
    assert plan["predicted_peak_memory"] <= plan["memory_limit"] and plan["space_needed"] >= 8 * 64 * 64 * 4
    assert sum(len(f["keys"]) for f in plan["files"]) == 8
    code = main([*cli, "--dry-run"])
    text = capsys.readouterr().out
    assert code == 0 and "predicted peak memory" in text and "nothing was written" in text
    assert snapshot(tmp_path) == before


def _anonymous() -> int:
    """This process's RssAnon + RssShmem, bytes."""
    found = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return sum(int(found[name].split()[0]) * 1024 for name in ("RssAnon", "RssShmem"))


def test_a_one_worker_plan_leaves_room_for_the_coordinators_own_growth(tmp_path: Path) -> None:
    """At one worker nothing in the plan covered what the coordinator itself grows by while its
    worker runs (the pool's pipes and threads, the watchdog, the results: 1.7-2.9 MiB of RssAnon),
    and the sampled peak rose over the dry run's prediction (s11 review, F6). The prediction with a
    worker process is now, beside what the same plan predicts on threads (its tasks) and the
    worker's resting cost, at least what this process grew by during the real run, sampled every
    millisecond; and admission plans the same room (the run fits the limit the dry run fits)."""
    from parallel_dcp.engine.memory import WORKER_MEMORY_BYTES

    sd = {f"layer.{i}.w": torch.randn(1024, 512) for i in range(16)}  # 32 MiB
    kwargs: dict[str, Any] = {"workers": 1, "sync_files": False, "overwrite": True, "memory_limit": "48MiB"}
    parallel_dcp.save(sd, tmp_path / "warm", executor="processes", **kwargs)  # the job modules, loaded once
    base, peak, stop = _anonymous(), [0], [False]

    def sample() -> None:
        while not stop[0]:
            peak[0] = max(peak[0], _anonymous())
            time.sleep(0.001)

    import threading

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        parallel_dcp.save(sd, tmp_path / "ckpt", executor="processes", **kwargs)
    finally:
        stop[0] = True
        sampler.join()
    grew = peak[0] - base
    on_workers = parallel_dcp.save(sd, tmp_path / "ckpt", executor="processes", dry_run=True, **kwargs)
    on_threads = parallel_dcp.save(sd, tmp_path / "ckpt", executor="threads", dry_run=True, **kwargs)
    assert isinstance(on_workers, DryRunPlan) and isinstance(on_threads, DryRunPlan)
    assert on_workers.workers == on_threads.workers == 1 and on_workers.tasks == on_threads.tasks
    beside = on_workers.predicted_peak_memory - on_threads.predicted_peak_memory - WORKER_MEMORY_BYTES
    assert grew > 0 and beside >= grew, f"the coordinator grew {grew / MiB:.1f} MiB, {beside / MiB:.1f} planned"
    assert on_workers.predicted_peak_memory <= on_workers.memory_limit
