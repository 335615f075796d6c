"""The PNG: GiB/s against workers / threads, one panel per scenario.

Writers that use n processes or threads are lines over n; the plain write of ready buffers is the
dashed black line (the storage's limit); one-process writers and stock conversion paths are
dotted horizontal lines. Load scenarios are bars: one per reader.
"""

from __future__ import annotations

import math
from typing import Any

from parallel_dcp.benchmark.results import Scenario, row_figures

__all__ = ["draw_bars", "write_plot"]

# Families drawn as horizontal lines: they have no worker or thread count to vary.
_FLAT = {"torch.save", "safetensors", "st->dcp stock", "pt->dcp stock"}
# Not drawn: memcpy (no file, an order of magnitude above the rest) and rows that never run here.
_HIDDEN = {"memcpy", "megatron-core"}
_LIMIT = "plain write"


def _series(scenario: Scenario) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for row in row_figures(scenario).values():
        if row["gib_per_s"] is not None and row["family"] not in _HIDDEN:
            series.setdefault(row["family"], []).append((row["procs"], row["gib_per_s"]))
    return series


def draw_bars(axes: Any, rows: dict[str, dict[str, Any]], title: str) -> None:
    """A load scenario: one bar of GiB/s per row (its rows compare readers, not worker counts)."""
    names = [name for name, row in rows.items() if row.get("gib_per_s")]
    values = [rows[name]["gib_per_s"] for name in names]
    colors = [
        "black" if rows[n]["family"].startswith("plain") else "C0" if rows[n]["family"].startswith("stock") else "C1"
        for n in names
    ]
    axes.barh(range(len(names)), values, color=colors)
    axes.set_yticks(range(len(names)), names, fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("GiB/s (median); orange: parallel_dcp, blue: stock DCP, black: plain reads")
    axes.set_title(title, fontsize=9)
    axes.grid(alpha=0.3, axis="x")


def _draw(axes: Any, scenario: Scenario) -> None:
    if scenario.suite in ("load", "load-small"):
        draw_bars(axes, row_figures(scenario), f"{scenario.key}\n{scenario.state_dict}")
        return
    for index, (family, points) in enumerate(_series(scenario).items()):
        xs, ys = zip(*sorted(points), strict=True)
        color = f"C{index % 10}"
        if family in _FLAT:
            axes.axhline(ys[0], linestyle=":", linewidth=1.2, color=color, label=family)
        elif family == _LIMIT:
            axes.plot(xs, ys, "k--", marker="s", label="plain write (limit)")
        else:
            axes.plot(xs, ys, marker="o", color=color, label=family)
    axes.set_title(f"{scenario.key}\n{scenario.state_dict}", fontsize=9)
    axes.set_xlabel("workers / threads / processes")
    axes.set_ylabel("GiB/s (median)")
    axes.set_xticks(scenario.workers)
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="best")


def write_plot(path: str, scenarios: list[Scenario]) -> None:
    """Write the PNG to ``path`` (matplotlib, Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = max(1, len(scenarios))
    columns = min(count, 2)
    rows = math.ceil(count / columns)
    figure, grid = plt.subplots(rows, columns, figsize=(6.4 * columns, 4.6 * rows), squeeze=False)
    try:
        for axes, scenario in zip(grid.flat, scenarios, strict=False):
            _draw(axes, scenario)
        for axes in list(grid.flat)[len(scenarios) :]:
            axes.set_visible(False)
        figure.tight_layout()
        figure.savefig(path, dpi=110, format="png")
    finally:
        plt.close(figure)
