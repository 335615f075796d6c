"""Cold ``load`` of a 2 GiB Hugging Face folder (4 safetensors shards with their index, the read
suite's LLM-like tensors) with defaults at 2 workers: read in place (formats/span_read.py, what a
kernel without huge pages gets) against bounced through the huge-page buffers
(formats/bounced_read.py, the default where huge pages are given), beside the best plain read of
the read suite (8 threads x 1 MiB queued direct reads into ready buffers). Each process runs its
row twice, the page cache dropped before each; rows run in a shuffled order each round. Prints the
medians of both runs and their CPU seconds (the first pays the process's first job: the read measurement, thread start).

    python bench/bench_hf_bounce.py DIR [ROUNDS [MODES]]    (as root: it drops the page cache)

MODES: comma-separated, of in-place, bounced, plain (the default: all three) and in-place-254
(in place, each request 254 pages: the most one virtio request takes in 4 KiB pages), dcp and
dcp-seated (the same tensors saved as DCP, loaded with defaults: bounced, or seated in place as
bench/bench_fresh_load.py does).
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ONE = """
import glob, resource, subprocess, sys, time, torch, parallel_dcp
from parallel_dcp.benchmark.device import queued_read
from parallel_dcp.formats import bounced_read
folder, mode = sys.argv[1], sys.argv[2]
if mode == "dcp-seated":
    from parallel_dcp.formats import seated
    seated.rooms = lambda: True
if mode.startswith("in-place"):
    bounced_read.huge_pages = lambda: False
if mode == "in-place-254":  # requests of 254 pages: one virtio request each in 4 KiB pages
    from parallel_dcp.formats import span_read
    span_read.REQUEST_BYTES = 254 * 4096
if mode.startswith("bounced-t"):  # more reading (copying) threads than workers
    from parallel_dcp.jobs import load_files
    real, many = load_files.read_bounced, int(mode[len("bounced-t"):])
    load_files.read_bounced = lambda tensors, threads, io, on_tick=None: real(tensors, many, io, on_tick)
shards = sorted(glob.glob(folder + "/*.safetensors"))
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
times, cpus = [], []
for _ in range(2):
    subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=True)
    c, t = cpu(), time.perf_counter()
    if mode == "plain":
        queued_read(shards, 8, 1 << 20, True)("")
    elif mode.startswith("dcp"):
        sd = parallel_dcp.load(folder + "/../dcp-ckpt", workers=2)
    else:
        sd = parallel_dcp.load(folder, workers=2)
    times.append(time.perf_counter() - t)
    cpus.append(cpu() - c)
    sd = None
print(*times, *cpus)
"""


def main() -> None:
    where, rounds = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 5
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    folder = where / "hf-bounce-folder"
    if not (folder / "model.safetensors.index.json").exists():
        make = (
            "import sys; from parallel_dcp.synthetic import llm_like; "
            "from parallel_dcp.benchmark.writers import flat_tensors; "
            "from parallel_dcp.benchmark.reading import _write_folder; "
            "_write_folder(flat_tensors(llm_like(2.0)), sys.argv[1])"
        )
        subprocess.run([sys.executable, "-c", make, str(folder)], env=env, check=True)
    if not (where / "dcp-ckpt" / ".metadata").exists():
        make = (
            "import sys, parallel_dcp; from safetensors.torch import load_file; import glob; "
            "sd = {k: v for f in sorted(glob.glob(sys.argv[1] + '/*.safetensors')) for k, v in load_file(f).items()}; "
            "parallel_dcp.save(sd, sys.argv[2], workers=2)"
        )
        subprocess.run([sys.executable, "-c", make, str(folder), str(where / "dcp-ckpt")], env=env, check=True)
    modes = sys.argv[3].split(",") if len(sys.argv) > 3 else ["in-place", "bounced", "plain"]
    runs: dict[str, list[list[float]]] = {mode: [] for mode in modes}
    cpu: dict[str, list[list[float]]] = {mode: [] for mode in runs}
    order = random.Random(0)
    for _ in range(rounds):
        modes = list(runs)
        order.shuffle(modes)
        for mode in modes:
            out = subprocess.run(
                [sys.executable, "-c", ONE, str(folder), mode], env=env, check=True, capture_output=True
            )
            got = [float(x) for x in out.stdout.split()]
            runs[mode].append([round(x, 3) for x in got[:2]])
            cpu[mode].append(got[2:])
    medians = {mode: [statistics.median(r[i] for r in got) for i in (0, 1)] for mode, got in runs.items()}
    for mode, got in runs.items():
        first, second = medians[mode]
        busy = [statistics.median(r[i] for r in cpu[mode]) for i in (0, 1)]
        print(
            f"{mode:8} first run median {first:.3f} s (cpu {busy[0]:.2f} s), second {second:.3f} s "
            f"(cpu {busy[1]:.2f} s)  runs {got}"
        )
    for i, which in enumerate(("first", "second")):
        if "plain" in medians:
            shares = ", ".join(f"{m} {medians['plain'][i] / t[i]:.0%}" for m, t in medians.items() if m != "plain")
            print(f"{which} runs, of the plain read: {shares}")
        if "bounced" in medians and "in-place" in medians:
            print(f"{which} runs: bounced over in place {medians['in-place'][i] / medians['bounced'][i]:.2f}x")
    print(os.popen("uptime").read().strip())


if __name__ == "__main__":
    main()
