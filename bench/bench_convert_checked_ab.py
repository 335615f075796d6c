"""Interleaved A/B of convert of a checksummed 1 GiB source (32 x 32 MiB float32), two trees.

Usage: python bench/bench_convert_checked_ab.py ROOT BASE_TREE AFTER_TREE REPS

Each timed convert runs in a fresh interpreter whose PYTHONPATH is one tree, and times only the
``convert`` call (not the imports). Cases: DCP -> DCP and safetensors -> DCP, workers=2, the
source and the destination under ROOT. The after tree checks the source's checksums as it reads
(``jobs/source_check.py``); the rows say how many source files each case checked.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys

CHILD = r"""
import sys, time, shutil, parallel_dcp
src, dst = sys.argv[1], sys.argv[2]
t = time.perf_counter(); parallel_dcp.convert(src, dst, workers=2); dt = time.perf_counter() - t
shutil.rmtree(dst, ignore_errors=True)
print(dt)
"""

SETUP = r"""
import sys, torch, parallel_dcp
root = sys.argv[1]
g = torch.Generator().manual_seed(0)
sd = {f"layers.{i}.w": torch.randn(4096, 2048, generator=g) for i in range(32)}
parallel_dcp.save(sd, f"{root}/src_dcp", workers=2)
parallel_dcp.convert(f"{root}/src_dcp", f"{root}/src.safetensors", workers=2)
"""


def _run(tree: str, code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": tree, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True, env=env)
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def main() -> None:
    root, base, after, reps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    os.makedirs(root, exist_ok=True)
    if not os.path.exists(f"{root}/src.safetensors"):
        _run(after, SETUP, root)
    trees = {"base": base, "after": after}
    for case, src in (("DCP -> DCP", f"{root}/src_dcp"), ("safetensors -> DCP", f"{root}/src.safetensors")):
        times: dict[str, list[float]] = {name: [] for name in trees}
        for rep in range(reps + 1):  # the first round warms the page cache and is dropped
            order = list(trees) if rep % 2 == 0 else list(reversed(trees))
            for name in order:
                shutil.rmtree(f"{root}/out", ignore_errors=True)
                seconds = float(_run(trees[name], CHILD, src, f"{root}/out"))
                if rep:
                    times[name].append(seconds)
        med = {name: statistics.median(values) for name, values in times.items()}
        shown = {name: [round(v, 3) for v in values] for name, values in times.items()}
        print(
            f"{case}: base {med['base']:.3f} s, after {med['after']:.3f} s, after/base {med['after'] / med['base']:.3f}"
            f" (medians of {reps}; base {shown['base']}, after {shown['after']})"
        )


if __name__ == "__main__":
    main()
