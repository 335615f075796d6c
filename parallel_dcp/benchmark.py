"""``parallel-dcp bench``: parallel_dcp.save against stock dcp.save and a plain parallel write.

Same state dict, same run, configurations interleaved (A B C ... A B C ...), medians of several
repetitions, ratios computed from those medians. Prints a table and optionally writes JSON.

    parallel-dcp bench --gib 2 --reps 5 --dir /dev/shm
    parallel-dcp bench --small 50000 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import parallel_dcp
from parallel_dcp.synthetic import llm_like, many_small, tensor_bytes


def _flat_tensors(sd: Any) -> list[torch.Tensor]:
    if isinstance(sd, torch.Tensor):
        return [sd]
    if isinstance(sd, dict):
        return [t for v in sd.values() for t in _flat_tensors(v)]
    if isinstance(sd, list):
        return [t for v in sd for t in _flat_tensors(v)]
    return []


def plain_write(tensors: list[torch.Tensor], out: str, writers: int) -> None:
    """The limit: ``writers`` forked processes write ready buffers (no serialization), fsynced."""
    os.makedirs(out)
    shares: list[list[torch.Tensor]] = [[] for _ in range(writers)]
    sizes = [0] * writers
    for t in sorted(tensors, key=lambda t: t.nbytes, reverse=True):
        i = sizes.index(min(sizes))
        shares[i].append(t)
        sizes[i] += t.nbytes
    pids = []
    for i, share in enumerate(shares):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                with open(os.path.join(out, f"part{i}"), "wb") as f:
                    for t in share:
                        f.write(t.contiguous().view(torch.uint8).numpy().data)
                    os.fsync(f.fileno())
            except BaseException:
                code = 1
            os._exit(code)
        pids.append(pid)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise RuntimeError("plain writer failed")


def cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def configurations(sd: Any, tensors: list[torch.Tensor], workers: list[int]) -> dict[str, Callable[[str], None]]:
    def stock(threads: int, crc: bool) -> Callable[[str], None]:
        def run(out: str) -> None:
            previous = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(crc)
            try:
                dcp_save(sd, storage_writer=FileSystemWriter(out, thread_count=threads), no_dist=True)
            finally:
                torch.serialization.set_crc32_options(previous)

        return run

    configs: dict[str, Callable[[str], None]] = {}

    def ours(workers: int) -> Callable[[str], None]:
        def run(out: str) -> None:
            parallel_dcp.save(sd, out, workers=workers)

        return run

    for n in workers:
        configs[f"parallel_dcp w={n}"] = ours(n)
    for n in workers:
        configs[f"stock dcp t={n}"] = stock(n, True)
    for n in workers:
        configs[f"stock dcp t={n} crc-off"] = stock(n, False)
    configs[f"plain write x{max(workers)}"] = lambda out: plain_write(tensors, out, max(workers))
    return configs


def measure(sd: Any, workers: list[int], reps: int, directory: str) -> dict[str, Any]:
    tensors = _flat_tensors(sd)
    nbytes = tensor_bytes(sd)
    configs = configurations(sd, tensors, workers)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    root = tempfile.mkdtemp(prefix="pdcp-bench-", dir=directory)
    try:
        for rep in range(reps + 1):  # the first round warms up page cache and allocator
            for name, run in configs.items():
                out = os.path.join(root, "ckpt")
                wall0, cpu0 = time.perf_counter(), cpu_seconds()
                run(out)
                wall, cpu = time.perf_counter() - wall0, cpu_seconds() - cpu0
                shutil.rmtree(out)
                if rep > 0:
                    samples[name].append((wall, cpu))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = {}
    for name, values in samples.items():
        walls = [w for w, _ in values]
        rows[name] = {
            "median_s": statistics.median(walls),
            "min_s": min(walls),
            "max_s": max(walls),
            "gib_per_s": nbytes / 2**30 / statistics.median(walls),
            "cpu_s": statistics.median(c for _, c in values),
        }
    return {"bytes": nbytes, "reps": reps, "dir": directory, "rows": rows}


def report(result: dict[str, Any], workers: list[int]) -> list[str]:
    rows = result["rows"]
    lines = [f"{result['bytes'] / 2**30:.2f} GiB in {result['dir']}, median of {result['reps']}"]
    lines.append(f"{'writer':<28}{'GiB/s':>8}{'median s':>10}{'min s':>8}{'max s':>8}{'cpu s':>8}")
    for name, r in rows.items():
        lines.append(
            f"{name:<28}{r['gib_per_s']:>8.2f}{r['median_s']:>10.3f}{r['min_s']:>8.3f}{r['max_s']:>8.3f}{r['cpu_s']:>8.2f}"
        )
    n = max(workers)
    ours = rows[f"parallel_dcp w={n}"]["median_s"]
    best_stock = min(r["median_s"] for name, r in rows.items() if name.startswith("stock"))
    lines.append(f"speedup vs stock dcp t={n} (defaults): {rows[f'stock dcp t={n}']['median_s'] / ours:.2f}x")
    lines.append(f"speedup vs best stock configuration:   {best_stock / ours:.2f}x")
    lines.append(f"time vs plain {n}-writer write:          {ours / rows[f'plain write x{n}']['median_s']:.2f}x")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gib", type=float, default=1.0, help="size of the LLM-like state dict")
    parser.add_argument("--small", type=int, default=0, help="use N small optimizer-like tensors instead")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    parser.add_argument("--json", help="write the results here")


def run(args: argparse.Namespace) -> int:
    warnings.filterwarnings("ignore")
    sd = many_small(args.small) if args.small else llm_like(args.gib)
    result = measure(sd, args.workers, args.reps, args.dir)
    result["state_dict"] = f"{args.small} small tensors" if args.small else f"LLM-like {args.gib} GiB"
    print("\n".join(report(result, args.workers)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
