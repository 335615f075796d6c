"""The demo runs end to end on a tiny size (no timing is asserted); the benchmark: test_benchmark.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from parallel_dcp import demo


def test_demo_runs_and_proves_a_stock_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m parallel_dcp.demo`` is ``sys.exit(main())``: run here, not in a fresh interpreter
    that imports torch again first (what is checked is the demo's output and its cleaning up)."""
    assert demo.main(["--gib", "0.01", "--workers", "2", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "bit-exact" in out and "GiB/s" in out and "x stock" in out
    assert list(tmp_path.iterdir()) == [], "the demo cleans up after itself"


VERDICTS = [
    pytest.param(1.0, 2.0, 0.9, "", id="ahead: no excuse"),
    pytest.param(1.0, 0.8, 1.0, "a cache below the file system", id="stock faster than the direct limit"),
    pytest.param(1.1, 1.05, 1.0, "stock already writes at 95% of the device", id="stock at the limit"),
    pytest.param(2.0, 2.0, 1.0, "the machine is busy or has few cores", id="both far under the limit"),
    pytest.param(1.0, 1.0, None, "refuses O_DIRECT", id="no direct-write limit"),
]


@pytest.mark.parametrize(("ours_s", "stock_s", "limit_s", "why"), VERDICTS)
def test_the_demo_says_why_it_is_not_ahead(
    ours_s: float, stock_s: float, limit_s: float | None, why: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    demo._verdict(ours_s, stock_s, limit_s, 2**30, SimpleNamespace(workers=2), str(tmp_path), rounds=3)
    out = capsys.readouterr().out
    assert f"parallel_dcp is {stock_s / ours_s:.2f}x stock" in out
    if why:
        assert "parallel_dcp is not ahead on this machine: " in out and why in out
    else:
        assert "not ahead" not in out
