"""The ``quantized`` suite's summary: each conversion at N workers against stock and against one
worker, and the peaks of every run against the memory limit (issue 32's targets beside them)."""

from __future__ import annotations

from typing import Any

__all__ = ["quantized_summary", "quantized_summary_lines"]

# What issue 32 asks of FP8 -> bf16 under a limit of 25% of the output.
_TARGETS = {"fp8->bf16": (5.0, 1.7)}


def quantized_summary(rows: dict[str, dict[str, Any]], workers: int) -> dict[str, Any]:
    """Per conversion of the scenario: ours at ``workers`` against stock and against one worker,
    and the peaks of every run of ours (the governor's report and the benchmark's own sampler of
    the process tree) against the memory limit."""
    out: dict[str, Any] = {}
    for label in ("fp8->bf16", "mxfp4->bf16", "bf16->fp8"):
        ours = {n: rows.get(f"{label} parallel_dcp w={n}") for n in (1, workers)}
        most = ours[workers]
        if most is None:
            continue
        stock = rows.get(f"{label} stock") or rows.get(f"{label} torch loop") or {}
        runs = [r for name, r in rows.items() if name.startswith(f"{label} parallel_dcp") and r["status"] == "ok"]
        limit = max((r["details"].get("memory_limit", 0) for r in runs), default=0) or None
        reported = max((r["details"].get("peak_memory", 0) for r in runs), default=None)
        sampled = max((r["peak_added_bytes"] for r in runs), default=None)
        one = ours[1] or {}
        out[label] = {
            "workers": workers,
            "speedup_vs_stock": _ratio(stock.get("median_s"), most["median_s"]),
            "speedup_vs_one_worker": _ratio(one.get("median_s"), most["median_s"]) if workers != 1 else None,
            "memory_limit": limit,
            "reported_peak": reported,
            "sampled_peak": sampled,
            "limit_held": None if limit is None or not runs else max(reported or 0, sampled or 0) <= limit,
        }
    return out


def quantized_summary_lines(s: dict[str, Any]) -> list[str]:
    lines = []
    for label, r in s.items():
        n = r["workers"]
        stock_target, scaling_target = _TARGETS.get(label, (None, None))
        mib = {k: r[k] / 2**20 if r[k] is not None else None for k in ("memory_limit", "reported_peak", "sampled_peak")}
        held = {True: "held in every run", False: "EXCEEDED", None: "-"}[r["limit_held"]]
        lines.append(
            f"{label}: parallel_dcp w={n} vs stock: {_fmt(r['speedup_vs_stock'], 'x')}{_target(stock_target)};"
            f" w={n} vs w=1: {_fmt(r['speedup_vs_one_worker'], 'x')}{_target(scaling_target)};"
            f" peak reported / sampled {_fmt(mib['reported_peak'])} / {_fmt(mib['sampled_peak'])} MiB"
            f" of the {_fmt(mib['memory_limit'])} MiB limit: {held}"
        )
    return lines


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def _fmt(value: float | None, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{suffix}" if suffix else f"{value:.0f}"


def _target(value: float | None) -> str:
    return f" (target >= {value}x)" if value else ""
