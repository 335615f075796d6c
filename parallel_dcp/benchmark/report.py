"""The benchmark's outputs: the table and summary on stdout, and the JSON document."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
from typing import Any

import psutil
import torch

import parallel_dcp
from parallel_dcp.benchmark import peers
from parallel_dcp.benchmark.config import BenchConfig
from parallel_dcp.benchmark.pieces import executor_lines
from parallel_dcp.benchmark.results import Scenario, row_figures, summary
from parallel_dcp.benchmark.scaling import projection_lines
from parallel_dcp.options import usable_cores

__all__ = ["NOTES", "document", "machine_info", "scenario_lines", "write_json"]

NOTES = [
    "GiB/s: tensor bytes over the median wall time; min/max s: the fastest and slowest repetition.",
    "cpu s: median user+sys seconds of this process and its reaped children (getrusage SELF+CHILDREN),"
    " the memory sampler excluded. Forking changes memory speed: on some VMs a forked child reads"
    " inherited pages faster than its parent, on others (this project's 2-core VM) its first pass over"
    " them is slower (~0.1 s/GiB); compare CPU beside wall time, and the 'processes' row with the default.",
    "x stock: the stock baseline's median time over this row's (above 1: faster). Save rows: stock dcp.save"
    " (defaults) at the same thread count; torch.save and safetensors: stock t=1; conversions: the stock path.",
    "of limit: the plain write of ready buffers by as many processes, in time over this row's time.",
    "peak +MiB: highest PSS of this process and all its children, without program code, as the memory"
    " governor counts it (sampled every >=5 ms, at most 5% of a core) above its level when the row"
    " started; page cache and tmpfs files are not counted.",
]
_HEADER = (
    f"{'writer':<28}{'n':>3}{'GiB/s':>8}{'median s':>10}{'min s':>8}{'max s':>8}{'cpu s':>8}"
    f"{'x stock':>9}{'of limit':>9}{'peak +MiB':>11}{'of sd':>7}  note"
)


def _num(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _cell(value: float | None, width: int, spec: str, suffix: str = "") -> str:
    return f"{_num(value, spec, suffix):>{width}}"


def _row_line(name: str, row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{name:<28}{row['procs'] or '':>3}  {row['status']}: {row['error']}"
    peak = row["peak_added_bytes"]
    note = row["note"]
    used = row["details"].get("workers_used")
    stored = row["details"].get("stored_ratio")
    if stored is not None:
        note = "; ".join(filter(None, [f"stored/logical {stored:.3f}", note]))
    if used is not None and used != row["procs"]:
        note = "; ".join(filter(None, [f"ran {used} worker(s): memory limit or too few tasks", note]))
    return (
        f"{name:<28}{row['procs']:>3}{_cell(row['gib_per_s'], 8, '.2f')}{_cell(row['median_s'], 10, '.3f')}"
        f"{_cell(row['min_s'], 8, '.3f')}{_cell(row['max_s'], 8, '.3f')}{_cell(row['cpu_s'], 8, '.2f')}"
        f"{_cell(row['speedup'], 9, '.2f', 'x')}{_cell(row['of_limit'], 9, '.0%')}"
        f"{_cell(peak / 2**20 if peak is not None else None, 11, '.1f')}"
        f"{_cell(row['peak_added_of_state_dict'], 7, '.0%')}  {note}"
    ).rstrip()


def _save_summary_lines(scenario: Scenario, s: dict[str, Any]) -> list[str]:
    n = s["workers"]
    ours = f"{'many-small: ' if scenario.suite == 'small' else ''}parallel_dcp w={n}"
    if scenario.suite == "lopsided":
        return [
            f"lopsided: parallel_dcp w={n} vs w=1: {_num(s['speedup_vs_one_worker'], '.2f', 'x')}",
            f"lopsided: parallel_dcp w={n} vs the same unsplit: {_num(s['speedup_vs_unsplit'], '.2f', 'x')}",
            f"lopsided: parallel_dcp w={n} time vs plain write: {_num(s['time_vs_plain_write'], '.2f', 'x')}",
        ]
    return [
        f"{ours} vs stock dcp t={n} (defaults): {_num(s['speedup_vs_stock_same_count'], '.2f', 'x')}",
        f"{ours} vs best stock ({s['best_stock'] or '-'}): {_num(s['speedup_vs_best_stock'], '.2f', 'x')}",
        f"{ours} time vs plain {n}-writer write: {_num(s['time_vs_plain_write'], '.2f', 'x')}",
        f"{ours} vs nvrx w={n}: {_num(s['speedup_vs_nvrx_same_count'], '.2f', 'x')}",
        f"{ours} peak extra memory: {_num(s['peak_added_of_state_dict'], '.1%')} of the state dict",
    ]


def _convert_summary_lines(s: dict[str, Any]) -> list[str]:
    n = s["workers"]
    return [
        f"{label}->DCP: parallel_dcp w={n} vs stock path: {_num(s[f'{kind}_speedup_vs_stock'], '.2f', 'x')};"
        f" peak extra memory {_num(s[f'{kind}_peak_added_of_state_dict'], '.0%')}"
        f" vs {_num(s[f'{kind}_stock_peak_added_of_state_dict'], '.0%')} of the state dict"
        for kind, label in (("st", "safetensors"), ("pt", "torch.save"))
    ]


def _load_summary_lines(s: dict[str, Any]) -> list[str]:
    n, lines = s["workers"], []
    for source in ("stock", "pdcp"):
        r = s[source]
        lines += [
            f"[{source}] load into w={n} vs stock dcp.load: {_num(r['into_vs_stock'], '.2f', 'x')} (target >= 2x);"
            f" time vs plain read: {_num(r['into_time_vs_limit'], '.2f', 'x')} (target <= 1.5x)",
            f"[{source}] FastReader w={n} vs stock dcp.load: {_num(r['fast_reader_vs_stock'], '.2f', 'x')};"
            f" time vs plain read: {_num(r['fast_reader_time_vs_limit'], '.2f', 'x')}",
            f"[{source}] load w={n} vs stock allocating load: {_num(r['load_vs_stock_alloc'], '.2f', 'x')}"
            " (target >= 1.5x)",
        ]
        if r.get("into_plan"):  # the side index, or .metadata and why (ReadStats.index)
            lines.append(f"[{source}] load into w={n}: {r['into_plan']}")
        if (r.get("records") or 0) >= 10_000:  # the many-small suite: the cost of one record
            lines.append(
                f"[{source}] load into w={n}: {_num(r['into_us_per_record'], '.1f', ' us')} per record over"
                f" {r['records']:,} records (target <= 10 us)"
            )
    return lines


def _compress_summary_lines(s: dict[str, Any]) -> list[str]:
    n = s["workers"]
    return [
        f"compressed save zstd:3 w={n} vs stock zstd t={n}: {_num(s['save_vs_stock'], '.2f', 'x')} (target >= 1.5x)",
        f"compressed load w={n} vs stock dcp.load: {_num(s['load_vs_stock_pdcp'], '.2f', 'x')} [pdcp-written],"
        f" {_num(s['load_vs_stock_stock'], '.2f', 'x')} [stock-written] (target >= 1.5x)",
        f"zstd:3 save w={n} vs w=1: {_num(s['scaling_level3'], '.2f', 'x')} (target >= 1.8x)",
    ]


def scenario_lines(scenario: Scenario) -> list[str]:
    """The table of one scenario, its summary lines and its notes."""
    rows = row_figures(scenario)
    lines = [
        "",
        f"== {scenario.key}: {scenario.state_dict} in {scenario.directory}; median of {scenario.reps}"
        f" after {scenario.warmup} warm-up round(s) ==",
        _HEADER,
        *(_row_line(name, row) for name, row in rows.items()),
    ]
    s = summary(scenario, rows)
    if scenario.suite == "convert":
        lines += _convert_summary_lines(s)
    elif scenario.suite in ("load", "load-small"):
        lines += _load_summary_lines(s)
    elif scenario.suite.startswith("compress"):
        lines += _compress_summary_lines(s)
    elif scenario.suite == "read":
        from parallel_dcp.benchmark.reading import read_summary_lines

        lines += read_summary_lines(s)
    elif scenario.suite == "disk":
        from parallel_dcp.benchmark.disk_report import disk_summary_lines

        lines += disk_summary_lines(s)
    elif scenario.suite.startswith("quantized"):
        from parallel_dcp.benchmark.quantized_summary import quantized_summary_lines

        lines += quantized_summary_lines(s)
    else:
        lines += _save_summary_lines(scenario, s)
    lines += [f"note: {note}" for note in scenario.notes]
    if scenario.suite.startswith("scaling"):
        lines += projection_lines(scenario.projection)
        if scenario.projection.get("executors"):
            lines += executor_lines(scenario.projection["executors"], scenario.projection.get("governor"))
    return lines


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def machine_info() -> dict[str, Any]:
    """Cores, memory, CPU, software versions and the date: what a reader needs to weigh the figures."""
    memory = psutil.virtual_memory()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "cpu": _cpu_model(),
        "ram_bytes": memory.total,
        "ram_available_bytes": memory.available,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "parallel_dcp": parallel_dcp.__version__,
        "peers": peers.versions(),
    }


def _finite(value: Any) -> Any:
    """The value with NaN and infinities as None, so the document is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def document(config: BenchConfig, scenarios: list[Scenario], ok: bool) -> dict[str, Any]:
    """All rows, ratios and summaries of the run, with the machine and the options, as JSON data."""
    body = []
    for scenario in scenarios:
        rows = row_figures(scenario)
        body.append(
            {
                "key": scenario.key,
                "suite": scenario.suite,
                "target": scenario.target,
                "directory": scenario.directory,
                "sync": scenario.sync,
                "state_dict": scenario.state_dict,
                "bytes": scenario.nbytes,
                "tensors": scenario.tensors,
                "reps": scenario.reps,
                "warmup": scenario.warmup,
                "rows": rows,
                "summary": summary(scenario, rows),
                "notes": scenario.notes,
                **({"projection": scenario.projection} if scenario.projection else {}),
            }
        )
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    options["targets"] = [{"label": t.label, "directory": t.directory} for t in config.targets]
    data: dict[str, Any] = _finite(
        {
            "benchmark": "parallel-dcp bench",
            "ok": ok,
            "machine": machine_info(),
            "config": options,
            "notes": NOTES,
            "scenarios": body,
        }
    )
    return data


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` whole or not at all (temp file, then rename)."""
    text = json.dumps(data, indent=2, allow_nan=False)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)
