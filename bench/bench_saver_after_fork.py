"""A `Saver`'s saves after its caller forked, in the order the scaling suite's probe runs them: each Saver save there
follows the kind before it, whose saves fork the caller (`executor="processes"`, and the busy process beside a save).

For each save: its wall and plan phase, and how the governor's baseline read each process it holds (the caller
"me", the fork server "srv", the worker "w": `LOWER` counters only, `ROLLUP` smaps_rollup, `CHEAP` the caller
anchored, `FULL` the whole smaps) with the carries it found (source, KiB, the reading that made them); and each
rollup that made a carry: its process, its counters' bound against the charge it read, what the others held of its
pages before and after (shared away), and the two rollups' measured errors (jitter), which bound the carry.

Usage: flock LOCK python bench/bench_saver_after_fork.py GIB ROUNDS
"""

import os
import shutil
import sys
import tempfile
import time
import warnings

import parallel_dcp
from parallel_dcp.benchmark.pieces import _beside
from parallel_dcp.engine import process_memory
from parallel_dcp.synthetic import llm_like

warnings.filterwarnings("ignore")
state_dict = llm_like(float(sys.argv[1]))
rounds = int(sys.argv[2])
_NAMES = {process_memory.CHEAP: "CHEAP", process_memory.ROLLUP: "ROLLUP", process_memory.FULL: "FULL", 3: "LOWER"}
baseline_plan = process_memory.ChargeReader._baseline_plan


def shown_plan(self, pids, shared):
    carries = list(self._carries)
    plan = baseline_plan(self, pids, shared)
    me = os.getpid()

    def who(pid: int) -> str:
        return "me" if pid == me else "srv" if pid in shared else "w"

    read = " ".join(f"{who(pid)}:{_NAMES[kind]}" for pid, kind in zip(pids, plan, strict=True))
    held = ", ".join(f"{who(c.source)} {c.amount >> 10} KiB @{c.seq}" for c in carries) or "none"
    print(f"    baseline: {read}; carries: {held}", flush=True)
    return plan


process_memory.ChargeReader._baseline_plan = shown_plan
take_rollup = process_memory.ChargeReader._take_rollup


def shown_rollup(self, pid, known, rollup, counters, bound, at, jitter):
    before, jittered, carries = known.shared_away, known.jitter, len(self._carries)
    taken = take_rollup(self, pid, known, rollup, counters, bound, at, jitter)
    if len(self._carries) > carries:
        who = "me" if pid == os.getpid() else "a held process"
        was = "unknown" if before is None else f"{before >> 10} KiB"
        print(
            f"      a rollup of {who} made a carry of {self._carries[-1].amount >> 10} KiB: bound {bound >> 10} KiB,"
            f" charged {taken[0] >> 10} KiB, shared away {was} -> {known.shared_away >> 10} KiB,"
            f" jitter {jittered >> 10} + {jitter >> 10} KiB",
            flush=True,
        )
    return taken


process_memory.ChargeReader._take_rollup = shown_rollup
root = tempfile.mkdtemp(dir="/dev/shm", prefix="after-fork-")
out = f"{root}/ck"


def timed(label: str, save) -> None:
    began = time.perf_counter()
    result = save()
    wall = time.perf_counter() - began
    shutil.rmtree(out)
    print(f"{label:30s} wall {wall:.3f} s, plan {result.phases['plan'] * 1e3:.2f} ms", flush=True)


try:
    with parallel_dcp.Saver(workers=1) as saver:
        timed("saver, first save", lambda: saver.save(state_dict, out))

        def forked() -> parallel_dcp.SaveResult:
            return parallel_dcp.save(state_dict, out, workers=1, executor="processes")

        for _ in range(rounds):
            timed("processes (forks the caller)", forked)
            with _beside("process"):
                timed("processes, busy process", forked)
            for n in range(1, 5):
                timed(f"saver, save {n} after the fork", lambda: saver.save(state_dict, out))
finally:
    shutil.rmtree(root, ignore_errors=True)
