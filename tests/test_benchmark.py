"""``parallel-dcp bench`` end to end on tiny sizes, and its arithmetic on made-up samples.

No timing is asserted: the machine is shared and noisy. What is checked is that every suite runs,
that the outputs (table, strict JSON, PNG) are complete and consistent, that the ratios are the
ratios of the medians, and that nothing is left behind on the target.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from parallel_dcp import benchmark
from parallel_dcp.benchmark import pieces
from parallel_dcp.benchmark.config import BenchConfig, Target
from parallel_dcp.benchmark.governor_cost import GOVERNOR_COUNTS
from parallel_dcp.benchmark.measure import Case, Measured, PeakMemory
from parallel_dcp.benchmark.report import document, scenario_lines
from parallel_dcp.benchmark.results import Scenario, row_figures, summary
from tests.cli_in_process import run_in_process

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["--gib", "0.01", "--small", "200", "--reps", "1", "--warmup", "0", "--workers", "1", "2"]
SAVE_ROWS = {
    "parallel_dcp w=1",
    "parallel_dcp w=2",
    "stock dcp t=1",
    "stock dcp t=2",
    "stock dcp t=1 crc-off",
    "stock dcp t=2 crc-off",
    "torch.save",
    "safetensors",
    "plain write x1",
    "plain write x2",
    "memcpy (RAM)",
}
CONVERT_ROWS = {
    "st->dcp parallel_dcp w=1",
    "st->dcp parallel_dcp w=2",
    "st->dcp stock",
    "pt->dcp parallel_dcp w=1",
    "pt->dcp parallel_dcp w=2",
    "pt->dcp stock",
    "plain write x1",
    "plain write x2",
    "memcpy (RAM)",
}


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> None:
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def _bench(
    args: list[str], cwd: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> subprocess.CompletedProcess[str]:
    """``parallel-dcp bench ARGS`` run from ``cwd`` in the test's own process, as ``python -m
    parallel_dcp`` runs it (cli_in_process): a fresh interpreter importing torch, the writers and
    the report costs 4-17 s a suite on this VM, more than the suite's rows at these sizes. Its
    memory sampler reads this process's tree, above each row's own start, as it reads the bench's.
    The program itself runs in test_bench_script_keeps_the_first_benchmarks_flags and
    test_a_bench_stopped_by_sigterm_leaves_no_checkpoint_behind."""
    monkeypatch.chdir(cwd)
    return run_in_process(capsys, "bench", *args, check_code=None)


def test_bench_runs_every_suite_and_writes_table_json_and_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    target, results = tmp_path / "target", tmp_path / "results"
    target.mkdir()
    results.mkdir()
    run = _bench(
        [
            *TINY,
            *("--suite", "save", "small", "convert", "lopsided", "--targets", "disk", "--disk-dir", str(target)),
            *("--json", str(results / "bench.json"), "--plot", str(results / "bench.png")),
        ],
        tmp_path,
        capsys,
        monkeypatch,
    )
    assert run.returncode == 0, run.stderr
    out = run.stdout
    for line in ("GiB/s", "median s", "cpu s", "peak +MiB", "vs stock dcp t=2 (defaults)", "vs best stock"):
        assert line in out
    assert "many-small: parallel_dcp w=2" in out and "safetensors->DCP: parallel_dcp w=2 vs stock path" in out
    assert "thread-local in torch 2.13" in out

    data = _strict_json((results / "bench.json").read_text())
    assert data["ok"] is True
    assert {"cores", "ram_bytes", "torch", "date"} <= data["machine"].keys()
    scenarios = {s["key"]: s for s in data["scenarios"]}
    assert set(scenarios) == {
        "save/disk/sync-on",
        "small/disk/sync-on",
        "convert/disk/sync-on",
        "lopsided/disk/sync-on",
    }
    lopsided = scenarios["lopsided/disk/sync-on"]
    assert {"parallel_dcp w=1", "parallel_dcp w=2", "parallel_dcp w=2 unsplit"} <= lopsided["rows"].keys()
    assert lopsided["summary"]["speedup_vs_one_worker"] > 0 and "lopsided: parallel_dcp w=2 vs w=1" in out
    for key, expected in (("save/disk/sync-on", SAVE_ROWS), ("convert/disk/sync-on", CONVERT_ROWS)):
        rows = scenarios[key]["rows"]
        assert expected <= rows.keys()
        for name in expected:
            assert rows[name]["status"] == "ok", (name, rows[name]["error"])
            assert rows[name]["gib_per_s"] > 0 and rows[name]["cpu_s"] >= 0 and rows[name]["peak_added_bytes"] >= 0
    save = scenarios["save/disk/sync-on"]
    assert save["rows"]["parallel_dcp w=2"]["speedup"] > 0 and save["rows"]["parallel_dcp w=2"]["of_limit"] > 0
    assert save["summary"]["speedup_vs_stock_same_count"] > 0 and save["summary"]["best_stock"].startswith("stock")
    # The optional peers either ran or say why not.
    peers = {name: row for name, row in save["rows"].items() if row["family"] in ("nvrx", "megatron-core")}
    assert any(row["family"] == "megatron-core" for row in peers.values())
    for row in peers.values():
        assert row["status"] == "ok" or row["error"], row
    assert scenarios["convert/disk/sync-on"]["summary"]["st_speedup_vs_stock"] > 0

    assert (results / "bench.png").read_bytes()[:8] == PNG_MAGIC
    assert list(target.iterdir()) == [], "the benchmark removes what it wrote"


def test_bench_script_keeps_the_first_benchmarks_flags(tmp_path: Path) -> None:
    """``bench/bench_save.py --gib --reps --dir --json`` (the README's commands) still work."""
    result_file = tmp_path / "bench.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_save.py"),
            *("--gib", "0.01", "--reps", "1", "--warmup", "0", "--workers", "2", "--no-peers"),
            *("--sync", "off", "--dir", str(tmp_path), "--json", str(result_file)),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr
    assert "parallel_dcp w=2 vs stock dcp t=2 (defaults)" in run.stdout
    (scenario,) = _strict_json(result_file.read_text())["scenarios"]
    assert scenario["key"] == f"save/{tmp_path}/sync-off"
    assert {"parallel_dcp w=2", "stock dcp t=2", "plain write x2"} <= scenario["rows"].keys()
    assert "torch.save" not in scenario["rows"], "--no-peers leaves out the other formats"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--reps", "0"], "--reps must be >= 1"),
        (["--workers", "0"], "--workers must be"),
        (["--targets", "/no/such/dir"], "neither shm, disk nor an existing directory"),
        (["--gib", "100000"], "lower --gib"),
        (["--suite", "small", "--small", "1"], "--small must be >= 2"),
    ],
)
def test_bad_flags_are_usage_errors_before_anything_runs(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _case(name: str, family: str, procs: int, baseline: str | None = None, limit: str | None = None) -> Case:
    return Case(name=name, family=family, procs=procs, run=lambda out: None, baseline=baseline, limit=limit)


def _measured(case: Case, walls: list[float], peak: int = 0, error: str | None = None) -> Measured:
    return Measured(case=case, walls=walls, cpus=[w * 2 for w in walls], peaks=[peak] * len(walls), error=error)


def _scenario() -> Scenario:
    ours = _case("parallel_dcp w=2", "parallel_dcp", 2, "stock dcp t=2", "plain write x2")
    stock = _case("stock dcp t=2", "stock dcp", 2, limit="plain write x2")
    crc_off = _case("stock dcp t=2 crc-off", "stock dcp crc-off", 2, "stock dcp t=2", "plain write x2")
    plain = _case("plain write x2", "plain write", 2)
    broken = _case("nvrx w=2", "nvrx", 2, "stock dcp t=2", "plain write x2")
    scenario = Scenario(
        suite="save",
        target="shm",
        directory="/dev/shm",
        sync=True,
        state_dict="test",
        nbytes=2**30,
        tensors=3,
        reps=3,
        warmup=1,
        workers=[2],
    )
    scenario.measured = [
        _measured(ours, [1.0, 0.5, 9.0], peak=2**28),  # median 1.0 whatever the outlier
        _measured(stock, [4.0, 3.0, 5.0]),
        _measured(crc_off, [2.0, 2.0, 2.0]),
        _measured(plain, [0.5, 0.5, 0.25]),
        _measured(broken, [], error="RuntimeError: boom"),
    ]
    return scenario


def test_a_limit_row_that_measured_the_devices_own_seconds_counts_those() -> None:
    """fio's wall time adds its own start (0.3-0.5 s here): a limit row that reports the device's
    seconds (fio's job run time) is the limit by those, so no row looks faster than the device."""
    scenario = _scenario()
    plain = next(m for m in scenario.measured if m.case.name == "plain write x2")
    plain.details["device_s"] = 0.25
    rows = row_figures(scenario)
    assert rows["parallel_dcp w=2"]["of_limit"] == pytest.approx(0.25)
    from parallel_dcp.benchmark.disk_report import disk_summary

    rows = {
        "device direct write x2": {"median_s": 0.5, "details": {"device_s": 0.25}},
        "save w=2 io=auto": {"median_s": 1.0, "details": {}},
    }
    summary = disk_summary(rows, 2**30)
    assert summary["save_of_direct_limit"] == pytest.approx(0.25)


def test_ratios_are_taken_between_medians_of_the_same_scenario() -> None:
    scenario = _scenario()
    rows = row_figures(scenario)
    ours = rows["parallel_dcp w=2"]
    assert (ours["median_s"], ours["min_s"], ours["max_s"]) == (1.0, 0.5, 9.0)
    assert ours["gib_per_s"] == pytest.approx(1.0)
    assert ours["cpu_s"] == pytest.approx(2.0)
    assert ours["speedup"] == pytest.approx(4.0)  # stock median 4.0 over ours 1.0
    assert ours["of_limit"] == pytest.approx(0.5)  # plain median 0.5 over ours 1.0
    assert ours["peak_added_of_state_dict"] == pytest.approx(0.25)
    assert rows["stock dcp t=2 crc-off"]["speedup"] == pytest.approx(2.0)
    broken = rows["nvrx w=2"]
    assert broken["status"] == "failed" and broken["gib_per_s"] is None and broken["speedup"] is None

    s = summary(scenario, rows)
    assert s["speedup_vs_stock_same_count"] == pytest.approx(4.0)
    assert s["best_stock"] == "stock dcp t=2 crc-off"
    assert s["speedup_vs_best_stock"] == pytest.approx(2.0)
    assert s["time_vs_plain_write"] == pytest.approx(2.0)
    assert s["speedup_vs_nvrx_same_count"] is None

    text = "\n".join(scenario_lines(scenario))
    assert "nvrx w=2" in text and "failed: RuntimeError: boom" in text
    assert "vs stock dcp t=2 (defaults): 4.00x" in text


def test_json_document_is_strict_even_with_missing_figures() -> None:
    scenario = _scenario()
    scenario.measured[1].walls = [float("nan")] * 3  # an impossible sample must not make invalid JSON
    config = BenchConfig(
        suites=("save",),
        gib=0.01,
        small=2,
        workers=(2,),
        reps=3,
        warmup=1,
        targets=(Target("shm", "/dev/shm"),),
        syncs=(True,),
    )
    text = json.dumps(document(config, [scenario], ok=True), allow_nan=False)
    data = _strict_json(text)
    assert data["scenarios"][0]["rows"]["parallel_dcp w=2"]["speedup"] is None


def test_peak_memory_counts_what_a_forked_child_adds() -> None:
    """The sampler follows children: a child that fills 64 MiB of its own shows in the peak.

    The child holds its memory until the sampler has completed a reading that started after the
    memory was filled, so the test does not depend on how fast a loaded machine runs either side.
    """
    size = 64 * 2**20
    filled_r, filled_w = os.pipe()
    release_r, release_w = os.pipe()
    with PeakMemory() as memory:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child leaves by os._exit only
            try:
                block = b"\x01" * size  # every page written, so private to the child
                os.write(filled_w, b"1")
                os.read(release_r, 1)
                del block
            finally:
                os._exit(0)
        try:
            assert os.read(filled_r, 1) == b"1"
            memory.wait_for_reading()
        finally:
            os.write(release_w, b"1")
            os.waitpid(pid, 0)
            for fd in (filled_r, filled_w, release_r, release_w):
                os.close(fd)
    assert memory.added >= size // 2
    assert memory.cpu_seconds >= 0


def test_nvrx_peer_writes_a_stock_loadable_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async")
    from torch.distributed.checkpoint import load as dcp_load

    from parallel_dcp.benchmark import peers
    from parallel_dcp.synthetic import llm_like

    state_dict = llm_like(0.005)
    (case, *_rest) = peers.peer_cases(state_dict, [2], sync=True)
    assert case.name == "nvrx w=2" and case.unavailable is None
    try:
        case.run(str(tmp_path / "ckpt"))
    finally:
        peers.close()
    back = {k: torch.empty_like(v) for k, v in state_dict.items()}
    dcp_load(back, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert all(torch.equal(back[k], state_dict[k]) for k in state_dict)


# The suite opens eight Savers: on the module's kept fork server (conftest), not each on a server of
# its own (a fresh interpreter importing torch and the writers, 3-6 s here, and 1 s to stop). A
# Saver's own server start and stop are test_saver's; the suite's figures are only checked for
# being there and in range.
@pytest.mark.usefixtures("kept_fork_server")
def test_scaling_suite_projects_from_its_own_measurements(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from parallel_dcp.benchmark import suites

    # Its two measurements that fork a process per worker counted, 16 and 8 + 32 + 64 of them on
    # 2 cores (17 and 23 s of the suite's 80 s under load), at fewer: what each held worker adds
    # to a Saver's baseline from Savers of 1 and 3 workers (the probe test's count), the governor's
    # reading cost at 2, 4 and 8 children. The same code measures and reports any count; the
    # suite's own counts are checked as constants first.
    assert GOVERNOR_COUNTS == (8, 32, 64) and pieces.BASELINE_PROBE_WORKERS == 16
    monkeypatch.setattr(pieces, "BASELINE_PROBE_WORKERS", 3)
    monkeypatch.setattr(suites, "GOVERNOR_COUNTS", (2, 4, 8))
    monkeypatch.setattr(suites, "governor_cost", functools.partial(suites.governor_cost, counts=(2, 4, 8)))
    target = tmp_path / "target"
    target.mkdir()
    json_path = tmp_path / "bench.json"
    run = _bench(
        [*TINY, "--suite", "scaling", "--targets", str(target), "--json", str(json_path)],
        tmp_path,
        capsys,
        monkeypatch,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("PROJECTION (a model fed with this run's measurements, not a measurement)") == 2
    scenarios = {s["key"]: s for s in _strict_json(json_path.read_text())["scenarios"]}
    assert {s["suite"] for s in scenarios.values()} == {"scaling:llm", "scaling:small"}
    for scenario in scenarios.values():
        projection = scenario["projection"]
        rows = {row["workers"]: row for row in projection["rows"]}
        assert {1, 2, 8, 16, 32, 64, 128} <= rows.keys()
        assert rows[1]["measured_seconds"] > 0 and rows[2]["measured_seconds"] > 0
        assert rows[16]["measured_seconds"] is None  # projected only, never shown as measured
        assert projection["serial_seconds"] >= 0 and projection["parallel_worker_seconds"] > 0
        assert set(projection["phases"]["1"]) == {"plan", "fork", "write", "merge", "commit"}
        # Issue 30 item 6: every executor probed alone and beside a busy thread, its pieces in the JSON.
        assert (
            set(projection["probe"])
            == set(projection["executors"])
            == {
                "default",
                "threads",
                "processes",
                "saver",
                "saver_unchanged",
            }
        )
        assert projection["executors"]["saver"]["executor_used"] == "saver"
        assert projection["executors"]["saver_unchanged"]["executor_used"] == "saver"
        assert projection["executors"]["threads"]["executor_used"] == "threads"
        assert projection["executors"]["threads"]["gil_capped"] is True
        assert projection["executors"]["processes"]["gil_capped"] is False
        for name, e in projection["executors"].items():
            probe = projection["probe"][name]
            assert probe["alone_seconds"] > 0 and probe["worker_seconds"] > 0
            assert probe["busy_thread_seconds"] > 0 and probe["busy_process_seconds"] > 0
            assert "fork" in probe["phases"] and probe["phases"]["write"] > 0
            assert 0.0 <= e["gil_held_share"] <= 1.0
            for piece in ("serial_seconds_per_gib", "serial_us_per_key", "worker_seconds_per_gib"):
                assert e[piece] >= 0
            assert e["start_seconds_per_worker"] >= 0 and e["start_seconds_per_worker_per_gib"] >= 0
            assert {16, 64, 128} <= {row["workers"] for row in e["rows"]}
            assert all(row["projected_speedup"] > 0 for row in e["rows"])
        assert projection["executors"]["processes"]["serial_parts"]["worker_job_seconds"] == 0  # inherited
        assert projection["executors"]["saver"]["serial_parts"]["worker_job_seconds"] > 0
        saver = projection["probe"]["saver"]
        assert saver["saver_start_seconds"] > 0 and saver["first_save_start_seconds"] >= 0
        # The Saver's pieces as its code runs them: serial before the first task and after the
        # last result, the coordinator's work beside the workers', the workers' task handling.
        for name in ("saver", "saver_unchanged"):
            e = projection["executors"][name]
            assert e["coordinator_write_seconds"] > 0 and e["worker_handling_seconds"] > 0
            parts = e["serial_parts"]
            assert parts["before_first_task_seconds"] > 0 and parts["after_last_result_seconds"] > 0
        assert projection["executors"]["processes"]["coordinator_write_seconds"] == 0  # nothing sent ahead
    governor = scenarios["scaling:llm/" + str(target) + "/sync-on"]["projection"]["governor"]
    assert [row["workers"] for row in governor] == [2, 4, 8]  # as patched above
    assert all(row[f"{kind}_ms_per_process"] >= 0 for row in governor for kind in ("cheap", "rollup", "exact"))
    for label in ("default", "threads", "processes", "saver", "saver_unchanged"):
        assert run.stdout.count(f"projected {label}: x16 ") == 2
    assert run.stdout.count("governor reading at 8 workers") == 1
    for scenario in scenarios.values():
        held = scenario["projection"]["probe"]["saver"]["baseline_per_held_worker"]
        assert held["workers"] == [1, 3] and held["seconds_per_held_worker"] >= 0
    assert list(target.iterdir()) == []


def test_projection_model_arithmetic() -> None:
    from parallel_dcp.benchmark.scaling import Samples, project, projection_lines

    phases = {"plan": 0.1, "fork": 0.0, "write": 0.8, "merge": 0.05, "commit": 0.05}
    samples = Samples(runs={1: [(1.0, 0.8, 2**30, phases)] * 3, 2: [(0.7, 0.9, 2**30, phases)] * 3})
    plain = Measured(case=Case(name="plain write x2", family="plain write", procs=2, run=lambda out: None))
    plain.walls = [0.25]
    projection = project(samples, [plain], warmup=1, keys=1000)
    assert projection["serial_seconds"] == pytest.approx(0.2)  # T(1) - P(1)
    assert projection["serial_us_per_key"] == pytest.approx(200.0)
    rows = {row["workers"]: row for row in projection["rows"]}
    assert rows[2]["projected_seconds"] == pytest.approx(0.2 + 0.8 / 2)
    assert rows[16]["projected_speedup"] == pytest.approx(1.0 / (0.2 + 0.8 / 16))
    assert rows[16]["projected_capped_speedup"] == pytest.approx(1.0 / (0.2 + 0.25))  # storage-bound
    assert rows[2]["measured_speedup"] == pytest.approx(1.0 / 0.7) and rows[16]["measured_speedup"] is None
    lines = projection_lines(projection)
    assert "not a measurement" in lines[0] and any("S = 0.200 s serial" in line for line in lines)
    # Forking is serial and once per worker: 20 ms each (the fork phase over the worker count).
    forked = Samples(runs={w: [(1.0 if w == 1 else 0.7, 0.8, 2**30, phases | {"fork": 0.02})] * 3 for w in (1, 2)})
    rows = {row["workers"]: row for row in project(forked, [plain], warmup=1, keys=1000)["rows"]}
    assert rows[1]["projected_seconds"] == pytest.approx(1.0)
    # 16 workers, each starting 20 ms after the one before: W with sum(max(0, W - 0.02 i)) = 0.8.
    work = rows[16]["projected_seconds"] - 0.2
    assert sum(max(0.0, work - 0.02 * i) for i in range(16)) == pytest.approx(0.8, rel=1e-6)
    assert 0.8 / 16 < work < 0.8 / 16 + 15 * 0.02


def test_executor_projections_from_pieces() -> None:
    from parallel_dcp.benchmark.pieces import executor_lines, executor_projections

    def probe(used: str, alone: float, busy: float, work: float, fork: float) -> dict[str, Any]:
        phases = {"plan": 0.05, "fork": fork, "write": work, "merge": 0.0, "commit": 0.05}
        return {
            "executor_used": used,
            "alone_seconds": alone,
            "busy_thread_seconds": busy,
            "busy_process_seconds": alone + 0.05,  # the core alone costs 0.05 s
            "worker_seconds": work,
            "phases": phases,
        }

    found = executor_projections(
        {
            "default": probe("threads", 1.0, 1.25, 0.9, 0.0),
            "threads": probe("threads", 1.0, 1.55, 0.9, 0.0),
            "processes": probe("processes", 1.0, 1.1, 0.8, 0.05),
            "saver": probe("saver", 1.0, 1.1, 0.8, 0.001) | {"worker_job_seconds": 0.03},
            # The median of each run's wall - P, where the probe has it (not alone - worker seconds).
            "saver_unchanged": probe("saver", 1.0, 1.1, 0.8, 0.001) | {"serial_seconds": 0.15},
        },
        nbytes=2 * 2**30,
        keys=1000,
    )
    assert found["saver_unchanged"]["serial_seconds"] == pytest.approx(0.15)
    assert found["saver"]["serial_seconds"] == pytest.approx(0.2)
    threads = found["threads"]
    assert threads["gil_held_share"] == pytest.approx(0.5) and threads["gil_capped"]
    assert threads["serial_seconds_per_gib"] == pytest.approx(0.05) and threads["serial_us_per_key"] == pytest.approx(
        100
    )
    rows = {row["workers"]: row for row in threads["rows"]}
    # Half of the worker seconds hold the GIL: they never run side by side.
    assert rows[16]["projected_seconds"] == pytest.approx(0.1 + 0.45)
    default = {row["workers"]: row for row in found["default"]["rows"]}
    assert default[128]["projected_seconds"] == pytest.approx(0.1 + 0.2 * 0.9)  # resolved to threads: capped
    processes = found["processes"]
    assert processes["gil_held_share"] == pytest.approx(0.05)  # beyond the busy process's core
    assert not processes["gil_capped"] and processes["start_seconds_per_worker_per_gib"] == pytest.approx(0.025)
    work = {row["workers"]: row for row in processes["rows"]}[16]["projected_seconds"] - 0.2
    assert sum(max(0.0, work - 0.05 * i) for i in range(16)) == pytest.approx(0.8, rel=1e-6)
    # The Saver's serial seconds: its coordinator's phases, each worker's per-job part, the rest.
    parts = found["saver"]["serial_parts"]
    assert parts["coordinator_phases_seconds"] == pytest.approx(0.101)
    assert parts["worker_job_seconds"] == pytest.approx(0.03)
    assert parts["other_seconds"] == pytest.approx(0.2 - 0.101 - 0.03)
    saver = {row["workers"]: row for row in found["saver"]["rows"]}
    assert saver[64]["projected_speedup"] > {row["workers"]: row for row in processes["rows"]}[64]["projected_speedup"]
    lines = executor_lines(
        found,
        [
            {
                "workers": 8,
                "cheap_ms_per_process": 0.1,
                "moved_ms_per_process": 0.15,
                "moved_reads_per_reading": 1,
                "rollup_ms_per_process": 0.2,
                "exact_ms_per_process": 5.0,
            }
        ],
    )
    assert any(line.startswith("  projected threads: x16 1.82x") for line in lines)
    assert any("coordinator phases 0.101, per-job in each worker 0.030, other 0.069" in line for line in lines)
    assert any("governor reading at 8 workers: cheap 0.100, all moved 0.150 (1 rolled up)" in line for line in lines)


def _saver_probe() -> dict[str, Any]:
    """A Saver's probe of 1.1 s alone: 1.0 s in its tasks, 0.02 handling them, 0.03 of the
    coordinator's beside them, 0.08 serial (1.1 - 1.0 - 0.02)."""
    return {
        "executor_used": "saver",
        "alone_seconds": 1.1,
        "busy_thread_seconds": 1.2,
        "busy_process_seconds": 1.2,
        "worker_seconds": 1.0,
        "worker_handling_seconds": 0.02,
        "coordinator_write_seconds": 0.03,
        "serial_seconds": 0.08,
        "phases": {"plan": 0.04, "fork": 0.0, "write": 1.05, "merge": 0.0, "commit": 0.01},
    }


def test_the_projection_follows_the_savers_structure() -> None:
    # Serial before the first task and after the last result; the coordinator's work during the
    # write (C) beside the workers', whose handling of their tasks (H) is parallel work.
    from parallel_dcp.benchmark.pieces import executor_lines, executor_projections

    got = _saver_probe() | {"serial_before_seconds": 0.04, "serial_after_seconds": 0.01}
    saver = executor_projections({"saver": got}, nbytes=2**30, keys=1000)["saver"]
    rows = {row["workers"]: row for row in saver["rows"]}
    assert rows[1]["projected_seconds"] == pytest.approx(1.1)  # T(1): the measured wall
    assert rows[16]["projected_seconds"] == pytest.approx(0.08 + 1.02 / 16)  # W(16) > C
    assert rows[128]["projected_seconds"] == pytest.approx(0.08 + 0.03)  # C > W(128): the coordinator's pace
    parts = saver["serial_parts"]
    assert parts["before_first_task_seconds"] == pytest.approx(0.04)
    assert parts["after_last_result_seconds"] == pytest.approx(0.01)
    assert parts["write_rest_seconds"] == pytest.approx(0.03)
    assert saver["coordinator_write_us_per_key"] == pytest.approx(30.0)
    assert saver["worker_seconds"] == pytest.approx(1.02) and saver["worker_task_seconds"] == pytest.approx(1.0)
    lines = executor_lines({"saver": saver}, None)
    assert any("before the first task 0.040, write rest 0.030, after the last result 0.010" in line for line in lines)
    assert any("coordinator beside the workers 0.030 s (30.0 us/key)" in line for line in lines)


def test_the_projection_adds_the_coordinators_work_for_the_tasks_of_many_workers() -> None:
    # The probe's Saver save cut like 64 workers (64 tasks against its own 4) took 6 ms more
    # serial and 30 ms more beside the workers: 0.1 and 0.5 ms a task, added per task a save on
    # N workers has beyond 4 (partition.task_count: 64 at 16 and 64 workers, 128 at 128).
    from parallel_dcp.benchmark.pieces import executor_lines, executor_projections

    got = _saver_probe() | {
        "tasks": 4,
        "cut_like_many_workers": {
            "as_on_workers": 64,
            "tasks": 64,
            "serial_seconds": 0.086,
            "coordinator_write_seconds": 0.06,
        },
    }
    saver = executor_projections({"saver": got}, nbytes=2**30, keys=50_000)["saver"]
    assert saver["per_task"]["serial_seconds_per_task"] == pytest.approx(1e-4)
    assert saver["per_task"]["coordinator_seconds_per_task"] == pytest.approx(5e-4)
    rows = {row["workers"]: row for row in saver["rows"]}
    assert [rows[n]["tasks"] for n in (1, 2, 16, 64, 128)] == [4, 8, 64, 64, 128]
    assert rows[1]["projected_seconds"] == pytest.approx(1.1)  # its own tasks: nothing added
    assert rows[16]["projected_seconds"] == pytest.approx(0.086 + 1.02 / 16)  # W(16) still binds
    assert rows[64]["projected_seconds"] == pytest.approx(0.086 + 0.06)  # C(64) binds: 60 tasks more
    assert rows[128]["coordinator_write_seconds"] == pytest.approx(0.03 + 124 * 5e-4)
    assert rows[128]["projected_seconds"] == pytest.approx(0.08 + 124 * 1e-4 + 0.03 + 124 * 5e-4)
    lines = executor_lines({"saver": saver}, None)
    assert any("per task beyond its own 4 (cut into 64, as on 64 workers): serial 0.100 ms" in line for line in lines)
    # Set against the plain Saver's own save where the probe gives it (saver_unchanged checks less).
    unchanged = got | {"serial_seconds": 0.07, "coordinator_write_seconds": 0.01}
    unchanged["cut_like_many_workers"] = got["cut_like_many_workers"] | {
        "own_serial_seconds": 0.08,
        "own_coordinator_write_seconds": 0.03,
    }
    promised = executor_projections({"saver_unchanged": unchanged}, nbytes=2**30, keys=50_000)["saver_unchanged"]
    assert promised["per_task"]["coordinator_seconds_per_task"] == pytest.approx(5e-4)
    assert {r["workers"]: r for r in promised["rows"]}[64]["coordinator_write_seconds"] == pytest.approx(0.01 + 0.03)
    # Each worker a Saver holds adds to its baseline reading, serial in every save: 0.1 ms a worker held.
    held = got | {"baseline_per_held_worker": {"workers": [1, 8], "baseline_seconds": [0.001, 0.0017]}}
    held["baseline_per_held_worker"]["seconds_per_held_worker"] = 1e-4
    with_held = executor_projections({"saver": held}, nbytes=2**30, keys=50_000)["saver"]
    rows_held = {r["workers"]: r for r in with_held["rows"]}
    assert rows_held[1]["projected_seconds"] == pytest.approx(1.1)  # the probe's own one worker: nothing added
    assert rows_held[64]["serial_seconds"] == pytest.approx(rows[64]["serial_seconds"] + 63 * 1e-4)
    assert any("100 us a worker held" in line for line in executor_lines({"saver": with_held}, None))
    # Without the cut save (or with no more tasks in it), the projection is S + max(C, W(N)) as before.
    del got["cut_like_many_workers"]
    plain = {r["workers"]: r for r in executor_projections({"saver": got}, nbytes=2**30, keys=50_000)["saver"]["rows"]}
    assert plain[64]["projected_seconds"] == pytest.approx(0.08 + 0.03)


# Its two probes open eight Savers: on the module's kept fork server (conftest), not each on a server of its own.
@pytest.mark.usefixtures("kept_fork_server")
def test_a_probe_of_many_tensors_is_busy_on_a_subset_scaled_per_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from parallel_dcp.benchmark import pieces

    monkeypatch.setattr(pieces, "BUSY_PROBE_KEYS", 8)
    monkeypatch.setattr(pieces, "BASELINE_PROBE_WORKERS", 3)
    state = {"optimizer": {f"{i}": {"exp_avg": torch.randn(64 + i)} for i in range(20)}}
    probe = pieces.probe_executors(state, str(tmp_path), rounds=1, sync=False)
    held = probe["saver"]["baseline_per_held_worker"]  # a Saver's baseline with 1 and 3 workers held
    assert held["workers"] == [1, 3] and all(0 < s < 1 for s in held["baseline_seconds"])
    assert held["seconds_per_held_worker"] == max(0.0, held["baseline_seconds"][1] - held["baseline_seconds"][0]) / 2
    for kind in pieces.PROBED:
        got = probe[kind]
        sub = got["busy_probe"]
        assert (sub["keys"], sub["of_keys"]) == (8, 20)
        assert sub["scale"] == pytest.approx(got["alone_seconds"] / sub["alone_seconds"])
        assert got["busy_thread_seconds"] == pytest.approx(sub["busy_thread_seconds"] * sub["scale"])
        assert got["busy_process_seconds"] == pytest.approx(sub["busy_process_seconds"] * sub["scale"])
    # The Saver's save cut like many workers: one task a tensor here, against its own one.
    cut = probe["saver"]["cut_like_many_workers"]
    assert cut["as_on_workers"] == pieces.PER_TASK_PROBE_WORKERS and cut["tasks"] == 20 > probe["saver"]["tasks"]
    assert cut["own_coordinator_write_seconds"] == probe["saver"]["coordinator_write_seconds"]
    assert probe["saver_unchanged"]["cut_like_many_workers"] is cut
    executors = pieces.executor_projections(probe, nbytes=4096, keys=20)
    assert executors["threads"]["busy_probe"]["keys"] == 8
    assert executors["saver"]["per_task"]["tasks_cut"] == 20 and "per_task" not in executors["threads"]
    lines = pieces.executor_lines(executors, None)
    assert any(line.startswith("  threads: busy rows probed on 8 of 20 tensors") for line in lines)
    assert list(tmp_path.iterdir()) == []
    # A state dict of no more tensors than that is probed busy in full.
    small = pieces.probe_executors({"w": torch.ones(4)}, str(tmp_path), rounds=1, sync=False)
    assert all("busy_probe" not in small[kind] for kind in pieces.PROBED)


def test_staggered_work() -> None:
    from parallel_dcp.benchmark.scaling import staggered_work_seconds

    assert staggered_work_seconds(1.0, 4, 0.0) == pytest.approx(0.25)
    assert staggered_work_seconds(1.0, 1, 0.5) == pytest.approx(1.0)
    # Two workers, the second 0.4 s late: W + (W - 0.4) = 1.0
    assert staggered_work_seconds(1.0, 2, 0.4) == pytest.approx(0.7)
    # Forks so slow that later workers never start before the work is done.
    assert staggered_work_seconds(0.1, 8, 1.0) == pytest.approx(0.1)


def test_load_suites_compare_every_reader_on_both_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    target, results = tmp_path / "target", tmp_path / "results"
    target.mkdir()
    results.mkdir()
    run = _bench(
        [
            *TINY,
            *("--suite", "load", "load-small", "--targets", "disk", "--disk-dir", str(target)),
            *("--json", str(results / "bench.json"), "--plot", str(results / "bench.png")),
        ],
        tmp_path,
        capsys,
        monkeypatch,
    )
    assert run.returncode == 0, run.stderr
    assert "[stock] load into w=2 vs stock dcp.load" in run.stdout and "[pdcp] FastReader w=2" in run.stdout
    data = _strict_json((results / "bench.json").read_text())
    scenarios = {s["key"]: s for s in data["scenarios"]}
    assert set(scenarios) == {"load/disk/sync-on", "load-small/disk/sync-on"}
    for scenario in scenarios.values():
        rows = scenario["rows"]
        for source in ("stock", "pdcp"):
            names = [
                f"load w=2 [{source}]",
                f"load into w=2 [{source}]",
                f"FastReader w=2 [{source}]",
                f"stock dcp.load [{source}]",
                f"stock alloc load [{source}]",
                f"plain read x2 ready [{source}]",
                f"plain read x2 fresh [{source}]",
            ]
            for name in names:
                assert rows[name]["status"] == "ok", (name, rows[name]["error"])
                assert rows[name]["gib_per_s"] > 0
            for name in names[:3]:
                assert rows[name]["details"]["fallback"] == 0  # the fast path served every read
            assert scenario["summary"][source]["into_vs_stock"] > 0
            # the cost of one record (issue 32 item 4's figure): the into row's time over the records it read
            summary, into = scenario["summary"][source], rows[f"load into w=2 [{source}]"]
            assert summary["records"] == into["details"]["records"] > 0
            assert summary["into_us_per_record"] == pytest.approx(into["median_s"] / summary["records"] * 1e6)
    assert (results / "bench.png").read_bytes()[:8] == PNG_MAGIC
    assert list(target.iterdir()) == [], "the benchmark removes what it wrote"


def test_compress_suite_compares_levels_workers_and_stock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from parallel_dcp.benchmark import compression

    # The MiniLM scenario falls back, where the model's package is not installed (here), to a
    # synthetic float32 stand-in of the model's 90 MiB, whatever --gib says: every row (seven
    # saves, two checkpoints written for the loads, four loads) writes or reads all of it. The
    # rows, their ratios and the loads' figures are what is checked, not the size: 8 MiB.
    monkeypatch.setattr(compression, "_MINILM_BYTES", 8 * 2**20)
    target, results = tmp_path / "target", tmp_path / "results"
    target.mkdir()
    results.mkdir()
    run = _bench(
        [
            *TINY,
            *("--suite", "compress", "--targets", "disk", "--disk-dir", str(target)),
            "--json",
            str(results / "bench.json"),
        ],
        tmp_path,
        capsys,
        monkeypatch,
    )
    assert run.returncode == 0, run.stderr
    assert "compressed save zstd:3 w=2 vs stock zstd t=2" in run.stdout and "zstd:3 save w=2 vs w=1" in run.stdout
    data = _strict_json((results / "bench.json").read_text())
    scenarios = {s["key"]: s for s in data["scenarios"]}
    assert set(scenarios) == {"compress:minilm/disk/sync-on", "compress:llm/disk/sync-on"}
    for scenario in scenarios.values():
        rows = scenario["rows"]
        saves = [f"save zstd:{level} w={n}" for level in (1, 3, 9) for n in (1, 2)]
        for name in [*saves, "stock zstd t=2", "save plain w=2", "load zstd w=2 [pdcp]", "stock dcp.load zstd [stock]"]:
            assert rows[name]["status"] == "ok", (name, rows[name]["error"])
        for name in [*saves, "stock zstd t=2"]:  # every compressed save says what it stored
            assert 0 < rows[name]["details"]["stored_ratio"] < 1.0, name
        assert rows["save plain w=2"]["details"]["stored_ratio"] > 1.0  # records' headers beside the bytes
        assert rows["load zstd w=2 [pdcp]"]["details"]["decompressed_items"] > 0
        assert scenario["summary"]["save_vs_stock"] is not None


def test_read_suite_compares_every_reader_cold_on_both_copies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    target, results = tmp_path / "target", tmp_path / "results"
    target.mkdir()
    results.mkdir()
    run = _bench(
        [
            *TINY,
            *("--suite", "read", "--targets", "disk", "--disk-dir", str(target), "--json", str(results / "b.json")),
        ],
        tmp_path,
        capsys,
        monkeypatch,
    )
    assert run.returncode == 0, run.stderr
    assert "[hf] load w=2 (defaults) of the best plain read" in run.stdout
    scenario = _strict_json((results / "b.json").read_text())["scenarios"][0]
    assert scenario["key"] == "read/disk/sync-on"
    rows = scenario["rows"]
    for name in (
        "load w=2 [hf]",
        "load w=2 io=buffered [hf]",
        "stock load_file + touch [hf]",
        "plain read x2 direct [hf]",
        "plain read x2 buffered [hf]",
        "load w=2 [dcp]",
        "load w=2 io=buffered [dcp]",
        "stock dcp alloc load [dcp]",
        "plain read x2 direct [dcp]",
        "plain read x2 buffered [dcp]",
        # the loader's readers (4 per worker, one queue of 1 MiB requests): a plain read too
        "plain read 8x1M direct [hf]",
        "plain read 8x1M buffered [hf]",
        "plain read 8x1M direct [dcp]",
        "plain read 8x1M buffered [dcp]",
        "plain read 8x1M direct into fresh memory [hf]",  # beside them: what new tensors cost
        "plain read 8x1M direct into fresh memory [dcp]",
    ):
        assert rows[name]["status"] == "ok", (name, rows[name]["error"])
        assert rows[name]["gib_per_s"] > 0
    for tag in ("hf", "dcp"):  # the limit is named, and is one of the plain reads or fio's job time
        assert scenario["summary"][tag]["best_plain_read"].startswith(("plain read", "fio direct"))
        assert "fresh memory" not in scenario["summary"][tag]["best_plain_read"]
        assert scenario["summary"][tag]["share_of_fresh_plain_read"] > 0
    for name in ("load w=2 [hf]", "load w=2 [dcp]"):
        assert rows[name]["details"]["fallback"] == 0  # every tensor read straight from the files
        # how the files were read (io="auto": measured, or the rule where the files are too small)
        assert rows[name]["details"]["read_io"] in ("direct", "buffered")
    assert scenario["summary"]["hf"]["read_choice"].startswith("reads ")
    assert "[hf] load w=2 (defaults) reads " in run.stdout
    # the peers and fio: measured when installed, otherwise a row that says why
    for name in (
        "fastsafetensors direct t=16 [hf]",
        "fastsafetensors buffered t=16 [hf]",
        "Run:ai streamer (defaults) [hf]",
        "fio direct x2 [hf]",
    ):
        assert rows[name]["status"] in ("ok", "not run", "failed"), rows[name]
        if rows[name]["status"] == "not run":
            assert "not installed" in rows[name]["error"] or "not on PATH" in rows[name]["error"]
    summary = scenario["summary"]
    assert summary["hf"]["share_of_best_plain_read"] > 0 and summary["dcp"]["vs_stock_load_file"] > 0
    assert list(target.iterdir()) == [], "the benchmark removes what it wrote"


def test_disk_suite_reports_the_read_choice_for_both_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    target, results = tmp_path / "target", tmp_path / "results"
    target.mkdir()
    results.mkdir()
    run = _bench(
        [
            *TINY,
            *("--suite", "disk", "--targets", "disk", "--disk-dir", str(target)),
            *("--json", str(results / "bench.json")),
        ],
        tmp_path,
        capsys,
        monkeypatch,
    )
    assert run.returncode == 0, run.stderr
    assert "our checkpoint: io=auto read" in run.stdout and "stock-written checkpoint: io=auto read" in run.stdout
    (scenario,) = _strict_json((results / "bench.json").read_text())["scenarios"]
    rows = scenario["rows"]
    for label in ("", " (stock-written)"):
        for name in (
            f"load into w=2{label}",
            f"load into w=2 io=direct{label}",
            f"load into w=2 io=buffered{label}",
            f"FastReader w=2{label}",
            f"stock dcp.load{label}",
            f"plain read x2 direct{label}",
            f"plain read x2 buffered{label}",
        ):
            name = next(n for n in rows if n.startswith(name) and (label or "(stock-written)" not in n))
            assert rows[name]["status"] == "ok", (name, rows[name]["error"])
        auto = next(r for n, r in rows.items() if n.startswith(f"load into w=2{label}") and "io=" not in n)
        assert auto["details"]["read_io"] in ("direct", "buffered") and auto["details"]["read_reason"]
        reads = scenario["summary"]["reads"][label]
        assert reads["load_into_of_best_read"] > 0 and reads["load_into_vs_stock"] > 0
        assert reads["choice"]["read_io"] == auto["details"]["read_io"]
    assert list(target.iterdir()) == [], "the benchmark removes what it wrote"


@pytest.mark.parametrize(("sampled", "held"), [(300 * 2**20, "held in every run"), (600 * 2**20, "EXCEEDED")])
def test_quantized_summary_gives_scaling_stock_ratio_and_peaks_against_the_limit(sampled: int, held: str) -> None:
    """Issue 32: the quantized suite prints w=2 against w=1 and stock, and the reported and the
    sampled peak of every run of ours against the memory limit."""
    limit = 512 * 2**20
    rows = []
    for n, walls in ((1, [3.0, 3.2, 2.9]), (2, [1.5, 1.6, 1.4])):
        case = _case(f"fp8->bf16 parallel_dcp w={n}", "fp8->bf16 parallel_dcp", n, "fp8->bf16 stock")
        measured = _measured(case, walls, peak=sampled if n == 2 else 100 * 2**20)
        measured.details.update(memory_limit=limit, peak_memory=400 * 2**20 if n == 1 else 200 * 2**20)
        rows.append(measured)
    rows.append(_measured(_case("fp8->bf16 stock", "fp8->bf16 stock", 1), [12.0, 15.0, 9.0]))
    scenario = Scenario(
        suite="quantized:fp8",
        target="disk",
        directory="/tmp",
        sync=True,
        state_dict="test",
        nbytes=2**30,
        tensors=3,
        reps=3,
        warmup=0,
        workers=[1, 2],
    )
    scenario.measured = rows
    s = summary(scenario, row_figures(scenario))["fp8->bf16"]
    assert s["speedup_vs_stock"] == pytest.approx(12.0 / 1.5)
    assert s["speedup_vs_one_worker"] == pytest.approx(2.0)
    assert (s["reported_peak"], s["sampled_peak"], s["memory_limit"]) == (400 * 2**20, sampled, limit)
    text = "\n".join(scenario_lines(scenario))
    assert "fp8->bf16: parallel_dcp w=2 vs stock: 8.00x (target >= 5.0x); w=2 vs w=1: 2.00x (target >= 1.7x)" in text
    assert f"peak reported / sampled 400 / {sampled // 2**20} MiB of the 512 MiB limit: {held}" in text


def test_quantized_suite_runs_and_prints_its_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "target"
    target.mkdir()
    run = _bench([*TINY, "--suite", "quantized", "--targets", str(target), "--no-peers"], tmp_path, capsys, monkeypatch)
    assert run.returncode == 0, run.stderr
    for label in ("fp8->bf16", "mxfp4->bf16", "bf16->fp8"):
        line = next(line for line in run.stdout.splitlines() if line.startswith(f"{label}: parallel_dcp w=2 vs stock"))
        assert " w=2 vs w=1: " in line and "MiB limit: held in every run" in line, line
    assert list(target.iterdir()) == []


def test_the_disk_summary_puts_the_conversion_beside_the_combined_limit_by_the_devices_own_time() -> None:
    from parallel_dcp.benchmark.disk_report import disk_summary, disk_summary_lines

    rows: dict[str, dict[str, Any]] = {
        "convert safetensors w=2": {"median_s": 1.5, "details": {}},
        "convert safetensors w=2 io=buffered": {"median_s": 1.6, "details": {}},
        "device read+write x2": {"median_s": 2.0, "details": {"device_s": 1.2}},  # wall with fio's start
        "stock load_file + dcp.save t=2": {"median_s": 3.0, "details": {}},
    }
    summary = disk_summary(rows, 2**30)
    assert summary["combined_limit_s"] == 1.2
    assert summary["convert_of_combined_limit"] == pytest.approx(0.8)
    assert summary["convert_buffered_of_combined_limit"] == pytest.approx(0.75)
    assert any("combined read+write limit (1.200 s" in line and "80%" in line for line in disk_summary_lines(summary))
    rows["device read+write x2"]["details"] = {}  # the built-in probe without its own time: the wall time
    assert disk_summary(rows, 2**30)["convert_of_combined_limit"] == pytest.approx(2.0 / 1.5)


def test_one_state_dict_of_the_scaling_suite_runs_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--suite scaling:small`` (or ``scaling:llm``): one of the two scenarios, sized on its own."""
    import argparse

    from parallel_dcp.benchmark import suites
    from parallel_dcp.benchmark.config import BenchConfig, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = BenchConfig.from_args(parser.parse_args([*TINY, "--suite", "scaling:small", "--targets", str(tmp_path)]))
    ran: list[str] = []
    monkeypatch.setattr(suites, "_scenario", lambda suite, *rest: ran.append(suite) or suite)
    suites.run_all(config)
    assert ran == ["scaling:small"]


def test_a_bench_stopped_by_sigterm_leaves_no_checkpoint_behind(tmp_path: Path) -> None:
    """A scheduler's SIGTERM in the middle of a run, here between two saves (inside one, the save
    turns it into Ctrl-C on its own), ends it as Ctrl-C does: the scenario's folder of checkpoints
    is removed, not left on the target (gigabytes, often on /dev/shm)."""
    target = tmp_path / "target"
    target.mkdir()
    script = tmp_path / "stopped.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from parallel_dcp.benchmark import main, suites\n"
        "def stopped(cases, reps, warmup, root, progress, shuffled=False):\n"
        "    open(os.path.join(root, 'a-checkpoint'), 'w').write('x')\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(60)\n"
        "suites.run_interleaved = stopped\n"
        f"sys.exit(main([*{TINY!r}, '--suite', 'small', '--targets', sys.argv[1]]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, str(script), str(target)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0 and "KeyboardInterrupt" in done.stderr, done.stderr
    assert list(target.iterdir()) == []


def test_each_rows_collection_walks_only_what_the_run_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row starts with a full collection (``release_free_memory``): the objects that existed
    before the run (torch's import: a quarter million, 0.3-0.9 s a collection) are frozen while it
    runs, so the collector does not walk them before each row, and thawed again afterwards."""
    import argparse
    import gc

    from parallel_dcp.benchmark import suites
    from parallel_dcp.benchmark.config import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = BenchConfig.from_args(parser.parse_args([*TINY, "--suite", "small", "--targets", str(tmp_path)]))
    made_before: list[int] = []  # a container the collector tracks, made before the run
    walked_in_run: list[bool] = []

    def run_all(config: BenchConfig, on_scenario: Any = None) -> list[Scenario]:
        # gc.get_objects() lists what a collection walks (frozen objects are not in it).
        walked_in_run.append(any(o is made_before for o in gc.get_objects()))
        return []

    monkeypatch.setattr(suites, "run_all", run_all)
    assert gc.get_freeze_count() == 0
    assert benchmark._run(config) == 0
    assert walked_in_run == [False]
    assert any(o is made_before for o in gc.get_objects())
    assert gc.get_freeze_count() == 0, "the caller's collector is left as it was"
