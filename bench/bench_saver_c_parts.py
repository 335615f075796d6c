"""Where a `Saver`'s coordinator spends C, its time beside the workers (`SaveResult.coordinator_write_seconds`), on
its later saves: each named function's own wall time inside a save, wrapped (a few us of timer each), medians of
saves 3-12 of one `Saver(workers=1)` to tmpfs, sync on.

Usage: flock LOCK python bench/bench_saver_c_parts.py small|llm [TASKS]
    small: synthetic.many_small(50000); llm: synthetic.llm_like(4)
    TASKS: cut every save into the tasks of a save on that many workers (`partition.planned_as_on`), as the
           scaling suite's per-task probe does (default: its own tasks)
"""

import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import parallel_dcp
from parallel_dcp.engine import memory, messages, pool
from parallel_dcp.engine.partition import planned_as_on
from parallel_dcp.jobs import plan_reuse, speculation
from parallel_dcp.synthetic import llm_like, many_small

warnings.filterwarnings("ignore")
state_dict = many_small(50000) if sys.argv[1] == "small" else llm_like(4)
cut = int(sys.argv[2]) if len(sys.argv) > 2 else None
spent: dict[str, float] = {}
order: list[str] = []  # the labels as wrapped


def timed(owner: Any, name: str, label: str) -> None:
    wrapped = getattr(owner, name)
    order.append(label)

    def run(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return wrapped(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - began

    setattr(owner, name, run)


timed(speculation.Speculation, "confirm", "layout check (Speculation.confirm)")
timed(plan_reuse, "leaves", "  of which the nesting walk")
timed(plan_reuse, "_chunked", "  of which types, addresses, guard (_chunked)")
timed(memory.MemoryGovernor, "watch", "governor readings (MemoryGovernor.watch)")
timed(pool.WorkerPool, "_receive", "results taken in (WorkerPool._receive)")
timed(messages, "_map_buffers", "  of which their memory files (_map_buffers)")
timed(messages, "_mapped", "    of which mapping them (_mapped)")
timed(pool.WorkerPool, "_dispatch", "tasks sent (WorkerPool._dispatch)")
root = tempfile.mkdtemp(dir="/dev/shm", prefix="c-parts-")
rows: list[tuple[float, int, dict[str, float]]] = []
try:
    with parallel_dcp.Saver(workers=1) as saver:
        for n in range(12):
            spent.clear()
            if cut:
                with planned_as_on(cut):
                    result = saver.save(state_dict, f"{root}/ck")
            else:
                result = saver.save(state_dict, f"{root}/ck")
            shutil.rmtree(f"{root}/ck")
            if n >= 2:
                rows.append((result.coordinator_write_seconds or 0.0, result.tasks, dict(spent)))
finally:
    shutil.rmtree(root, ignore_errors=True)
print(f"{sys.argv[1]}: {rows[-1][1]} tasks; medians of {len(rows)} later saves (ms)")
print(f"  C (coordinator_write_seconds)                   {statistics.median(r[0] for r in rows) * 1e3:8.2f}")
for label in order:
    print(f"  {label:48s}{statistics.median(r[2].get(label, 0.0) for r in rows) * 1e3:8.2f}")
