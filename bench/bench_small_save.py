"""50,000 small records saved to tmpfs: before (base tree) vs after (this branch), interleaved.

Usage: flock LOCK python bench/bench_small_save.py OUT_ROOT BASE_TREE AFTER_TREE REPS
OUT_ROOT is on tmpfs (``/dev/shm/...``). Two long-lived worker processes (before: PYTHONPATH=BASE_TREE;
after: AFTER_TREE, both with AFTER_TREE's ``.venv``) take turns saving ``synthetic.many_small(50000)``
with ``parallel_dcp.save(workers=2)`` to a fresh directory (removed after each row); round 0 is a
warm-up. Prints each row's wall time and the medians (us per record) and their ratio.
"""

import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import sys, time, json, shutil, warnings, gc
warnings.filterwarnings("ignore")
import parallel_dcp
from parallel_dcp.synthetic import many_small
sd = many_small(50000)
print("ready", parallel_dcp.__file__, flush=True)
for line in sys.stdin:
    path = line.strip()
    gc.collect()
    t = time.perf_counter()
    parallel_dcp.save(sd, path, workers=2)
    took = time.perf_counter() - t
    shutil.rmtree(path)
    print(json.dumps({"TOTAL": took}), flush=True)
"""
N = 50000


def main() -> None:
    root, base, after, reps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    py = f"{after}/.venv/bin/python"
    workers = {}
    for name, tree in (("before", base), ("after", after)):
        env = dict(os.environ, PYTHONPATH=tree)
        workers[name] = subprocess.Popen(
            [py, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=root
        )
        print(name, workers[name].stdout.readline().strip(), flush=True)
    print("load at start:", os.getloadavg(), flush=True)
    results: dict[str, list[float]] = {"before": [], "after": []}
    for rep in range(reps + 1):
        for name, w in workers.items():
            w.stdin.write(f"{root}/{name}\n")
            w.stdin.flush()
            took = json.loads(w.stdout.readline())["TOTAL"]
            if rep:
                results[name].append(took)
            print(rep, name, f"{took / N * 1e6:.2f} us/rec", flush=True)
    print("load at end:", os.getloadavg(), flush=True)
    for w in workers.values():
        w.stdin.close()
        w.wait()
    med = {name: statistics.median(v) / N * 1e6 for name, v in results.items()}
    print(f"save(workers=2) of 50,000 small records to {root}, medians of {reps}, us per record:")
    print(f"before {med['before']:.2f}, after {med['after']:.2f} (after/before {med['after'] / med['before']:.3f})")


if __name__ == "__main__":
    main()
