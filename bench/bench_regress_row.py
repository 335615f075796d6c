"""One timed row of bench/bench_regress_ab.sh in a fresh process (run as root: it drops the page cache):
``PYTHONPATH=TREE python bench/bench_regress_row.py KIND DIR`` prints "wall_seconds cpu_seconds"; KIND is
llm_save (1 GiB LLM-like to DIR, w=2, fsync), llm_load (its cold load(into=)), small_save (50,000 small
tensors to tmpfs) or stock_save (dcp.save, thread_count=2)."""

import os
import shutil
import sys
import time

import torch

import parallel_dcp
from parallel_dcp.synthetic import llm_like, many_small

kind, d = sys.argv[1], sys.argv[2]


def drop():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


if kind in ("llm_save", "stock_save"):
    sd = llm_like(1.0)
    out = os.path.join(d, kind)
    shutil.rmtree(out, ignore_errors=True)
    if kind == "llm_save":
        # a warm-up save elsewhere first (workers' imports), as a user's second save
        parallel_dcp.save(llm_like(0.01), os.path.join(d, "warm"), workers=2, overwrite=True)
        drop()
        s = timed(lambda: parallel_dcp.save(sd, out, workers=2))
    else:
        import torch.distributed.checkpoint as dcp

        drop()
        s = timed(lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(out, thread_count=2, sync_files=True)))
elif kind == "llm_load":
    out = os.path.join(d, "llm_save")
    sd = {k: torch.empty_like(v) for k, v in llm_like(1.0).items()}
    drop()
    s = timed(lambda: parallel_dcp.load(out, into=sd, workers=2))
elif kind == "small_save":
    sd = many_small(50000)
    out = os.path.join("/dev/shm/regress", "small")
    shutil.rmtree(out, ignore_errors=True)
    parallel_dcp.save(many_small(100), "/dev/shm/regress/warm", workers=2, overwrite=True)
    s = timed(lambda: parallel_dcp.save(sd, out, workers=2))
    shutil.rmtree(out, ignore_errors=True)
print(f"{s[0]:.4f} {s[1]:.4f}")
