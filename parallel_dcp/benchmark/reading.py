"""The ``read`` suite: a checkpoint into memory, cold, by every reader people pick for the job.

built once (untimed): the LLM-like state dict as a Hugging Face folder of 4 safetensors shards
(with its index) and as a DCP copy (parallel_dcp.save); then the state dict is dropped
rows (interleaved; the page cache dropped before each run: ``echo 3 > drop_caches`` as root,
and ``posix_fadvise(DONTNEED)`` on every file read, which needs no privilege):
    [hf]   load w=N (defaults) | load w=N io=buffered | load w=N io=direct
           stock load_file + touch (safetensors' mmap, every page touched: the baseline)
           fastsafetensors direct / buffered, 16 threads    Run:ai streamer (its defaults)
           (each when installed: the ``.[bench]`` extra; else a row saying why)
    [dcp]  load w=N (defaults) | load w=N io=buffered | load w=N io=direct | stock dcp alloc load
    limits, per copy: fio (direct, libaio, iodepth 8, N jobs) when on PATH; plain reads xN
           (a file per thread, 8 MiB preadv, direct and buffered) and queued reads 4N x 1 MiB
           (the loader's readers: one queue of 1 MiB requests, file by file); the limit a row is
           held to is the fastest. Beside them, not a limit: the queued direct read into fresh
           memory, as a load's new tensors (their pages faulted in inside the reads)
order: each round runs the rows in an order of its own (seeded, the same in every run of the
suite). On this project's VM a cold buffered read's kernel CPU (the copy out of the page cache)
depends on the memory its page cache lands on: 0.3 s per 2 GiB right after an earlier buffered
read's pages were dropped, 1.5-2.8 s otherwise (bench/read-memory-state.txt). In one fixed order
a buffered row that always runs right after a row releasing 2 GiB wins by its place, not by how
it reads: the 1.18 s against 1.35 s direct of bench/quiet-run-2026-12-05c.txt.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import load_file, save_file

import parallel_dcp
from parallel_dcp.benchmark.disk import drop_caches
from parallel_dcp.benchmark.measure import Case
from parallel_dcp.benchmark.read_peers import fresh_row, limit_rows, peer_rows, plain_rows, version
from parallel_dcp.benchmark.writers import flat_tensors

__all__ = ["read_cases", "read_summary"]

_SHARDS = 4
_PAGE = 4096
STOCK = "stock load_file + touch [hf]"


def _write_folder(flat: dict[str, torch.Tensor], folder: str) -> list[str]:
    """A Hugging Face folder of ``_SHARDS`` shards of about equal bytes, with its index."""
    os.makedirs(folder)
    total = sum(t.nbytes for t in flat.values())
    shards: list[dict[str, torch.Tensor]] = [{}]
    held = 0
    for key, tensor in flat.items():
        if held >= total * len(shards) / _SHARDS and len(shards) < _SHARDS:
            shards.append({})
        shards[-1][key] = tensor.contiguous()
        held += tensor.nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for name, part in zip(names, shards, strict=True):
        save_file(part, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, name)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f)
    return [os.path.join(folder, n) for n in names]


def _cold(files: list[str]) -> Callable[[], bool]:
    """Before each run: the page cache dropped (root), and each file's pages dropped (anyone)."""

    def prepare() -> bool:
        dropped = drop_caches()
        for name in files:
            fd = os.open(name, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return dropped

    return prepare


def _touch(tensors: dict[str, torch.Tensor]) -> None:
    """Read one byte of every page (a mapped tensor's pages come from the disk only then)."""
    for tensor in tensors.values():
        if tensor.numel():
            tensor.reshape(-1).view(torch.uint8)[::_PAGE].sum()


def read_cases(state_dict: Any, root: str, workers: int) -> tuple[list[Case], list[str]]:
    """Every row of the read suite at ``workers`` (see the module docstring); writes both copies
    under ``root`` first (untimed)."""
    n = workers
    flat = flat_tensors(state_dict)
    folder, ckpt = os.path.join(root, "hf"), os.path.join(root, "ckpt")
    shards = _write_folder(flat, folder)
    parallel_dcp.save(state_dict, ckpt, workers=n)
    distcp = sorted(os.path.join(ckpt, name) for name in os.listdir(ckpt) if name.endswith(".distcp"))
    prepare = _cold(shards + distcp)
    limits = {tag: f"plain read x{n} direct [{tag}]" for tag in ("hf", "dcp")}

    def ours(path: str, **options: Any) -> Callable[[str], dict[str, Any]]:
        def run(out: str) -> dict[str, Any]:
            stats = parallel_dcp.ReadStats()
            loaded = parallel_dcp.load(path, workers=n, stats=stats, **options)
            choice = stats.read_choice
            return {
                "tensors": len(loaded),
                "fallback": stats.fallback,
                "read_io": choice.reads if choice is not None else None,
                "read_choice": choice.summary() if choice is not None else None,
            }

        return run

    def stock(out: str) -> dict[str, Any]:
        loaded: dict[str, torch.Tensor] = {}
        for shard in shards:
            loaded |= load_file(shard)
        _touch(loaded)
        return {"tensors": len(loaded)}

    def stock_dcp(out: str) -> None:
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        _load_state_dict_from_keys(storage_reader=FileSystemReader(ckpt))

    cases: list[Case] = []
    for tag, path in (("hf", folder), ("dcp", ckpt)):
        for label, options in (("", {}), (" io=buffered", {"io": "buffered"}), (" io=direct", {"io": "direct"})):
            cases.append(
                Case(
                    name=f"load w={n}{label} [{tag}]",
                    family=f"load{label} [{tag}]",
                    procs=n,
                    run=ours(path, **options),
                    prepare=prepare,
                    baseline=STOCK,
                    limit=limits[tag],
                    core=not label,  # io=direct is refused where the file system has no O_DIRECT
                )
            )
        if tag == "hf":
            cases.append(
                Case(
                    name=STOCK,
                    family="stock load_file",
                    procs=1,
                    run=stock,
                    prepare=prepare,
                    baseline=STOCK,
                    limit=limits[tag],
                )
            )
            cases += peer_rows(shards, STOCK, limits[tag], prepare)
        else:
            cases.append(
                Case(
                    name="stock dcp alloc load [dcp]",
                    family="stock dcp",
                    procs=1,
                    run=stock_dcp,
                    prepare=prepare,
                    baseline=STOCK,
                    limit=limits[tag],
                )
            )
        cases += limit_rows(tag, shards if tag == "hf" else distcp, n, prepare)
    notes = [
        f"[hf]: {len(shards)} safetensors shards with their index; [dcp]: the same tensors saved by parallel_dcp",
        "cold: before each run, echo 3 > /proc/sys/vm/drop_caches (when root) and posix_fadvise(DONTNEED)"
        " on every file",
        f"peers: fastsafetensors {version('fastsafetensors') or '(absent)'} on the CPU (nogds; direct = its default,"
        " buffered = FASTSAFETENSORS_ODIRECT=0), Run:ai model streamer"
        f" {version('runai-model-streamer') or '(absent)'} (its defaults)",
        "x stock: over stock load_file + touch (safetensors' mmap, one byte of every page read); of limit: over"
        " the plain direct read (a file per thread); the summary holds each copy to its best plain read",
        "order: each round runs the rows in its own seeded order (a buffered read's cost here depends on what"
        " ran just before it; see reading.py)",
        "fio's rows time fio's start-up too; the summary's best plain read takes fio's own runtime (its median,"
        " warm-up runs included) beside the plain reads' medians",
    ]
    return cases, notes


def read_summary(rows: dict[str, dict[str, Any]], workers: int) -> dict[str, Any]:
    """Per copy: our default load's time against the best plain read (its share of the limit),
    stock load_file + touch, and every peer that ran."""

    def median(name: str) -> float | None:
        value = rows.get(name, {}).get("median_s")
        return float(value) if value else None

    n = workers
    result: dict[str, Any] = {"workers": n}
    stock = median(STOCK)
    peers = [name for name in rows if name.startswith(("fastsafetensors", "Run:ai"))]
    for tag in ("hf", "dcp"):
        fio = rows.get(f"fio direct x{n} [{tag}]", {}).get("details", {}).get("fio_seconds") or []
        limits = {f"fio direct x{n} [{tag}] (job time)": statistics.median(fio) if fio else None}
        limits |= {name: median(name) for name in plain_rows(tag, n)}
        timed_limits = {name: t for name, t in limits.items() if t}
        best_name = min(timed_limits, key=timed_limits.__getitem__, default=None)
        best = timed_limits[best_name] if best_name else None
        ours = median(f"load w={n} [{tag}]")
        timed = {p: t for p in peers if (t := median(p))} if tag == "hf" else {}
        fresh = median(fresh_row(tag, n))
        result[tag] = {
            "fresh_plain_read_s": fresh,
            "share_of_fresh_plain_read": fresh / ours if fresh and ours else None,
            "read_choice": rows.get(f"load w={n} [{tag}]", {}).get("details", {}).get("read_choice"),
            "best_plain_read": best_name,
            "best_plain_read_s": best,
            "share_of_best_plain_read": best / ours if best and ours else None,
            "vs_stock_load_file": stock / ours if stock and ours else None,
            "vs_peers": {p: t / ours for p, t in timed.items()} if ours else {},
        }
    return result


def read_summary_lines(s: dict[str, Any]) -> list[str]:
    def num(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    n, lines = s["workers"], []
    for tag in ("hf", "dcp"):
        r = s.get(tag, {})
        lines.append(
            f"[{tag}] load w={n} (defaults) of the best plain read: {num(r.get('share_of_best_plain_read'), '.0%')}"
            f" (target >= 95%; {r.get('best_plain_read') or 'none ran'}); vs stock load_file + touch:"
            f" {num(r.get('vs_stock_load_file'), '.2f')}x (target >= 1x)"
        )
        if r.get("share_of_fresh_plain_read"):
            lines.append(
                f"[{tag}] load w={n} (defaults) of the same queued read into fresh memory (what a reader that hands"
                f" out new tensors pays for their pages): {num(r['share_of_fresh_plain_read'], '.0%')}"
            )
        if r.get("read_choice"):
            lines.append(f"[{tag}] load w={n} (defaults) {r['read_choice']}")
        for peer, ratio in r.get("vs_peers", {}).items():
            lines.append(f"[{tag}] load w={n} vs {peer}: {num(ratio, '.2f')}x (target >= 1x)")
    return lines
