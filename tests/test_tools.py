"""The demo and the benchmark run end to end on a tiny size (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_runs_and_proves_a_stock_round_trip(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "parallel_dcp.demo", "--gib", "0.01", "--workers", "2", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "bit-exact" in out and "GiB/s" in out and "x stock" in out
    assert list(tmp_path.iterdir()) == [], "the demo cleans up after itself"


def test_save_benchmark_runs_and_writes_json(tmp_path: Path) -> None:
    result_file = tmp_path / "bench.json"
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_save.py"),
            "--gib",
            "0.01",
            "--reps",
            "1",
            "--dir",
            str(tmp_path),
            "--json",
            str(result_file),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "speedup vs stock dcp t=2" in out
    result = json.loads(result_file.read_text())
    assert {"parallel_dcp w=1", "parallel_dcp w=2", "stock dcp t=2", "plain write x2"} <= result["rows"].keys()
    assert all(row["gib_per_s"] > 0 for row in result["rows"].values())
