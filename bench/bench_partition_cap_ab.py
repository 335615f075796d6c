"""A Saver(W) under LIMIT (or "default") saving 50,000 small tensors 4 times: the coordinator thread's
CPU and wall time of each later save and its tasks, written under DIR (default /dev/shm; fsync on).
Run once per tree, interleaved: ``PYTHONPATH=TREE python bench/bench_partition_cap_ab.py W LIMIT [DIR]``
(round nine: 16 8GiB, 16 default, 64 16GiB on tmpfs; 16 8GiB on the ext4 disk)."""

import shutil
import sys
import tempfile
import time
import warnings

import parallel_dcp
from parallel_dcp.synthetic import many_small

warnings.filterwarnings("ignore")
workers, limit = int(sys.argv[1]), (None if sys.argv[2] == "default" else sys.argv[2])
sd = many_small(50000)
root = tempfile.mkdtemp(dir=sys.argv[3] if len(sys.argv) > 3 else "/dev/shm")
cpu, wall = [], []
with parallel_dcp.Saver(workers=workers, memory_limit=limit) as saver:
    for _ in range(4):
        started, clock = time.thread_time(), time.perf_counter()
        result = saver.save(sd, f"{root}/ck")
        cpu.append(time.thread_time() - started)
        wall.append(time.perf_counter() - clock)
        shutil.rmtree(f"{root}/ck")
shutil.rmtree(root, ignore_errors=True)
later = sorted(cpu[1:])
print(
    f"{parallel_dcp.__file__} W={workers} limit={limit} tasks={result.tasks} later saves' coordinator CPU "
    f"{' '.join(f'{c:.3f}' for c in cpu[1:])} median {later[1]:.3f} s; wall {' '.join(f'{w:.3f}' for w in wall[1:])} "
    f"median {sorted(wall[1:])[1]:.3f} s"
)
