"""The built-in example behind ``tools/demo``: save an LLM-shaped state dict, prove it loads, convert.

    python -m parallel_dcp.demo [--gib 0.5] [--workers N] [--dir DIR]

Saves the same state dict with ``parallel_dcp.save`` and with stock ``dcp.save`` (its defaults,
two threads), reads ours back with stock ``torch.distributed.checkpoint.load`` and checks it bit
for bit, and prints both throughputs. Then converts the model, as sharded safetensors, to DCP
under a memory limit of a quarter of its size, and verifies the result against the shards.
"""

from __future__ import annotations

import argparse
import shutil
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
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    model = llm_like(args.gib)
    config = {"name": "demo-llm", "lr": 3e-4}
    state_dict: dict[str, Any] = {"model": model, "step": 1000, "config": config}
    nbytes = tensor_bytes(state_dict)
    root = tempfile.mkdtemp(prefix="parallel_dcp-demo-", dir=args.dir)
    try:
        ours = f"{root}/parallel_dcp"
        result = parallel_dcp.save(state_dict, ours, workers=args.workers)
        print(
            f"parallel_dcp.save: {nbytes / 2**30:.2f} GiB, {len(model)} tensors -> {result.files} files "
            f"in {result.seconds:.2f} s = {result.gib_per_s:.2f} GiB/s with {result.workers} workers "
            f"({usable_cores()} usable cores)"
        )

        loaded = {k: torch.empty_like(v) for k, v in model.items()}
        target: dict[str, Any] = {"model": loaded, "step": 0, "config": {"name": "", "lr": 0.0}}
        dcp_load(target, checkpoint_id=ours, no_dist=True)
        same = all(torch.equal(loaded[k], v) for k, v in model.items())
        same = same and target["step"] == 1000 and target["config"] == config
        print(f"stock torch.distributed.checkpoint.load reads it back: {'bit-exact' if same else 'MISMATCH'}")

        stock = f"{root}/stock"
        start = time.perf_counter()
        dcp_save(state_dict, storage_writer=FileSystemWriter(stock, thread_count=2), no_dist=True)
        stock_s = time.perf_counter() - start
        print(f"stock dcp.save (thread_count=2): {stock_s:.2f} s = {nbytes / 2**30 / stock_s:.2f} GiB/s")
        print(
            f"parallel_dcp is {stock_s / result.seconds:.2f}x stock on this machine (one run; see bench/ for medians)"
        )
        return 0 if same and _convert(model, root, args.workers) else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


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
