"""What resume costs and saves: done records on a fresh conversion, and a resume after a failure.

python bench/bench_resume.py --mib 512 --tensors 32 --workers 2 --repeat 3 --dir /tmp

Three configurations run interleaved (each round runs each once, into fresh destinations):

- ``fresh``: a safetensors -> DCP conversion as shipped (job record, one fsynced done record per task);
- ``no records``: the same with the records turned off (what the conversion cost before resume);
- ``resume``: a conversion whose tasks from the half on failed (an injected ENOSPC after the first
  half recorded), then ``convert(..., resume=True)``: the time of the resume alone (it re-hashes
  the kept files and writes the rest).

The table shows medians and ratios to ``fresh``. Timings on a shared, noisy machine: read the
ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
from safetensors.torch import save_file

import parallel_dcp
from parallel_dcp.jobs import resume, targets


def _fail_half(src: str, out: str, workers: int, half: int) -> None:
    original = targets.DcpTarget.write

    def write(self: Any, job: Any, task: Any, data: Any, staging: Any, options: Any) -> Any:
        if task.index >= half:
            deadline = time.monotonic() + 120
            while (
                time.monotonic() < deadline and sum(n.startswith(".parallel_dcp.done.") for n in os.listdir(out)) < half
            ):
                time.sleep(0.01)
            raise OSError(28, "No space left on device (injected)")
        return original(self, job, task, data, staging, options)

    targets.DcpTarget.write = write  # type: ignore[method-assign]
    try:
        parallel_dcp.convert(src, out, workers=workers)
    except parallel_dcp.WorkerError:
        pass
    finally:
        targets.DcpTarget.write = original  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        rows = args.mib * 2**20 // 4 // args.tensors // 1024
        src = os.path.join(root, "model.safetensors")
        save_file({f"w{i}": torch.randn(rows, 1024) for i in range(args.tensors)}, src)
        times: dict[str, list[float]] = {"fresh": [], "no records": [], "resume": []}
        kept: list[float] = []
        for round_ in range(args.repeat):
            for name in times:
                out = os.path.join(root, f"out-{round_}-{name.replace(' ', '-')}")
                if name == "resume":
                    _fail_half(src, out, args.workers, half=args.workers * 2)
                began = time.perf_counter()
                if name == "no records":
                    resumable = resume.resumable
                    resume.resumable = lambda *a: False  # type: ignore[assignment]
                    try:
                        result = parallel_dcp.convert(src, out, workers=args.workers)
                    finally:
                        resume.resumable = resumable  # type: ignore[assignment]
                else:
                    result = parallel_dcp.convert(src, out, workers=args.workers, resume=name == "resume")
                times[name].append(time.perf_counter() - began)
                if name == "resume":
                    assert result.resumed
                    kept.append(result.bytes_kept / result.bytes)
                shutil.rmtree(out)
        base = statistics.median(times["fresh"])
        print(f"{args.mib} MiB in {args.tensors} tensors, {args.workers} workers, {args.repeat} rounds (medians)")
        for name, values in times.items():
            print(
                f"{name:>11}: {statistics.median(values):7.3f} s  ratio to fresh {statistics.median(values) / base:.2f}"
            )
        print(f"resume kept {statistics.median(kept):.0%} of the bytes")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
