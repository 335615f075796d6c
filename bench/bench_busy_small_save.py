"""``save()`` of 50,000 small tensors (``synthetic.many_small``, workers forked for the save) to
tmpfs, alone and beside one busy Python thread in the caller. Each source tree runs in a process of
its own (``PYTHONPATH=TREE``: a warm-up save, then ROUNDS of alone / beside), the trees taking
turns for PROCESSES turns; prints each process's medians and the ratio.

    python bench/bench_busy_small_save.py [ROUNDS [PROCESSES [TREE ...]]]    (default: this tree)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ONE = r"""
import json, shutil, statistics, sys, tempfile, threading, time
import parallel_dcp
from parallel_dcp.synthetic import many_small
sd, rounds = many_small(50000), int(sys.argv[1])
def spin(stop):
    x = 0
    while not stop.is_set():
        x += 1
out = {"alone": [], "thread": []}
with tempfile.TemporaryDirectory(dir="/dev/shm") as where:
    parallel_dcp.save(sd, f"{where}/c", workers=2)
    shutil.rmtree(f"{where}/c")
    for _ in range(rounds):
        for mode in out:
            stop, th = threading.Event(), None
            if mode == "thread":
                th = threading.Thread(target=spin, args=(stop,), daemon=True)
                th.start()
                time.sleep(0.1)
            t = time.perf_counter()
            result = parallel_dcp.save(sd, f"{where}/c", workers=2)
            out[mode].append(time.perf_counter() - t)
            stop.set()
            if th is not None:
                th.join()
            shutil.rmtree(f"{where}/c")
alone, thread = statistics.median(out["alone"]), statistics.median(out["thread"])
print(json.dumps({"executor": result.executor, "alone": alone, "thread": thread, "ratio": thread / alone}))
"""


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    processes = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    trees = [Path(t).resolve() for t in sys.argv[3:]] or [ROOT]
    for _ in range(processes):
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=str(tree))
            run = subprocess.run([sys.executable, "-c", ONE, str(rounds)], env=env, check=True, capture_output=True)
            got = json.loads(run.stdout)
            print(
                f"{tree}: {got['executor']}, alone {got['alone']:.3f} s, beside a busy thread {got['thread']:.3f} s "
                f"({got['ratio']:.2f}x)",
                flush=True,
            )
    print(os.popen("uptime").read().strip())


if __name__ == "__main__":
    main()
