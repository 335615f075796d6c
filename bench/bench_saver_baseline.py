"""What each `Saver` save pays before its first task to read the memory of the processes it holds (its baseline),
against how many workers it holds.

Usage: flock LOCK python bench/bench_saver_baseline.py [WORKERS ...]   (default 1 16 64; ~1 GiB of memory at 64)
       PDCP_BENCH_PAUSE_S=0.1 (default): the pause between a save and the next baseline

Per worker count: a `Saver(workers=N)` saves a dict of 4 N small tensors (every worker runs a task, so each moved
since the governor last read it), then the governor of a save is made over the processes the Saver holds (the fork
server and its workers): by the Saver itself where it has `governor` (its workers' reports of themselves learned
first), else as `Saver.save` made one (a `MemoryGovernor` with a charge reader that knows their code shares):
its construction is the baseline reading. Prints the medians of 5 (wall and this process's CPU).
The reading rolls a moved process up (`smaps_rollup`), within the reader's budget, on up to 16 threads: on this
2-core VM the wall is below the CPU; on a node of many cores, lower still.
"""

import os
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


# Between two saves (a training step, the next conversion's listing): where the workers read
# themselves as a save ends (a tree with WorkerPool.request_charges), their reports are there by
# then. PDCP_BENCH_PAUSE_S=0 takes the next baseline at once: on 2 cores, 64 workers' reports
# (~1.2 ms each) are then waited for, oversubscribed.
PAUSE_S = float(os.environ.get("PDCP_BENCH_PAUSE_S", "0.1"))


def baseline(workers: int, reps: int = 5) -> tuple[float, float]:
    """Median (wall, CPU) seconds of the baseline reading of a Saver holding ``workers`` workers."""
    sd = {f"w{i}": torch.randn(1 << 16) for i in range(4 * workers)}
    root = tempfile.mkdtemp(dir="/dev/shm", prefix="baseline-")
    try:
        with parallel_dcp.Saver(workers=workers) as saver:
            own = getattr(saver._workers, "governor", None)  # the Saver's own (a tree that has it)
            server = fork_server_pid()
            held = [server, *(child.pid for child in psutil.Process(server).children())] if server else []
            charges = ChargeReader()
            MemoryGovernor(2**62, held=held, charges=charges)  # learns their code shares once
            walls, cpus = [], []
            for _ in range(reps):
                saver.save(sd, f"{root}/ck")
                shutil.rmtree(f"{root}/ck")
                time.sleep(PAUSE_S)
                began, used = time.perf_counter(), cpu()
                if own is not None:
                    own(2**62, saver._workers._pool)
                else:
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
