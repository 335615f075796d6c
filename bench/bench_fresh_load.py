"""Cold ``load`` of a 2 GiB DCP checkpoint into fresh tensors: seated rooms (read straight into the
tensors' 4 KiB pages, formats/seated.py) against bounced through the huge-page buffers (the default
where the kernel gives huge pages). Each process loads twice, the page cache dropped before each;
rows alternate. Prints both loads' medians (the first pays the process's first job too).

    python bench/bench_fresh_load.py DIR [ROUNDS]    (as root: it drops the page cache)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ONE = """
import subprocess, sys, time, torch, parallel_dcp
from parallel_dcp.formats import seated
if sys.argv[2] == "seated":
    seated.rooms = lambda: True
times = []
for _ in range(2):
    subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=True)
    t = time.perf_counter()
    sd = parallel_dcp.load(sys.argv[1], workers=2)
    times.append(time.perf_counter() - t)
    del sd
print(*times)
"""


def main() -> None:
    where, rounds = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 5
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ckpt = where / "fresh-load-ckpt"
    if not (ckpt / ".metadata").exists():
        make = (
            "import sys, torch, parallel_dcp; g = torch.Generator().manual_seed(0); "
            "parallel_dcp.save({f'layer{i}.w': torch.randn(2048, 8192, generator=g).bfloat16() for i in range(64)}, "
            "sys.argv[1], workers=2)"
        )
        subprocess.run([sys.executable, "-c", make, str(ckpt)], env=env, check=True)
    runs: dict[str, list[list[float]]] = {"seated": [], "bounced": []}
    for _ in range(rounds):
        for mode in runs:
            out = subprocess.run([sys.executable, "-c", ONE, str(ckpt), mode], env=env, check=True, capture_output=True)
            runs[mode].append([float(x) for x in out.stdout.split()])
    for mode, got in runs.items():
        first, second = (statistics.median(r[i] for r in got) for i in (0, 1))
        print(f"{mode:8} first load median {first:.3f} s, second {second:.3f} s  runs {got}")
    print(os.popen("uptime").read().strip())


if __name__ == "__main__":
    main()
