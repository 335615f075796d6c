"""safetensors -> DCP against the device's combined read+write limit (issue 32 item 2).

The disk suite's convert rows alone (parallel_dcp/benchmark/disk.py), cold, interleaved, w=2:
ours with io=auto (the source read as measured beside the writes: storage.copy_choice, once per
process, in the warm-up round), io=auto with each read path forced (the O_DIRECT ring, the mmap;
direct writes both), io=direct (the ring), io=buffered (the mmap, buffered writes), stock
load_file + dcp.save, and fio reading the source while writing as many bytes (the combined limit,
by fio's own job run times). Run as root, under the benchmark lock:

    flock /work/notes/bench.lock .venv/bin/python bench/bench_convert_pipeline.py DIR [GIB] [REPS]

DIR (on the disk to measure) keeps the safetensors source between runs.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
from typing import Any

from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import parallel_dcp
from parallel_dcp.benchmark.device import fio_read_write
from parallel_dcp.benchmark.disk import drop_caches
from parallel_dcp.benchmark.measure import Case, run_interleaved
from parallel_dcp.jobs import streamed
from parallel_dcp.storage.read_choice import ReadChoice
from parallel_dcp.synthetic import llm_like

WORKERS = 2


def main(root: str, gib: float, reps: int) -> None:
    src = os.path.join(root, "model.safetensors")
    if not os.path.exists(src):
        os.makedirs(root, exist_ok=True)
        save_file({k: v.contiguous() for k, v in llm_like(gib).items()}, src)
    probe_choice = streamed.copy_choice  # type: ignore[attr-defined]
    choices: list[str] = []

    def convert(io: str, forced: str | None = None) -> Any:
        def run(out: str) -> dict[str, Any]:
            if forced is not None:  # the read path auto would take had it measured this one faster
                chosen = ReadChoice("auto" if forced == "direct" else "buffered", forced, "forced by the benchmark")
                streamed.copy_choice = lambda *args, **kwargs: chosen  # type: ignore[assignment,attr-defined]
            try:
                result = parallel_dcp.convert(src, out, workers=WORKERS, io=io)
            finally:
                streamed.copy_choice = probe_choice  # type: ignore[attr-defined]
            assert isinstance(result, parallel_dcp.SaveResult)
            choice = result.read_choice
            if forced is None and io == "auto" and choice is not None:
                choices.append(choice.summary())
            return {
                "tasks": result.tasks,
                "peak_MiB": result.peak_memory >> 20,
                "reads": choice.reads if choice is not None else None,
                "writes": result.io,
            }

        return run

    def stock(out: str) -> None:
        dcp_save(load_file(src), storage_writer=FileSystemWriter(out, thread_count=WORKERS), no_dist=True)

    seen: list[float] = []

    def both(out: str) -> dict[str, Any]:
        found = fio_read_write(src, WORKERS, out)
        seen.append(found["device_s"])
        return found | {"device_s": statistics.median(seen)}

    ours = {
        "convert w=2 io=auto": convert("auto"),
        "convert w=2 io=auto, ring forced": convert("auto", "direct"),
        "convert w=2 io=auto, mmap forced": convert("auto", "buffered"),
        "convert w=2 io=direct": convert("direct"),
        "convert w=2 io=buffered": convert("buffered"),
    }
    cases = [Case(name=n, family=n, procs=WORKERS, run=r, prepare=drop_caches) for n, r in ours.items()]
    cases += [
        Case(name="stock load_file + dcp.save t=2", family="stock", procs=WORKERS, run=stock, prepare=drop_caches),
        Case(name="device read+write x2", family="limit", procs=WORKERS, run=both, prepare=drop_caches),
    ]
    scratch = tempfile.mkdtemp(dir=root)
    print("load before", os.getloadavg(), flush=True)
    try:
        measured = run_interleaved(cases, reps, 1, scratch)
    finally:
        shutil.rmtree(scratch)
    print("load after", os.getloadavg())
    medians = {}
    nbytes = os.path.getsize(src)
    for m in measured:
        if m.error:
            print(m.case.name, "ERROR", m.error)
            continue
        medians[m.case.name] = wall = statistics.median(m.walls)
        walls = [round(w, 3) for w in m.walls]
        print(
            f"{m.case.name:40s} median {wall:.3f} s  {nbytes / wall / 2**30:.2f} GiB/s  "
            f"cpu {statistics.median(m.cpus):.2f} s  walls {walls}  {m.details}"
        )
    limit = next(m for m in measured if m.case.name == "device read+write x2").details["device_s"]
    print(f"combined limit (fio's own run time, median): {limit:.3f} s; wall with fio's start: ", end="")
    print(f"{medians['device read+write x2']:.3f} s")
    stock_s = medians["stock load_file + dcp.save t=2"]
    for name in ours:
        print(f"{name}: {limit / medians[name]:.0%} of the combined limit; {stock_s / medians[name]:.2f}x stock")
    print("io=auto read choice (each run):")
    for line in dict.fromkeys(choices):
        print(" ", line)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 1.0, int(sys.argv[3]) if len(sys.argv) > 3 else 5)
