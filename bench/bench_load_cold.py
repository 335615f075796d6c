"""The cold read rows of ``bench --suite disk`` alone: ``load(into=)`` and ``FastReader`` of a
checkpoint written by parallel_dcp and of one written by stock ``dcp.save(thread_count=N)``,
beside stock ``dcp.load`` and the plain parallel reads of the same shards (the limit), plus a
``load`` into fresh tensors (defaults) of each.

python bench/bench_load_cold.py --gib 2 --workers 2 --reps 5 --dir /work/tmp/x

The disk suite runs its save and convert rows first (longer than a benchmark lock's turn on a
shared machine); these rows are built by the same code (parallel_dcp/benchmark/disk.py), run
interleaved, the page cache dropped before each (root). Medians; "x stock" is stock dcp.load's
median over the row's, "of limit" the best plain read's median over the row's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import parallel_dcp
from parallel_dcp.benchmark.disk import _choice_details, _read_cases, drop_caches
from parallel_dcp.benchmark.measure import Case, run_interleaved
from parallel_dcp.synthetic import llm_like


def _fresh(ckpt: str, n: int) -> Callable[[str], dict[str, Any]]:
    def run(out: str) -> dict[str, Any]:
        stats = parallel_dcp.ReadStats()
        parallel_dcp.load(ckpt, workers=n, stats=stats)
        return _choice_details(stats.read_choice)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    n = args.workers
    root = tempfile.mkdtemp(prefix="bench-load-cold-", dir=args.dir)
    try:
        sd = llm_like(args.gib)
        ours, stock = os.path.join(root, "ckpt"), os.path.join(root, "stock-ckpt")
        parallel_dcp.save(sd, ours, workers=n)
        dcp_save(sd, storage_writer=FileSystemWriter(stock, thread_count=n), no_dist=True)
        del sd
        targets = parallel_dcp.load(ours, workers=n)  # where io="auto" measures, once, at the rows' thread count
        cold = ""
        cases: list[Case] = []
        for ckpt, label in ((ours, ""), (stock, " (stock-written)")):
            rows = _read_cases(ckpt, label, targets, n, cold)
            fresh = Case(
                name=f"load w={n}{label}",
                family=("stock-written " if label else "") + "load",
                procs=n,
                run=_fresh(ckpt, n),
                prepare=drop_caches,
                baseline=f"stock dcp.load{label}",
                limit=f"plain read x{n} direct{label}",
            )
            cases += [fresh, *rows]
        results = run_interleaved(cases, args.reps, 1, root)
        print(os.popen("uptime").read().strip())
        medians = {m.case.name: statistics.median(m.walls) for m in results if m.walls}
        print(
            f"{'row':44s} {'median s':>8s} {'min s':>6s} {'max s':>6s} {'cpu s':>6s} {'x stock':>7s} {'of limit':>8s}"
        )
        for m in results:
            if not m.walls:
                print(f"{m.case.name:44s} error: {m.error}")
                continue
            name, median = m.case.name, medians[m.case.name]
            base = medians.get(m.case.baseline or "")
            label = " (stock-written)" if "(stock-written)" in name else ""
            limit = min(medians.get(f"plain read x{n} {kind}{label}", float("inf")) for kind in ("direct", "buffered"))
            x_stock = f"{base / median:.2f}x" if base and m.case.baseline != name else "-"
            of_limit = f"{limit / median:.0%}" if m.case.limit else "-"
            cpu = statistics.median(m.cpus) if m.cpus else float("nan")
            figures = (f"{median:.3f}", f"{min(m.walls):.3f}", f"{max(m.walls):.3f}", f"{cpu:.2f}", x_stock, of_limit)
            print(f"{name:44s} " + " ".join(f"{f:>8s}" for f in figures))
            if m.details.get("read_io"):
                print(f"    read: {m.details}")
        print("of limit: the faster of the plain direct and buffered parallel reads of the same shards")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
