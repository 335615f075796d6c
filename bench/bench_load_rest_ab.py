"""load(into=) of 50,000 small records: the base tree's load job vs this tree's, in ONE process, alternating.

Usage: flock LOCK python bench/bench_load_rest_ab.py CKPT_ROOT BASE_TREE KIND MODE REPS
(KIND: ``pdcp`` or ``stock``, the sub-folder of CKPT_ROOT, as for bench_small_records.py; MODE:
``warm`` or ``cold`` (page cache dropped before each load: root).)

On a machine shared with other jobs, two processes taking turns (bench_small_records.py) see
different neighbours; here both codes run in one process, the same ``into``, one load after the
other. The base tree's ``jobs/load.py`` is loaded beside this tree's with its own
``formats/validate.py``, ``fast_read.py``, ``small_reads.py`` and ``scatter_read.py`` (what this
round changed); everything below (``.metadata``, its check) is this tree's in both. Prints each
code's wall time and main-thread CPU time of the whole load (medians, mins), us per record.
"""

import gc
import importlib.util
import os
import statistics
import sys
import time
import warnings
from types import ModuleType

import torch

from parallel_dcp.jobs import load as new
from parallel_dcp.options import Options
from parallel_dcp.synthetic import many_small

N = 50000


def module(name: str, path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded  # (dataclasses look their module up)
    spec.loader.exec_module(loaded)
    return loaded


def base_load(tree: str) -> ModuleType:
    base = f"{tree}/parallel_dcp/"
    scatter = module("base_scatter_read", base + "formats/scatter_read.py")
    small = module("base_small_reads", base + "formats/small_reads.py")
    small.read_scattered = scatter.read_scattered  # type: ignore[attr-defined]
    fast = module("base_fast_read", base + "formats/fast_read.py")
    fast.small_units, fast.SmallUnit = small.small_units, small.SmallUnit  # type: ignore[attr-defined]
    validate = module("base_validate", base + "formats/validate.py")
    job = module("base_load", base + "jobs/load.py")
    job.flatten_structure, job.fast_read, job.small_reads = validate.flatten_structure, fast, small  # type: ignore[attr-defined]
    return job


def main() -> None:
    warnings.filterwarnings("ignore")
    root, tree, kind, mode, reps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    path = f"{root}/{kind}"
    codes = {"before": base_load(tree), "after": new}
    sd = many_small(N)
    state = sd["optimizer"]["state"]
    empty = {k: {n: torch.empty_like(t) for n, t in v.items()} for k, v in state.items()}
    into = {"optimizer": {"state": empty, "param_groups": sd["optimizer"]["param_groups"]}}
    del sd, state
    options = Options(workers=2)
    walls: dict[str, list[float]] = {name: [] for name in codes}
    cpus: dict[str, list[float]] = {name: [] for name in codes}
    print("load at start:", os.getloadavg(), time.strftime("%H:%M:%S UTC", time.gmtime()), flush=True)
    for rep in range(reps + 1):  # round 0: warm-up, not counted
        for name, code in codes.items():
            if mode == "cold":
                os.system("sync; echo 3 > /proc/sys/vm/drop_caches")
            else:  # through the page cache first (an earlier cold round dropped it)
                for file in os.listdir(path):
                    with open(os.path.join(path, file), "rb") as f:
                        while f.read(8 << 20):
                            pass
            gc.collect()
            cpu, wall = time.thread_time(), time.perf_counter()
            code.load(path, None, options, into=into)
            pending = [[] for _ in range(1000)]  # a collection the load left pending runs here  # noqa: F841
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            if rep:
                walls[name].append(wall / N * 1e6)
                cpus[name].append(cpu / N * 1e6)
    print("load at end:", os.getloadavg(), time.strftime("%H:%M:%S UTC", time.gmtime()))
    for name in codes:
        wall_s, cpu_s = walls[name], cpus[name]
        print(
            f"[{kind}] {mode} {name:6} wall median {statistics.median(wall_s):6.2f} (min {min(wall_s):6.2f}) | "
            f"main-thread CPU median {statistics.median(cpu_s):6.2f} (min {min(cpu_s):6.2f}) us/rec"
        )
    before, after = statistics.median(walls["before"]), statistics.median(walls["after"])
    print(f"[{kind}] {mode} wall: before/after {before / after:.2f}x, {before - after:+.2f} us/rec")


if __name__ == "__main__":
    main()
