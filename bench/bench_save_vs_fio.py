"""A 2 GiB LLM-like save to disk (w=2, fsync on) against fio's direct write of as many bytes, by
fio's own job run time and by its wall time (which counts starting fio); interleaved rounds after
one warm-up, medians.

python bench/bench_save_vs_fio.py --dir /work/tmp --rounds 5     (needs fio on PATH)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import torch

import parallel_dcp
from parallel_dcp.benchmark.device import fio_write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="a directory on the disk to measure")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    state_dict = {f"layer{i}.w": torch.randn(4096, 4096, generator=generator).to(torch.bfloat16) for i in range(64)}
    nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    ckpt, fio_dir = os.path.join(args.dir, "save-vs-fio"), os.path.join(args.dir, "save-vs-fio-fio")
    saves, jobs, walls = [], [], []
    for round_ in range(args.rounds + 1):  # round 0 warms up
        began = time.perf_counter()
        parallel_dcp.save(state_dict, ckpt, workers=2)
        save_s = time.perf_counter() - began
        shutil.rmtree(ckpt)
        began = time.perf_counter()
        job_s = fio_write(nbytes, 2, fio_dir)["device_s"]
        wall_s = time.perf_counter() - began
        shutil.rmtree(fio_dir)
        if round_:
            saves.append(save_s)
            jobs.append(job_s)
            walls.append(wall_s)
        print(f"round {round_}: save {save_s:.3f} s, fio {job_s:.3f} s (wall {wall_s:.3f})", flush=True)
    save, job, wall = statistics.median(saves), statistics.median(jobs), statistics.median(walls)
    print(
        f"{nbytes / 2**30:.1f} GiB: save {save:.3f} s, fio job {job:.3f} s, fio wall {wall:.3f} s; "
        f"save at {job / save:.0%} of fio's own rate ({wall / save:.0%} by fio's wall time)"
    )


if __name__ == "__main__":
    main()
