"""The built-in example behind ``tools/demo``: save an LLM-shaped state dict, prove it loads, convert.

    python -m parallel_dcp.demo [--gib 0.5] [--workers N] [--dir DIR]

Saves the same state dict with ``parallel_dcp.save`` and with stock ``dcp.save`` (its defaults,
two threads), alternated at least three times each, and prints the medians, the device's
direct-write limit (a plain O_DIRECT write of the same bytes) and the ratio; when we are not
ahead it says so and why. Reads ours back with stock ``torch.distributed.checkpoint.load`` and
checks it bit for bit. Then converts the model, as sharded safetensors, to DCP
under a memory limit of a quarter of its size, and verifies the result against the shards.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import parallel_dcp
from parallel_dcp.options import usable_cores
from parallel_dcp.synthetic import llm_like, tensor_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_dcp.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=0.5, help="state dict size in GiB (default 0.5)")
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default: every usable core)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--rounds", type=int, default=3, help="saves of each, alternated (default 3, at least 3)")
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error("--rounds must be at least 3: one run of each says nothing on a busy machine")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    model = llm_like(args.gib)
    config = {"name": "demo-llm", "lr": 3e-4}
    state_dict: dict[str, Any] = {"model": model, "step": 1000, "config": config}
    nbytes = tensor_bytes(state_dict)
    root = tempfile.mkdtemp(prefix="parallel_dcp-demo-", dir=args.dir)
    try:
        ours_s, stock_s, result = _race(state_dict, root, args.workers, args.rounds)
        ours = f"{root}/parallel_dcp"
        print(
            f"parallel_dcp.save: {nbytes / 2**30:.2f} GiB, {len(model)} tensors -> {result.files} files, "
            f"median {ours_s:.2f} s = {nbytes / 2**30 / ours_s:.2f} GiB/s with {result.workers} workers "
            f"({usable_cores()} usable cores), io={result.io}"
        )

        loaded = {k: torch.empty_like(v) for k, v in model.items()}
        target: dict[str, Any] = {"model": loaded, "step": 0, "config": {"name": "", "lr": 0.0}}
        dcp_load(target, checkpoint_id=ours, no_dist=True)
        same = all(torch.equal(loaded[k], v) for k, v in model.items())
        same = same and target["step"] == 1000 and target["config"] == config
        print(f"stock torch.distributed.checkpoint.load reads it back: {'bit-exact' if same else 'MISMATCH'}")
        print(f"stock dcp.save (thread_count=2): median {stock_s:.2f} s = {nbytes / 2**30 / stock_s:.2f} GiB/s")
        limit_s = _direct_limit(root, nbytes, result.workers)
        _verdict(ours_s, stock_s, limit_s, nbytes, result, root, args.rounds)
        return 0 if same and _convert(model, root, args.workers) else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _race(state_dict: Any, root: str, workers: int | None, rounds: int) -> tuple[float, float, Any]:
    """Ours and stock dcp.save alternated ``rounds`` times each (the same drift for both); the
    median seconds of each and our last result. The last checkpoint of ours stays for the read-back."""
    ours: list[float] = []
    stock: list[float] = []
    result = None
    for index in range(rounds):
        for kind in ("ours", "stock") if index % 2 == 0 else ("stock", "ours"):
            path = f"{root}/{'parallel_dcp' if kind == 'ours' else 'stock'}"
            shutil.rmtree(path, ignore_errors=True)
            os.sync()  # the previous run's dirty pages are not this run's to write
            start = time.perf_counter()
            if kind == "ours":
                result = parallel_dcp.save(state_dict, path, workers=workers)
            else:
                dcp_save(state_dict, storage_writer=FileSystemWriter(path, thread_count=2), no_dist=True)
            (ours if kind == "ours" else stock).append(time.perf_counter() - start)
    shutil.rmtree(f"{root}/stock", ignore_errors=True)
    return statistics.median(ours), statistics.median(stock), result


def _direct_limit(root: str, nbytes: int, writers: int) -> float | None:
    """Seconds a plain O_DIRECT write of ``nbytes`` by ``writers`` threads takes here (None where
    the file system refuses O_DIRECT)."""
    from parallel_dcp.benchmark.device import direct_write_probe
    from parallel_dcp.storage.io_mode import direct_refusal

    if direct_refusal(root) is not None:
        return None
    out = f"{root}/limit"
    start = time.perf_counter()
    try:
        direct_write_probe(nbytes, max(1, writers), out)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return time.perf_counter() - start


def _verdict(
    ours_s: float, stock_s: float, limit_s: float | None, nbytes: int, result: Any, root: str, rounds: int
) -> None:
    """The ratio, and what it means on this machine, said plainly."""
    from parallel_dcp.storage.io_mode import file_system_type

    ratio = stock_s / ours_s
    gib = nbytes / 2**30
    where = f"{root} ({file_system_type(root) or 'unknown file system'})"
    if limit_s is not None:
        print(
            f"the device's direct-write limit here ({result.workers} O_DIRECT writers, same bytes): "
            f"{limit_s:.2f} s = {gib / limit_s:.2f} GiB/s; parallel_dcp reached {limit_s / ours_s:.0%} of it"
        )
    print(f"parallel_dcp is {ratio:.2f}x stock dcp.save on {where} (medians of {rounds} alternated runs each)")
    if ratio >= 1.1:
        return
    if limit_s is not None and stock_s <= limit_s / 0.9:  # stock at 90% or more of the limit's speed
        cache = (
            " (faster than the device takes direct writes: a cache below the file system absorbs its buffered writes)"
            if stock_s < limit_s
            else ""
        )
        why = (
            f"stock already writes at {limit_s / stock_s:.0%} of the device's direct-write limit here{cache}: "
            "the disk, not the writer, sets the pace"
        )
    elif limit_s is None:
        why = "this file system lives in memory or refuses O_DIRECT: both writers are bound by memory copies"
    else:
        why = (
            "the machine is busy or has few cores: both writers wait on the same CPUs "
            f"({usable_cores()} usable); rerun on a quiet machine, or see parallel-dcp bench --suite disk"
        )
    print(f"parallel_dcp is not ahead on this machine: {why}")


def _convert(model: dict[str, torch.Tensor], root: str, workers: int | None) -> bool:
    """safetensors shards -> DCP under a quarter of the model's size, then verify; True when equal."""
    from parallel_dcp.engine.memory import format_bytes

    nbytes = tensor_bytes(model)
    shards = f"{root}/hf-model"
    parallel_dcp.save(model, f"{root}/model-dcp", workers=workers)
    parallel_dcp.convert(f"{root}/model-dcp", shards, to="safetensors", shard_size=max(nbytes // 4, 1), workers=workers)
    limit = max(nbytes // 4, 256 * 2**20)
    result = parallel_dcp.convert(shards, f"{root}/converted", workers=workers, memory_limit=limit)
    assert isinstance(result, parallel_dcp.SaveResult)
    print(
        f"parallel_dcp.convert: safetensors shards -> DCP, {format_bytes(result.bytes)} in {result.seconds:.2f} s "
        f"= {result.gib_per_s:.2f} GiB/s, peak memory {format_bytes(result.peak_memory)} "
        f"under a limit of {format_bytes(limit)}"
    )
    report = parallel_dcp.verify(f"{root}/converted", against=shards, workers=workers, memory_limit=limit)
    print(
        f"parallel_dcp.verify: {report.files_checked} checksums and {report.keys_checked} tensors against "
        f"the shards: {'OK' if report.ok else 'FAILED: ' + '; '.join(report.problems[:3])}"
    )
    return report.ok


if __name__ == "__main__":
    sys.exit(main())
