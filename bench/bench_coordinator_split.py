"""Where a Saver's later save spends the coordinator's time while its workers work (C), by part.

Usage: flock LOCK python bench/bench_coordinator_split.py [KEYS [WORKERS]]   (default 50,000 and 2)

Saves ``synthetic.many_small(KEYS)`` with ``parallel_dcp.Saver(workers=WORKERS)`` to /dev/shm twice,
then 5 more times with the coordinator's parts wrapped in timers: the layout check
(``Speculation.confirm``), the governor (``watch``, ``admit_task``, ``release``), taking each result
in (``WorkerPool._receive``: the pipe and the unpickling), the commit after the last result
(``DcpTarget.commit``: .metadata, side index, manifest; not part of C), sending tasks (``_dispatch``,
``_send_ahead``), making parts ahead (``JobParts.ahead``), and the wait on the workers. Each part's
exclusive wall seconds and CPU seconds (``time.thread_time``: what a loaded machine does not
inflate), medians of the 5; C = SaveResult.coordinator_write_seconds (wall). Runs against whichever
tree is first on PYTHONPATH (the base tree too: it wraps the same functions).
"""

import collections
import functools
import shutil
import statistics
import sys
import tempfile
import time

import parallel_dcp
from parallel_dcp.engine import memory
from parallel_dcp.engine import pool as poolmod
from parallel_dcp.jobs import speculation, targets, task_parts
from parallel_dcp.synthetic import many_small

# After the last result, outside C: .metadata, the side index and the manifest written (serial, S).
COMMIT = "commit (after C)"
acc = collections.Counter()
cpu = collections.Counter()
stack = []
cstack = []


def wrap(owner, name, label):
    f = getattr(owner, name)

    @functools.wraps(f)
    def g(*a, **k):
        stack.append(0.0)
        cstack.append(0.0)
        t = time.perf_counter()
        ct = time.thread_time()
        try:
            r = f(*a, **k)
            if hasattr(r, "__next__"):
                raise RuntimeError("generator")
            return r
        finally:
            el = time.perf_counter() - t
            cel = time.thread_time() - ct
            inner = stack.pop()
            cinner = cstack.pop()
            acc[label] += el - inner
            cpu[label] += cel - cinner
            if stack:
                stack[-1] += el
                cstack[-1] += cel

    setattr(owner, name, g)


wrap(speculation.Speculation, "confirm", "layout check")
wrap(memory.MemoryGovernor, "watch", "governor watch")
wrap(memory.MemoryGovernor, "admit_task", "governor admit")
wrap(memory.MemoryGovernor, "release", "governor release")
wrap(poolmod.WorkerPool, "_receive", "receive+unpickle")
wrap(poolmod.WorkerPool, "_send_ahead", "send ahead (parts, pickle, send)")
wrap(poolmod.WorkerPool, "_dispatch", "dispatch")
wrap(task_parts.JobParts, "ahead", "parts ahead")
# The wait on the workers' pipes: engine/ready.py's since 2026-12-06 (multiprocess's before).
if hasattr(poolmod, "wait_ready"):
    wrap(poolmod, "wait_ready", "WAIT")
else:
    wrap(poolmod.mp_connection, "wait", "WAIT")
wrap(targets.DcpTarget, "commit", COMMIT)

keys = int(sys.argv[1]) if len(sys.argv) > 1 else 50000
workers = int(sys.argv[2]) if len(sys.argv) > 2 else 2
sd = many_small(keys)
root = tempfile.mkdtemp(dir="/dev/shm", prefix="coordsplit-")
out = f"{root}/ck"
rows = []
with parallel_dcp.Saver(workers=workers) as saver:
    for _ in range(2):
        saver.save(sd, out)
        shutil.rmtree(out)
    for _ in range(5):
        acc.clear()
        cpu.clear()
        c0 = time.thread_time()
        r = saver.save(sd, out)
        shutil.rmtree(out)
        row = dict(acc)
        row.update({"cpu " + k: v for k, v in cpu.items()})
        row["cpu whole save (coordinator thread)"] = time.thread_time() - c0
        row["C"] = r.coordinator_write_seconds
        row["write"] = r.phases["write"]
        row["C - named"] = r.coordinator_write_seconds - sum(v for k, v in acc.items() if k not in ("WAIT", COMMIT))
        row["cpu receive+unpickle + commit"] = cpu["receive+unpickle"] + cpu[COMMIT]
        rows.append(row)
for k in rows[0]:
    print(f"{k:40s} {statistics.median(r.get(k, 0) for r in rows) * 1e3:8.1f} ms")
shutil.rmtree(root)
