"""A `Saver`'s later saves of the 4 GiB LLM-like dict to tmpfs: its baseline memory reading, and the plan and commit
phases (`SaveResult.phases`), medians of saves 3-10 (0.2 s apart).

Usage: flock LOCK python bench/bench_saver_plan_phase.py GIB WORKERS   (with PYTHONPATH on each tree to compare)
"""

import shutil
import statistics
import sys
import tempfile
import time
import warnings

import parallel_dcp
from parallel_dcp.jobs import saver as saver_mod
from parallel_dcp.synthetic import llm_like

warnings.filterwarnings("ignore")
state_dict = llm_like(float(sys.argv[1]))
workers = int(sys.argv[2])
governor = saver_mod.SaverWorkers.governor
baseline: list[float] = []


def timed_governor(self, *args, **kwargs):
    began = time.perf_counter()
    made = governor(self, *args, **kwargs)
    baseline.append(time.perf_counter() - began)
    return made


saver_mod.SaverWorkers.governor = timed_governor
root = tempfile.mkdtemp(dir="/dev/shm", prefix="plan-phase-")
plan, commit = [], []
with parallel_dcp.Saver(workers=workers) as saver:
    for _ in range(10):
        time.sleep(0.2)
        result = saver.save(state_dict, f"{root}/ck")
        shutil.rmtree(f"{root}/ck")
        plan.append(result.phases["plan"])
        commit.append(result.phases["commit"])
shutil.rmtree(root)


def later(values: list[float]) -> float:
    return statistics.median(values[2:]) * 1e3


print(
    f"{sys.argv[1]} GiB, {workers} workers, saves 3-10: baseline {later(baseline):.2f} ms, "
    f"plan phase {later(plan):.2f} ms, commit phase {later(commit):.2f} ms"
)
