"""Big-node pieces (issue 30), each measured on its own: what caps a save on many cores.

python bench/bench_bignode.py --rounds 5 --dir /tmp --out bignode.json [--only governor,gil,start,tail]
    [--workers N]  (every piece's workers; default: gil 1, start and tail 2)

- ``governor``: CPU seconds a memory reading costs per process at 8, 32 and 64 workers that
  imported torch (forked; oversubscribed on a small machine: CPU time, not wall time, is the
  figure): cheap (idle: O(1) counters), all moved (every worker mapped, wrote and unmapped 4 MiB
  since the last reading: at most one process in 16 rolled up), every process rolled up, and exact
  (every full smaps), with and without 1 GiB the workers inherited from the coordinator (page
  tables walked per rollup).
- ``gil``: a save of 1 GiB (64 bf16 tensors) alone and beside one busy Python thread in the
  caller, per executor (auto, threads, processes, a Saver's workers), on /dev/shm and on ``--dir``.
- ``start``: what a save spends starting its workers against the state dict's size (``--sizes``,
  written under ``--start-dir``): ``SaveResult.phases["fork"]`` of save(executor="processes"), of a
  Saver's second save and of save()'s kept workers (beside a busy thread), and a bare ``os.fork``
  of the process holding the state dict.
- ``tail``: the coordinator's serial seconds per key at 50,000 small tensors (phases plan + merge
  + commit), save against a Saver.

Rounds are interleaved (each round runs every configuration once); medians are printed and
written to ``--out`` with every input. On a shared machine read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any

import torch

import parallel_dcp
from parallel_dcp.benchmark.governor_cost import governor_cost

GiB = 2**30


def governor(rounds: int) -> list[dict[str, Any]]:
    """parallel_dcp.benchmark.governor_cost at 8/32/64 children, with and without 1 GiB inherited."""
    rows = []
    for held_gib in (0, 1):
        held = torch.ones(held_gib * GiB // 4) if held_gib else None
        for row in governor_cost(rounds):
            rows.append({"inherited_gib": held_gib, **row})
            print(rows[-1], flush=True)
        del held
    return rows


_MODES = ("alone", "thread", "process")


def _busy(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def _busy_process(stop: Any) -> None:
    while not stop.is_set():
        sum(range(1000))


def gil(rounds: int, where: list[str], workers: int, kinds: list[str], modes: tuple[str, ...]) -> list[dict[str, Any]]:
    """Alone, beside a busy thread (the GIL and a core), and beside a busy process (a core only:
    on a machine with few cores, the CPU a busy thread takes is part of its cost)."""
    import multiprocess as mp

    sd = {f"w{i}": torch.randn(4096, 2048).to(torch.bfloat16) for i in range(64)}
    rows = []
    with parallel_dcp.Saver(workers=workers) as saver:
        for root in where:
            times: dict[tuple[str, str], list[float]] = {(k, m): [] for k in kinds for m in modes}
            with tempfile.TemporaryDirectory(dir=root) as tmp:

                def once(kind: str, mode: str) -> float:
                    stop: Any = threading.Event() if mode != "process" else mp.get_context("fork").Event()
                    thread: Any = None
                    if mode == "thread":
                        thread = threading.Thread(target=_busy, args=(stop,))
                    elif mode == "process":
                        thread = mp.get_context("fork").Process(target=_busy_process, args=(stop,))
                    busy = thread is not None
                    if busy:
                        thread.start()
                        time.sleep(0.2)  # busy for a while before the save, as a data loader is
                    try:
                        start = time.perf_counter()
                        if kind == "saver":
                            saver.save(sd, f"{tmp}/c")
                        else:
                            parallel_dcp.save(sd, f"{tmp}/c", workers=workers, executor=kind)
                        took = time.perf_counter() - start
                    finally:
                        stop.set()
                        if busy:
                            thread.join()
                    shutil.rmtree(f"{tmp}/c")
                    return took

                for kind in kinds:
                    once(kind, "alone")  # warm
                for _ in range(rounds):
                    for kind in kinds:
                        for mode in modes:
                            times[(kind, mode)].append(once(kind, mode))
            for kind in kinds:
                alone, thread_s, process_s = (
                    statistics.median(times[(kind, m)]) if m in modes else float("nan") for m in _MODES
                )
                rows.append(
                    {
                        "where": root,
                        "executor": kind,
                        "workers": workers,
                        "alone_s": alone,
                        "busy_thread_s": thread_s,
                        "busy_process_s": process_s,
                        "thread_ratio": thread_s / alone,
                        "process_ratio": process_s / alone,
                    }
                )
                print(rows[-1], flush=True)
    return rows


def start(rounds: int, root: str, workers: int, sizes: list[float]) -> list[dict[str, Any]]:
    """Per size: a bare fork of the process holding the state dict, ``phases["fork"]`` of
    save(executor="processes"), of a Saver's save (its workers started before), and of save()'s
    kept workers (the default executor beside a busy Python thread: the path a Saver takes)."""
    rows = []
    with parallel_dcp.Saver(workers=workers) as saver, tempfile.TemporaryDirectory(dir=root) as tmp:
        for gib in sizes:
            sd = {f"w{i}": torch.ones(int(gib * GiB) // 64 // 4) for i in range(64)}
            forks, saves, savers, kept, kept_used = [], [], [], [], set()
            for _ in range(rounds):
                began = time.perf_counter()
                pid = os.fork()
                if pid == 0:
                    os._exit(0)
                forks.append(time.perf_counter() - began)
                os.waitpid(pid, 0)
                result = parallel_dcp.save(sd, f"{tmp}/p", workers=workers, executor="processes", sync_files=False)
                saves.append(result.phases["fork"])
                shutil.rmtree(f"{tmp}/p")
                result = saver.save(sd, f"{tmp}/s", sync_files=False)
                savers.append(result.phases["fork"])
                shutil.rmtree(f"{tmp}/s")
                stop = threading.Event()
                busy = threading.Thread(target=_busy, args=(stop,), daemon=True)
                busy.start()
                time.sleep(0.2)  # busy before the save, as a data loader is
                try:
                    result = parallel_dcp.save(sd, f"{tmp}/k", workers=workers, sync_files=False)
                finally:
                    stop.set()
                    busy.join()
                kept.append(result.phases["fork"])
                kept_used.add(result.executor)
                shutil.rmtree(f"{tmp}/k")
            rows.append(
                {
                    "gib": gib,
                    "bare_fork_s": statistics.median(forks),
                    "save_processes_fork_phase_s": statistics.median(saves),
                    "saver_fork_phase_s": statistics.median(savers),
                    "kept_workers_fork_phase_s": statistics.median(kept),
                    "kept_workers_executor": sorted(kept_used),  # "saver": the kept workers ran it
                    "fork_phases_s": {"processes": saves, "saver": savers, "kept": kept},
                }
            )
            print(rows[-1], flush=True)
            del sd
        rows.append({"saver_start_s": saver.start_seconds, "workers": workers, "dir": root})
    return rows


def tail(rounds: int, root: str, workers: int, keys: int = 50_000) -> list[dict[str, Any]]:
    sd = {f"k{i}": torch.full((16,), float(i)) for i in range(keys)}
    found: dict[str, list[float]] = {"save": [], "saver": []}
    plans: dict[str, list[float]] = {"save": [], "saver": []}
    with parallel_dcp.Saver(workers=workers) as saver, tempfile.TemporaryDirectory(dir=root) as tmp:
        saver.save(sd, f"{tmp}/warm")
        for _ in range(rounds):
            for kind in found:
                if kind == "saver":
                    result = saver.save(sd, f"{tmp}/c")
                else:
                    result = parallel_dcp.save(sd, f"{tmp}/c", workers=workers, executor="processes")
                shutil.rmtree(f"{tmp}/c")
                found[kind].append(result.phases["plan"] + result.phases["merge"] + result.phases["commit"])
                plans[kind].append(result.phases["plan"])
    rows = [
        {
            "executor": kind,
            "keys": keys,
            "serial_us_per_key": statistics.median(values) / keys * 1e6,
            "plan_us_per_key": statistics.median(plans[kind]) / keys * 1e6,
        }
        for kind, values in found.items()
    ]
    for row in rows:
        print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk")
    parser.add_argument(
        "--workers", type=int, default=None, help="workers of every piece (default: gil 1, start and tail 2)"
    )
    parser.add_argument("--only", default="governor,gil,start,tail")
    parser.add_argument("--out", default=None)
    parser.add_argument("--sizes", default="0.5,2,4", help="start: state dict sizes in GiB (the issue asks 0.5,2,8)")
    parser.add_argument("--start-dir", default="/dev/shm", help="start: where its saves write (8 GiB: the disk)")
    parser.add_argument("--kinds", default="auto,threads,processes,saver", help="gil: executors (saver: a Saver)")
    parser.add_argument("--modes", default=",".join(_MODES), help="gil: alone, beside a busy thread, a busy process")
    args = parser.parse_args()
    only = set(args.only.split(","))
    report: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "rounds": args.rounds,
        "workers": args.workers,
    }
    if "governor" in only:
        report["governor"] = governor(args.rounds)
    if "gil" in only:
        modes = tuple(m for m in _MODES if m in args.modes.split(","))
        report["gil"] = gil(args.rounds, ["/dev/shm", args.dir], args.workers or 1, args.kinds.split(","), modes)
    if "start" in only:
        sizes = [float(g) for g in args.sizes.split(",")]
        report["start"] = start(args.rounds, args.start_dir, args.workers or 2, sizes)
    if "tail" in only:
        report["tail"] = tail(args.rounds, "/dev/shm", args.workers or 2)
    report["load_average_at_end"] = os.getloadavg()
    if args.out:
        with open(args.out, "w") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
