"""What a cold buffered read costs here depends on what ran just before it: the same read of the
same files, after three different predecessors (each run cold: the page cache dropped first).

python bench/bench_read_memory_state.py --gib 2 --workers 2 --reps 3 --dir /work/tmp/x   (root)

    before the timed read (untimed, then the page cache dropped):
      "after direct":        a direct read of the files (it releases no page cache)
      "after buffered":      a buffered read of the files (2 GiB of page cache, dropped just before)
      "after buffered + 4s": the same, then 4 s idle (plain reads only)
    timed: the bench's plain read (a file per thread, 8 MiB preadv, direct / buffered) and
           parallel_dcp.load of the Hugging Face folder (io="buffered" / io="direct")

Each row prints its wall time and its kernel CPU (the process's system time: a buffered read's
copy out of the page cache). Found on this project's VM (a Firecracker guest whose virtio-balloon
reports free pages to the host): the buffered read costs 0.3 s of kernel CPU per 2 GiB right after
another buffered read's pages were dropped, and 1.5-2.8 s after a direct read or after 4 s idle,
all of it in the copy (perf: _copy_to_iter); a direct read costs 0.06-0.09 s whatever came before.
On 2 cores that is the difference between the fastest read of all and the slowest. A benchmark
that runs its rows in one fixed order hands the cheap pages to whichever buffered row follows a
buffered one (the read suite now runs each round in its own order: parallel_dcp/benchmark/reading.py).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import parallel_dcp
from parallel_dcp.benchmark.device import plain_read
from parallel_dcp.benchmark.disk import drop_caches
from parallel_dcp.benchmark.reading import _write_folder
from parallel_dcp.benchmark.writers import flat_tensors
from parallel_dcp.synthetic import llm_like


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=".")
    args = parser.parse_args()
    n = args.workers
    root = tempfile.mkdtemp(prefix="pdcp-memstate-", dir=args.dir)
    try:
        folder = os.path.join(root, "hf")
        files = _write_folder(flat_tensors(llm_like(args.gib)), folder)
        total = sum(os.path.getsize(f) for f in files)
        rows: dict[str, Callable[[], object]] = {
            "plain read buffered": lambda: plain_read(files, n, False)(""),
            "plain read direct": lambda: plain_read(files, n, True)(""),
            "load io=buffered": lambda: parallel_dcp.load(folder, workers=n, io="buffered"),
            "load io=direct": lambda: parallel_dcp.load(folder, workers=n, io="direct"),
        }
        states = {"after direct": (True, 0.0), "after buffered": (False, 0.0), "after buffered + 4s": (False, 4.0)}
        found: dict[str, list[tuple[float, float]]] = {}
        print(f"{total / 2**30:.2f} GiB in {len(files)} files, {n} workers; load {os.getloadavg()}", flush=True)
        for rep in range(args.reps):
            for name, run in rows.items():
                for state, (direct, idle) in states.items():
                    if idle and name.startswith("load"):
                        continue
                    if not drop_caches():
                        raise SystemExit("needs root: the page cache is dropped before every read")
                    plain_read(files, n, direct)("")  # the predecessor, untimed
                    drop_caches()
                    time.sleep(idle)
                    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                    out = run()
                    wall = time.perf_counter() - start
                    kernel = resource.getrusage(resource.RUSAGE_SELF).ru_stime - before.ru_stime
                    del out
                    key = f"{name}, {state}"
                    found.setdefault(key, []).append((wall, kernel))
                    print(f"rep {rep + 1} {key:42s} {wall:6.3f} s  kernel CPU {kernel:5.2f} s", flush=True)
        print(f"== medians of {args.reps} (load {os.getloadavg()})")
        print(f"{'row, predecessor':42s} {'wall s':>7s} {'GiB/s':>6s} {'kernel CPU s':>13s}  all (wall, kernel)")
        for key, samples in found.items():
            wall = statistics.median(w for w, _ in samples)
            kernel = statistics.median(k for _, k in samples)
            every = ", ".join(f"({w:.2f}, {k:.2f})" for w, k in samples)
            print(f"{key:42s} {wall:7.3f} {total / wall / 2**30:6.2f} {kernel:13.2f}  {every}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
