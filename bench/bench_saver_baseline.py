"""What each `Saver` save pays before its first task to read the memory of the processes it holds (its baseline),
against how many workers it holds.

Usage: flock LOCK python bench/bench_saver_baseline.py [WORKERS ...]   (default 1 16 64; ~1 GiB of memory at 64)

Per worker count: a `Saver(workers=N)` saves a dict of 4 N small tensors (every worker runs a task, so each moved
since the governor last read it), then a `MemoryGovernor` is made over the processes the Saver holds (the fork
server and its workers), as `Saver.save` makes one (with a charge reader that knows their code shares, as the
Saver's does): its construction is the baseline reading. Prints the medians of 5 (wall and this process's CPU).
The reading rolls a moved process up (`smaps_rollup`), within the reader's budget, on up to 16 threads: on this
2-core VM the wall is below the CPU; on a node of many cores, lower still.
"""

import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import psutil
import torch

import parallel_dcp
from parallel_dcp._compat import fork_server_pid
from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.engine.process_memory import ChargeReader

warnings.filterwarnings("ignore")


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def baseline(workers: int, reps: int = 5) -> tuple[float, float]:
    """Median (wall, CPU) seconds of the baseline reading of a Saver holding ``workers`` workers."""
    sd = {f"w{i}": torch.randn(1 << 16) for i in range(4 * workers)}
    root = tempfile.mkdtemp(dir="/dev/shm", prefix="baseline-")
    try:
        with parallel_dcp.Saver(workers=workers) as saver:
            server = fork_server_pid()
            held = [server, *(child.pid for child in psutil.Process(server).children())] if server else []
            charges = ChargeReader()
            MemoryGovernor(2**62, held=held, charges=charges)  # learns their code shares once
            walls, cpus = [], []
            for _ in range(reps):
                saver.save(sd, f"{root}/ck")
                shutil.rmtree(f"{root}/ck")
                began, used = time.perf_counter(), cpu()
                MemoryGovernor(2**62, held=held, charges=charges)
                walls.append(time.perf_counter() - began)
                cpus.append(cpu() - used)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    counts = [int(n) for n in sys.argv[1:]] or [1, 16, 64]
    for workers in counts:
        wall, used = baseline(workers)
        print(f"{workers} workers: the baseline reading after a save: wall {wall * 1e3:.2f} ms, CPU", end=" ")
        print(f"{used * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
