"""Figures of a finished scenario: per-row statistics, ratios and the summary, as plain data.

Every ratio is taken between medians of the same run (same state dict, same target, same sync
setting, interleaved repetitions): ``speedup`` is the baseline's median time over the row's
(above 1: the row is faster), ``of_limit`` the plain write's median time at the same process
count over the row's (1.0: as fast as writing ready buffers). A limit row that measured the
device's own seconds (``device_s`` in its details: fio's job run time, without fio's start-up)
counts those, not its wall time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from parallel_dcp.benchmark.measure import Measured

__all__ = ["Scenario", "row_figures", "summary"]

_STOCK_FAMILIES = ("stock dcp", "stock dcp crc-off")


@dataclass(kw_only=True, slots=True)
class Scenario:
    """One suite on one target with one sync setting, and what its cases measured."""

    suite: str
    target: str
    directory: str
    sync: bool
    state_dict: str
    nbytes: int
    tensors: int
    reps: int
    warmup: int
    workers: list[int]
    measured: list[Measured] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # The scaling suite's model inputs and projection (parallel_dcp.benchmark.scaling.project).
    projection: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.suite}/{self.target}/sync-{'on' if self.sync else 'off'}"

    @property
    def compare_count(self) -> int:
        """The process count the summary compares at: 2 where measured, else the largest."""
        return 2 if 2 in self.workers else max(self.workers)


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def row_figures(scenario: Scenario) -> dict[str, dict[str, Any]]:
    """Per row (by name, in table order): timings, GiB/s, CPU, peak memory and ratios.

    ``status`` is ``"ok"``, ``"not run"`` (unavailable here) or ``"failed"``; a row that is not
    ok has ``error`` set and None for every figure.
    """
    medians = {m.case.name: _median(m.walls) if m.walls and not m.error else None for m in scenario.measured}
    limits = {m.case.name: m.details.get("device_s") or medians[m.case.name] for m in scenario.measured}
    rows: dict[str, dict[str, Any]] = {}
    for m in scenario.measured:
        case, median = m.case, medians[m.case.name]
        ok = median is not None
        peak = max(m.peaks) if ok else None
        rows[case.name] = {
            "family": case.family,
            "procs": case.procs,
            "gib_per_s": scenario.nbytes / 2**30 / median if median else None,
            "median_s": median,
            "min_s": min(m.walls) if ok else None,
            "max_s": max(m.walls) if ok else None,
            "cpu_s": _median(m.cpus) if ok else None,
            "peak_added_bytes": peak,
            "peak_added_of_state_dict": _ratio(peak, scenario.nbytes),
            "baseline": case.baseline,
            "speedup": _ratio(medians.get(case.baseline) if case.baseline else None, median),
            "limit": case.limit,
            "of_limit": _ratio(limits.get(case.limit) if case.limit else None, median),
            "samples_s": list(m.walls),
            "samples_after": list(m.after),
            "details": dict(m.details),
            "note": case.note,
            "status": "not run" if case.unavailable else "failed" if m.error else "ok",
            "error": m.error,
        }
    return rows


def _best(rows: dict[str, dict[str, Any]], families: tuple[str, ...]) -> str | None:
    timed = [(r["median_s"], name) for name, r in rows.items() if r["family"] in families and r["median_s"]]
    return min(timed)[1] if timed else None


def _save_summary(scenario: Scenario, rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    n = scenario.compare_count
    ours = rows.get(f"parallel_dcp w={n}", {}).get("median_s")
    best = _best(rows, _STOCK_FAMILIES)
    stock = rows.get(f"stock dcp t={n}", {}).get("median_s")
    plain = rows.get(f"plain write x{n}", {}).get("median_s")
    nvrx = rows.get(f"nvrx w={n}", {}).get("median_s")
    one = rows.get("parallel_dcp w=1", {}).get("median_s")
    unsplit = rows.get(f"parallel_dcp w={n} unsplit", {}).get("median_s")
    return {
        "workers": n,
        "speedup_vs_one_worker": _ratio(one, ours),
        "speedup_vs_unsplit": _ratio(unsplit, ours),
        "speedup_vs_stock_same_count": _ratio(stock, ours),
        "best_stock": best,
        "speedup_vs_best_stock": _ratio(rows[best]["median_s"], ours) if best else None,
        "time_vs_plain_write": _ratio(ours, plain),
        "speedup_vs_nvrx_same_count": _ratio(nvrx, ours),
        "peak_added_of_state_dict": rows.get(f"parallel_dcp w={n}", {}).get("peak_added_of_state_dict"),
    }


def _convert_summary(scenario: Scenario, rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    n = scenario.compare_count
    result: dict[str, Any] = {"workers": n}
    for kind in ("st", "pt"):
        ours, stock = rows.get(f"{kind}->dcp parallel_dcp w={n}", {}), rows.get(f"{kind}->dcp stock", {})
        result[f"{kind}_speedup_vs_stock"] = _ratio(stock.get("median_s"), ours.get("median_s"))
        result[f"{kind}_peak_added_of_state_dict"] = ours.get("peak_added_of_state_dict")
        result[f"{kind}_stock_peak_added_of_state_dict"] = stock.get("peak_added_of_state_dict")
    return result


def summary(scenario: Scenario, rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline ratios of a scenario (None where a row they need did not run)."""
    if scenario.suite == "convert":
        return _convert_summary(scenario, rows)
    if scenario.suite.startswith("compress"):
        from parallel_dcp.benchmark.compression import compress_summary

        return compress_summary(rows, scenario.compare_count)
    if scenario.suite == "disk":
        from parallel_dcp.benchmark.disk_report import disk_summary

        return disk_summary(rows, scenario.nbytes)
    if scenario.suite == "read":
        from parallel_dcp.benchmark.reading import read_summary

        return read_summary(rows, scenario.compare_count)
    if scenario.suite in ("load", "load-small"):
        from parallel_dcp.benchmark.loading import load_summary

        return load_summary(rows, scenario.compare_count)
    if scenario.suite.startswith("quantized"):
        from parallel_dcp.benchmark.quantized_summary import quantized_summary

        return quantized_summary(rows, scenario.compare_count)
    return _save_summary(scenario, rows)
