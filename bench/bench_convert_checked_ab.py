"""Interleaved A/B of convert of a checksummed 1 GiB source (32 x 32 MiB float32), two trees.

Usage: python bench/bench_convert_checked_ab.py ROOT BASE_TREE AFTER_TREE REPS [--cold] [CASE ...]

Each timed convert runs in a fresh interpreter whose PYTHONPATH is one tree, and times only the
``convert`` call (not the imports). Cases (workers=2, the source and the destination under ROOT):
``dcp`` (DCP of two shards -> DCP: each task reads one shard whole), ``safetensors`` (one file ->
DCP: its tensors split between the tasks). Each case runs three variants, interleaved in a rotating
order: ``base`` and ``after`` (the two trees, checking the source as each does) and ``unchecked``
(the after tree with ``check_source=False``: what the check itself costs). ``--cold`` drops the
page cache before each timed run (as root: ``sync; echo 3 > /proc/sys/vm/drop_caches``), for a
source on a disk; without it the first round warms the cache and is dropped. Each case prints the
medians of wall seconds and of CPU seconds (the converting process and its reaped workers: less
swayed by other processes on a shared machine than wall time), and the 1-minute load average
seen before each run.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys

CHILD = r"""
import resource, sys, time, parallel_dcp
src, dst, check = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
def cpu():
    who = (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, who))
c, t = cpu(), time.perf_counter()
parallel_dcp.convert(src, dst, workers=2, check_source=check)
print(time.perf_counter() - t, cpu() - c)
"""

SETUP = r"""
import sys, torch, parallel_dcp
root = sys.argv[1]
g = torch.Generator().manual_seed(0)
sd = {f"layers.{i}.w": torch.randn(4096, 2048, generator=g) for i in range(32)}
parallel_dcp.save(sd, f"{root}/src_dcp", workers=2)
parallel_dcp.convert(f"{root}/src_dcp", f"{root}/src.safetensors", workers=2)
"""

SOURCES = {"dcp": "src_dcp", "safetensors": "src.safetensors"}


def _run(tree: str, code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": tree, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True, env=env)
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def _drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _load() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--cold"]
    cold = "--cold" in sys.argv
    root, base, after, reps = args[0], args[1], args[2], int(args[3])
    cases = args[4:] or list(SOURCES)
    os.makedirs(root, exist_ok=True)
    if not os.path.exists(f"{root}/src.safetensors"):
        _run(after, SETUP, root)
    variants = {"base": (base, "1"), "after": (after, "1"), "unchecked": (after, "0")}
    for case in cases:
        src = f"{root}/{SOURCES[case]}"
        times: dict[str, list[float]] = {name: [] for name in variants}
        cpus: dict[str, list[float]] = {name: [] for name in variants}
        loads: list[float] = []
        for rep in range(reps + (0 if cold else 1)):  # warm: the first round fills the cache, dropped
            names = list(variants)
            order = names[rep % 3 :] + names[: rep % 3]
            for name in order:
                shutil.rmtree(f"{root}/out", ignore_errors=True)
                if cold:
                    _drop_caches()
                loads.append(_load())
                tree, check = variants[name]
                seconds, cpu = map(float, _run(tree, CHILD, src, f"{root}/out", check).split())
                if cold or rep:
                    times[name].append(seconds)
                    cpus[name].append(cpu)
        shutil.rmtree(f"{root}/out", ignore_errors=True)
        for what, found in (("wall", times), ("CPU", cpus)):
            med = {name: statistics.median(values) for name, values in found.items()}
            shown = {name: [round(v, 3) for v in values] for name, values in found.items()}
            print(
                f"{case} -> DCP{' (cold)' if cold else ''}, {what}: base {med['base']:.3f} s, after "
                f"{med['after']:.3f} s, unchecked {med['unchecked']:.3f} s; "
                f"after/base {med['after'] / med['base']:.3f}, "
                f"after/unchecked {med['after'] / med['unchecked']:.3f} (medians of {len(found['base'])}; "
                f"load {min(loads):.1f}-{max(loads):.1f}, median {statistics.median(loads):.1f})\n  {shown}",
                flush=True,
            )


if __name__ == "__main__":
    main()
