"""50,000 small records, load(into=): before (base tree) vs after (this branch) vs stock dcp.load, interleaved.

Usage: flock LOCK python bench/bench_small_records.py CKPT_ROOT BASE_TREE AFTER_TREE REPS STOCK_REPS
(STOCK_REPS 0: no stock dcp.load rows; each row also prints what the shard prefetch decided and
what the plan was read from: the side index, or .metadata and why, ReadStats.index)
CKPT_ROOT holds ``stock/`` (written by ``dcp.save(thread_count=2)``) and ``pdcp/`` (by
``parallel_dcp.save(workers=2)``) of ``synthetic.many_small(50000)``; BASE_TREE and AFTER_TREE are
source trees holding ``parallel_dcp/`` (AFTER_TREE also its ``.venv``).
Two long-lived worker processes (before: PYTHONPATH=BASE_TREE; after: AFTER_TREE) take turns;
each row's load runs in its worker, its stages timed on the main thread by wrappers (perf_counter),
and the process CPU time of the whole load. Cold rows drop the page cache first (root). `into` is
allocated once per worker and writer and reused (its pages faulted in by the warm-up round).
With AFTER_CKPT_ROOT set, the *after* rows (and stock ``dcp.load``) read their checkpoints from
there instead: a ``pdcp/`` written by the after tree's own writer (``stock/`` the same one).
"""

import json
import os
import statistics
import subprocess
import sys
import time

WORKER = r"""
import sys, time, json, functools, os, gc, warnings
warnings.filterwarnings("ignore")
import torch
import parallel_dcp
from parallel_dcp.synthetic import many_small
from parallel_dcp.jobs import load as jl
from parallel_dcp.storage import metadata as sm
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader
cur = {}
def wrap(mod, name, label):
    f = getattr(mod, name, None)
    if f is None:
        return
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            cur[label] = cur.get(label, 0.0) + time.perf_counter() - t
    setattr(mod, name, g)
wrap(jl, "read_metadata", "metadata")            # before
wrap(jl, "read_metadata_columns", "metadata")    # after
wrap(jl, "read_index_or_metadata", "metadata")    # after, with the side index
wrap(jl, "read_index_or_metadata_use", "metadata")  # after, saying whether the index was used
wrap(sm, "check_metadata", "metadata check")
try:  # after: the side index's checks (storage/side_index_read.py)
    from parallel_dcp.storage import side_index_read as sir
    wrap(sir, "parse_index", "metadata check")
except ImportError:
    pass
wrap(jl, "_flatten_into", "flatten into")
for name in ("_requests", "_small_records", "_small_targets", "_shard_ends", "check_shards", "check_shard_sizes",
             "plan_requests", "small_records", "small_targets", "shard_ends"):  # (names since jobs/load_plan.py)
    wrap(jl, name, "plan")
wrap(jl.fast_read, "read_requests", "read+check+fill")
_plan = getattr(jl, "plan_prefetch", None)
if _plan is not None:  # what the shard prefetch decided (storage/prefetch.py): MiB asked for, or why none
    def _recorded(*a, **k):
        p = _plan(*a, **k)
        cur["prefetch MiB"] = p.nbytes / 2**20
        cur["why"] = p.reason
        return p
    jl.plan_prefetch = _recorded
sd = many_small(50000)
intos = {}
def fresh():
    state = sd["optimizer"]["state"]
    empty = {k: {n: torch.empty_like(t) for n, t in v.items()} for k, v in state.items()}
    return {"optimizer": {"state": empty, "param_groups": sd["optimizer"]["param_groups"]}}
print("ready", parallel_dcp.__file__, flush=True)
for line in sys.stdin:
    kind, mode, path = line.split()
    into = intos.get(kind) or intos.setdefault(kind, fresh())
    if mode == "cold":
        os.system("sync; echo 3 > /proc/sys/vm/drop_caches")
    elif mode == "warm":
        # the cold rows before dropped this checkpoint's pages, and a read with O_DIRECT leaves
        # none behind: read it through the page cache first, or a warm row is a cold one
        for name in os.listdir(path):
            with open(os.path.join(path, name), "rb") as f:
                while f.read(8 << 20):
                    pass
    cur.clear()
    gc.collect()
    c = time.process_time()
    t = time.perf_counter()
    if mode == "stock":
        dcp.load(into, storage_reader=FileSystemReader(path), no_dist=True)
    else:
        stats = parallel_dcp.ReadStats()
        parallel_dcp.load(path, into=into, workers=2, stats=stats)
    cur["TOTAL"] = time.perf_counter() - t
    cur["CPU"] = time.process_time() - c
    if mode != "stock" and getattr(stats, "index", None) is not None:  # (a base tree may not report it)
        cur["index"] = stats.index.summary()  # (not "plan": that is the plan stage's seconds)
    print(json.dumps(cur), flush=True)
"""
N = 50000
STAGES = ["TOTAL", "CPU", "metadata", "metadata check", "flatten into", "plan", "read+check+fill"]


def main() -> None:
    root, base, after, reps, stock_reps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    roots = {"before": root, "after": os.environ.get("AFTER_CKPT_ROOT", root)}
    py = f"{after}/.venv/bin/python"
    workers = {}
    for name, tree in (("before", base), ("after", after)):
        env = dict(os.environ, PYTHONPATH=tree)
        workers[name] = subprocess.Popen(
            [py, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tree
        )
        print(name, workers[name].stdout.readline().strip(), flush=True)
    rows = [
        (code, kind, mode)
        for kind in ("stock", "pdcp")
        for code, mode in (
            ("before", "warm"),
            ("after", "warm"),
            ("before", "cold"),
            ("after", "cold"),
            ("after", "stock"),
        )
        if stock_reps or mode != "stock"
    ]
    results: dict = {row: [] for row in rows}
    print("checkpoints:", roots, flush=True)
    print("load at start:", os.getloadavg(), time.strftime("%H:%M:%S UTC", time.gmtime()), flush=True)
    for rep in range(reps + 1):  # round 0: warm-up (faults in the into= tensors), not counted
        for code, kind, mode in rows:
            if mode == "stock" and not 1 <= rep <= stock_reps:
                continue
            w = workers[code]
            w.stdin.write(f"{kind} {mode} {roots[code]}/{kind}\n")
            w.stdin.flush()
            out = json.loads(w.stdout.readline())
            if rep:
                results[(code, kind, mode)].append(out)
            print(
                rep,
                code,
                kind,
                mode,
                f"{out['TOTAL'] / N * 1e6:.1f} us/rec, cpu {out['CPU'] / N * 1e6:.1f}",
                f"prefetch {out.get('prefetch MiB')} {out.get('why', '')}",
                out.get("index", ""),
                flush=True,
            )
    print("load at end:", os.getloadavg(), time.strftime("%H:%M:%S UTC", time.gmtime()), flush=True)
    for w in workers.values():
        w.stdin.close()
        w.wait()
    print()
    print(
        f"50,000 small records (synthetic.many_small), load(into=), workers=2; medians of {reps} "
        f"(stock dcp.load: {stock_reps}), us per record"
    )
    print("stages: main-thread wall time inside each; CPU: process CPU time (all threads) of the whole load")
    print(f"{'row':34}" + "".join(f"{s:>17}" for s in STAGES))
    summary = {}
    for (code, kind, mode), outs in results.items():
        med = {s: statistics.median(o.get(s, 0.0) for o in outs) / N * 1e6 for s in STAGES}
        label = f"[{kind}] {'stock dcp.load' if mode == 'stock' else f'load(into=) {code} {mode}'}"
        summary[label] = med
        cells = (
            "".join(f"{med[s]:17.2f}" for s in STAGES) if mode != "stock" else f"{med['TOTAL']:17.2f}{med['CPU']:17.2f}"
        )
        print(f"{label:34}" + cells)
    for kind in ("stock", "pdcp"):
        for mode in ("warm", "cold"):
            b = summary[f"[{kind}] load(into=) before {mode}"]["TOTAL"]
            a = summary[f"[{kind}] load(into=) after {mode}"]["TOTAL"]
            stock = summary.get(f"[{kind}] stock dcp.load")
            versus = f"; stock dcp.load {stock['TOTAL']:.2f} ({stock['TOTAL'] / a:.2f}x)" if stock else ""
            print(f"[{kind}] {mode}: after {a:.2f} us/rec, before {b:.2f} ({b / a:.2f}x){versus}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
