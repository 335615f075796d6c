"""A load beside one busy Python thread in the caller: 1 GiB DCP checkpoint (64 bf16 tensors) in DIR
(on tmpfs no device: what the GIL costs shows whole; on a disk with COLD=1: the device), ``load``
into fresh tensors and ``load(into=)``,
alone, beside a busy thread of the same process (the GIL and a core), and beside a busy separate
process (a core only: the control). With COLD=1 in the environment (as root) the page cache is
dropped before each load. Each source tree's rows run in one process of their own
(``PYTHONPATH=TREE``), the trees taking turns round by round; medians of ROUNDS.

    python bench/bench_busy_load.py DIR [ROUNDS [TREE ...]]    (default: this tree)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ONE = r"""
import json, os, subprocess, sys, threading, time, torch, parallel_dcp
path, rounds = sys.argv[1], int(sys.argv[2])
cold = os.environ.get("COLD") == "1"
def spin(stop):
    x = 0
    while not stop.is_set():
        x += 1
into = {k: torch.empty_like(v) for k, v in parallel_dcp.load(path, workers=2).items()}
parallel_dcp.load(path, into=into, workers=2)  # warm: the pages of `into` faulted in
out = {}
for _ in range(rounds):
    for kind in ("fresh", "into"):
        for mode in ("alone", "thread", "process"):
            stop, th, busy = threading.Event(), None, None
            if mode == "thread":
                th = threading.Thread(target=spin, args=(stop,), daemon=True)
                th.start()
            elif mode == "process":
                busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            if cold:
                subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=True)
            time.sleep(0.2)
            t = time.perf_counter()
            if kind == "into":
                parallel_dcp.load(path, into=into, workers=2)
            else:
                sd = parallel_dcp.load(path, workers=2)
                del sd
            out.setdefault(f"{kind} {mode}", []).append(time.perf_counter() - t)
            stop.set()
            if th is not None:
                th.join()
            if busy is not None:
                busy.kill()
                busy.wait()
print(json.dumps(out))
"""


def main() -> None:
    where = Path(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    trees = [Path(t).resolve() for t in sys.argv[3:]] or [ROOT]
    ckpt = where / "busy-load-ckpt"
    if not (ckpt / ".metadata").exists():
        make = (
            "import sys, torch, parallel_dcp; g = torch.Generator().manual_seed(0); "
            "parallel_dcp.save({f'l{i}.w': torch.randn(2048, 4096, generator=g).bfloat16() for i in range(64)}, "
            "sys.argv[1], workers=2)"
        )
        subprocess.run([sys.executable, "-c", make, str(ckpt)], env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True)
    got: dict[Path, dict[str, list[float]]] = {tree: {} for tree in trees}
    for _ in range(rounds):
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=str(tree))
            run = subprocess.run([sys.executable, "-c", ONE, str(ckpt), "1"], env=env, check=True, capture_output=True)
            for row, times in json.loads(run.stdout).items():
                got[tree].setdefault(row, []).extend(times)
    for tree, rows in got.items():
        medians = {row: statistics.median(times) for row, times in rows.items()}
        print(f"tree {tree}")
        for row, median in medians.items():
            print(f"  {row:14} median {median:.3f} s  {[round(x, 3) for x in rows[row]]}")
        for kind in ("fresh", "into"):
            alone = medians[f"{kind} alone"]
            print(
                f"  {kind}: busy thread {medians[f'{kind} thread'] / alone:.2f}x alone, "
                f"busy process {medians[f'{kind} process'] / alone:.2f}x alone"
            )
    print(os.popen("uptime").read().strip())


if __name__ == "__main__":
    main()
