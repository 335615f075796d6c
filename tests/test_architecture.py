"""The layout's promises that a test can hold: what the core imports, and what it does not."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from parallel_dcp import benchmark
from parallel_dcp.benchmark.config import BenchConfig

ROOT = Path(__file__).resolve().parent.parent


def test_the_core_imports_neither_the_benchmark_nor_a_plotting_library() -> None:
    """matplotlib is an optional extra ([bench]): save, load and convert must not need it."""
    code = (
        "import sys, parallel_dcp, parallel_dcp.cli; "
        "print(sorted(m for m in sys.modules if m.startswith(('matplotlib', 'parallel_dcp.benchmark'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the extra looks like
    parser = argparse.ArgumentParser()
    benchmark.add_arguments(parser)
    args = parser.parse_args(["--gib", "0.001", "--targets", str(tmp_path), "--plot", str(tmp_path / "p.png")])
    with pytest.raises(ValueError, match=r"pip install 'parallel_dcp\[bench\]'"):
        benchmark.run(args)
    assert list(tmp_path.iterdir()) == [], "nothing was measured or written first"
    assert BenchConfig.from_args(args).plot_path is not None
