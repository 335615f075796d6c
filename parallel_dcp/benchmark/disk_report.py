"""The ``disk`` suite's summary: each target of issue 23 from one scenario's rows (see disk.py)."""

from __future__ import annotations

from typing import Any

__all__ = ["disk_summary", "disk_summary_lines"]


def disk_summary(rows: dict[str, dict[str, Any]], nbytes: int) -> dict[str, Any]:
    """The issue's targets from one disk scenario (None where a row did not run)."""

    def median(prefix: str) -> float | None:
        for name, row in rows.items():
            if name.startswith(prefix) and row.get("median_s"):
                return float(row["median_s"])
        return None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    save = next((float(r["median_s"]) for n, r in rows.items() if "io=auto" in n and r["median_s"]), None)
    buffered = next((float(r["median_s"]) for n, r in rows.items() if "io=buffered" in n and r["median_s"]), None)
    unchecked = next((float(r["median_s"]) for n, r in rows.items() if "no-checksums" in n and r["median_s"]), None)
    reads = [
        float(r["median_s"])
        for n, r in rows.items()
        if n.startswith("plain read") and "(stock-written)" not in n and r["median_s"]
    ]
    best_read = min(reads) if reads else None
    converts = {
        ("io=buffered" in n): float(r["median_s"])
        for n, r in rows.items()
        if n.startswith("convert safetensors") and r["median_s"]
    }
    convert, convert_buffered = converts.get(False), converts.get(True)
    # The combined limit: the device's own seconds where the row measured them (fio's job run time,
    # without its start-up), else the row's wall time.
    both = _device_seconds(rows, "device read+write")
    growth = next((r["details"].get("page_cache_growth") for n, r in rows.items() if "io=auto" in n), None)
    return {
        "save_of_direct_limit": ratio(_device_seconds(rows, "device direct write"), save),
        "save_vs_stock": ratio(median("stock dcp t="), save),
        "save_io": next((r["details"].get("io") for n, r in rows.items() if "io=auto" in n), None),
        "save_buffered_vs_auto": ratio(buffered, save),
        "checksums_share": (save - unchecked) / save if save and unchecked else None,
        "convert_vs_stock": ratio(median("stock load_file"), median("convert safetensors")),
        "combined_limit_s": both,
        "convert_of_combined_limit": ratio(both, convert),
        "convert_buffered_of_combined_limit": ratio(both, convert_buffered),
        "convert_buffered_vs_auto": ratio(convert_buffered, convert),
        "load_into_of_best_read": ratio(best_read, median("load into")),
        "fast_reader_of_best_read": ratio(best_read, median("FastReader")),
        "load_into_vs_stock": ratio(median("stock dcp.load"), median("load into")),
        "verify_vs_stock": ratio(median("stock dcp.load + torch.equal"), median("verify")),
        "reads": {label: _reads(rows, label) for label in ("", " (stock-written)")},
        "page_cache_growth_of_checkpoint": growth / nbytes if growth is not None and nbytes else None,
        "page_cache_growth_by_writer": {
            n: r["details"]["page_cache_growth"] for n, r in rows.items() if "page_cache_growth" in r["details"]
        },
    }


def _device_seconds(rows: dict[str, dict[str, Any]], prefix: str) -> float | None:
    """A device-limit row's seconds: the device's own where the row measured them (fio's job run
    time, without its start-up), else the row's wall time."""
    row = next((r for n, r in rows.items() if n.startswith(prefix)), None)
    if row is None:
        return None
    return row.get("details", {}).get("device_s") or row.get("median_s")


def _reads(rows: dict[str, dict[str, Any]], label: str) -> dict[str, Any]:
    """The cold read figures of one checkpoint (ours: ``label`` "", or stock-written): each of
    our readers as a share of the best plain parallel read of its shards and against stock's
    ``dcp.load``, and how ``io="auto"`` chose (the probe's rates, from the load row's details)."""

    def find(prefix: str, *parts: str) -> dict[str, Any] | None:
        for name, found in rows.items():
            mine = label in name if label else "(stock-written)" not in name
            plain = parts or ("io=" not in name and "torch.equal" not in name)
            if name.startswith(prefix) and mine and plain and all(p in name for p in parts):
                return found
        return None

    def median(prefix: str, *parts: str) -> float | None:
        found = find(prefix, *parts)
        return float(found["median_s"]) if found and found.get("median_s") else None

    direct, buffered = median("plain read", " direct"), median("plain read", " buffered")
    best = min((t for t in (direct, buffered) if t), default=None)
    stock = median("stock dcp.load")
    auto = median("load into w=")
    out: dict[str, Any] = {
        "plain_direct_over_buffered": buffered / direct if direct and buffered else None,
        "choice": {
            k: v
            for k, v in ((find("load into w=") or {}).get("details") or {}).items()
            if k.startswith(("read_", "probe_"))
        },
    }
    for key, mine in (("load_into", auto), ("fast_reader", median("FastReader w="))):
        out[f"{key}_of_best_read"] = best / mine if best and mine else None
        out[f"{key}_vs_stock"] = stock / mine if stock and mine else None
    for io in ("direct", "buffered"):
        forced = median("load into w=", f"io={io}")
        out[f"auto_vs_{io}"] = forced / auto if forced and auto else None
    return out


def disk_summary_lines(s: dict[str, Any]) -> list[str]:
    def num(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    return [
        f"save (io=auto -> {s['save_io']}) of the device's direct-write limit: "
        f"{num(s['save_of_direct_limit'], '.0%')} (target >= 85%)",
        f"save vs stock dcp.save: {num(s['save_vs_stock'], '.2f')}x (target >= 2.5x); io=buffered takes "
        f"{num(s['save_buffered_vs_auto'], '.2f')}x the time of io=auto",
        f"checksums' share of the save time: {num(s['checksums_share'], '.0%')} (target <= 5%)",
        f"safetensors -> DCP vs load_file + dcp.save: {num(s['convert_vs_stock'], '.2f')}x (target >= 2.5x)",
        f"safetensors -> DCP of the combined read+write limit ({num(s['combined_limit_s'], '.3f')} s: the source "
        f"read and as many bytes written at once): {num(s['convert_of_combined_limit'], '.0%')} "
        f"(target >= 85%); through the mmap (io=buffered) {num(s['convert_buffered_of_combined_limit'], '.0%')}, "
        f"{num(s['convert_buffered_vs_auto'], '.2f')}x the time of io=auto",
        *_read_lines(s.get("reads", {}), num),
        f"verify vs stock dcp.load + torch.equal: {num(s['verify_vs_stock'], '.2f')}x (target >= 1.2x)",
        f"page-cache growth after a save with io=auto: {num(s['page_cache_growth_of_checkpoint'], '.1%')} of the "
        "checkpoint (target < 5%)",
        "page-cache growth (Dirty + Cached) per writer: "
        + ", ".join(f"{n}: {g / 2**20:+.0f} MiB" for n, g in s["page_cache_growth_by_writer"].items()),
    ]


def _read_lines(reads: dict[str, dict[str, Any]], num: Any) -> list[str]:
    lines = []
    for label, r in reads.items():
        which = "stock-written checkpoint" if label else "our checkpoint"
        choice = r.get("choice") or {}
        probe = (
            f"measured direct {choice['probe_direct_gib_s']:.2f} / buffered {choice['probe_buffered_gib_s']:.2f} GiB/s "
            f"in {choice['probe_s']:.2f} s"
            if "probe_direct_gib_s" in choice
            else choice.get("read_reason", "-")
        )
        lines += [
            f"{which}: io=auto read {choice.get('read_io', '-')} ({probe}); plain reads direct/buffered "
            f"{num(r['plain_direct_over_buffered'], '.2f')}x; auto vs io=direct {num(r['auto_vs_direct'], '.2f')}x, "
            f"vs io=buffered {num(r['auto_vs_buffered'], '.2f')}x",
            f"{which}: load(into=) / FastReader of the best plain read {num(r['load_into_of_best_read'], '.0%')} / "
            f"{num(r['fast_reader_of_best_read'], '.0%')} (target >= 95%), vs stock dcp.load "
            f"{num(r['load_into_vs_stock'], '.2f')}x / {num(r['fast_reader_vs_stock'], '.2f')}x (target >= 1.0x)",
        ]
    return lines
