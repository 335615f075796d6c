"""The demo runs end to end on a tiny size (no timing is asserted); the benchmark: test_benchmark.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


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
