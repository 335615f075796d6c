"""``verify`` against what a user does without it: stock ``dcp.load`` of the checkpoint, and for a
conversion, loading the source too and comparing every tensor with ``torch.equal``.

python bench/bench_verify.py --gib 1 --workers 2 --repeat 3 --dir /dev/shm

Four configurations run interleaved, each round once each, on one sharded safetensors source
and its DCP conversion (made untimed first):

- ``verify against``: ``parallel_dcp.verify(dcp, against=safetensors dir)`` (manifest, every key
  read back, bit-for-bit comparison, under the default memory limit);
- ``stock compare``: ``dcp.load`` into tensors shaped from the source, ``load_file`` of every
  shard, ``torch.equal`` per key (what one writes by hand; no checksum, no memory bound);
- ``verify``: ``parallel_dcp.verify(dcp)`` (manifest checksums and every key read back);
- ``stock load``: ``dcp.load`` of every key (reads everything, checks nothing beyond DCP's own).

Medians and ratios (stock time over ours). Timings on a shared, noisy machine: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import parallel_dcp
from parallel_dcp.synthetic import llm_like


def _shards(directory: str) -> list[str]:
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        names = sorted(set(json.load(f)["weight_map"].values()))
    return [os.path.join(directory, name) for name in names]


def _stock_load(ckpt: str, shapes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {key: torch.empty_like(t) for key, t in shapes.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group
        dcp.load(state, checkpoint_id=ckpt, no_dist=True)
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench-verify-", dir=args.dir)
    try:
        src, ckpt = os.path.join(root, "hf"), os.path.join(root, "dcp")
        sd = llm_like(args.gib)
        nbytes = sum(t.nbytes for t in sd.values())
        parallel_dcp.save(sd, os.path.join(root, "first"), workers=args.workers)
        parallel_dcp.convert(os.path.join(root, "first"), src, to="safetensors", shard_size=max(1, nbytes // 4))
        parallel_dcp.convert(src, ckpt, workers=args.workers)
        shapes = {key: torch.empty(t.shape, dtype=t.dtype) for key, t in sd.items()}
        del sd

        def verify_against() -> None:
            report = parallel_dcp.verify(ckpt, against=src, workers=args.workers)
            assert report.ok, report.problems

        def stock_compare() -> None:
            loaded = _stock_load(ckpt, shapes)
            source: dict[str, torch.Tensor] = {}
            for shard in _shards(src):
                source |= load_file(shard)
            assert all(torch.equal(loaded[key], source[key]) for key in shapes)

        def verify_alone() -> None:
            report = parallel_dcp.verify(ckpt, workers=args.workers)
            assert report.ok, report.problems

        def stock_load() -> None:
            _stock_load(ckpt, shapes)

        cases: dict[str, Callable[[], None]] = {
            "verify against": verify_against,
            "stock compare": stock_compare,
            "verify": verify_alone,
            "stock load": stock_load,
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeat + 1):  # the first round warms the page cache
            for name, run in cases.items():
                began = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - began)
        median = {name: statistics.median(found[1:]) for name, found in times.items()}
        print(f"{nbytes / 2**30:.2f} GiB, {args.workers} workers, medians of {args.repeat}:")
        for name, seconds in median.items():
            print(f"  {name:<15} {seconds:7.3f} s")
        print(f"  verify against vs stock compare: {median['stock compare'] / median['verify against']:.2f}x")
        print(f"  verify vs stock load:            {median['stock load'] / median['verify']:.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
