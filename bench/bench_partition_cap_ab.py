"""A Saver(W) under LIMIT (or "default") saving 50,000 small tensors 4 times: the coordinator thread's
CPU of each later save and its tasks. Run once per tree, interleaved:
``PYTHONPATH=TREE python bench/bench_partition_cap_ab.py W LIMIT`` (round nine: 16 8GiB, 16 default)."""

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
root = tempfile.mkdtemp(dir="/dev/shm")
cpu = []
with parallel_dcp.Saver(workers=workers, memory_limit=limit) as saver:
    for _ in range(4):
        started = time.thread_time()
        result = saver.save(sd, f"{root}/ck")
        cpu.append(time.thread_time() - started)
        shutil.rmtree(f"{root}/ck")
shutil.rmtree(root, ignore_errors=True)
later = sorted(cpu[1:])
print(
    f"{parallel_dcp.__file__} W={workers} limit={limit} tasks={result.tasks} later saves' coordinator CPU "
    f"{' '.join(f'{c:.3f}' for c in cpu[1:])} median {later[1]:.3f} s"
)
