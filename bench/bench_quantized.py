"""Dequantizing at the issue's sizes, under a memory limit given as a share of the output.

python bench/bench_quantized.py --kind fp8 --gib 1 --limit-share 0.25 --reps 3 --dir /dev/shm

One release of ``--kind`` (``fp8`` or ``mxfp4``, shaped as ``parallel-dcp bench --suite
quantized`` builds it: index, scales in other shards than their weights, config.json) is written
untimed; then, interleaved, ``convert(dequantize=True)`` to DCP at 1 and 2 workers with
``memory_limit = share x output`` against the stock path (``dcp.load`` with
``QuantizedHuggingFaceStorageReader`` into preallocated bf16 tensors, then ``dcp.save``), and the
device's own limit for the output's bytes (``--device-row``: fio's O_DIRECT write of as many bytes
by 2 jobs, its own run time; the built-in probe where fio is missing). Medians, CPU seconds, peak
added memory (PSS of the process tree) and the ratios. Timings on a shared, noisy machine: read
the ratios, within one run.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import warnings
from typing import Any

from parallel_dcp.benchmark import quantized
from parallel_dcp.benchmark.device import direct_write_probe, fio_write
from parallel_dcp.benchmark.measure import Case, run_interleaved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["fp8", "mxfp4"], default="fp8")
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of quantized weights (default 1)")
    parser.add_argument("--limit-share", type=float, default=0.25, help="memory_limit / output bytes (default 0.25)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm", help="where the release and the outputs go")
    parser.add_argument("--device-row", action="store_true", help="also time the device's direct write of the output")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # dcp.save without a process group warns on every call
    suite, label = f"quantized:{args.kind}", f"{args.kind}->bf16"
    root = tempfile.mkdtemp(prefix="pdcp-quantized-", dir=args.dir)
    try:
        sd = quantized.quantized_state_dict(suite, args.gib)
        out_bytes = quantized.output_bytes(sd)
        source = quantized.write_release(sd, f"{root}/source", True)
        del sd
        limit = int(out_bytes * args.limit_share)
        cases = [quantized.ours_case(label, source, n, False, limit, dequantize=True) for n in (1, 2)]
        cases.append(quantized.stock_dequantize_case(label, source, False))
        if args.device_row:
            cases.append(_device_case(out_bytes))
        measured = run_interleaved(cases, args.reps, 1, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.kind}: output {out_bytes / 2**20:.0f} MiB, memory_limit {limit / 2**20:.0f} MiB")
    medians = {}
    held = True
    for m in measured:
        if m.error:
            print(f"{m.case.name}: failed: {m.error}")
            continue
        medians[m.case.name] = statistics.median(m.walls)
        reported = m.details.get("peak_memory")  # ours: the governor's highest of every run
        if reported is not None:
            held = held and max(reported, *m.peaks) <= limit
        print(
            f"{m.case.name}: median {medians[m.case.name]:.2f} s, cpu {statistics.median(m.cpus):.2f} s, "
            f"peak sampled +{max(m.peaks) / 2**20:.0f} MiB"
            + (f", reported +{reported / 2**20:.0f} MiB (limit {limit / 2**20:.0f})" if reported is not None else "")
            + f"; runs {', '.join(f'{w:.2f}' for w in m.walls)} s"
        )
    print(f"memory limit {'held in every run of ours' if held else 'EXCEEDED'} (reported and sampled peaks)")
    ours1, ours2, stock = (medians.get(c.name) for c in cases[:3])
    if ours2 and stock:
        print(f"w=2 vs stock: {stock / ours2:.2f}x")
    if ours1 and ours2:
        print(f"w=2 vs w=1: {ours1 / ours2:.2f}x")
    device = [m.details.get("device_s") for m in measured if m.case.name == _DEVICE]
    if device and device[0] and ours2:
        print(
            f"device limit (the output's bytes written direct by 2 jobs, median of fio's own run time): "
            f"{device[0]:.2f} s; w=2 takes {ours2 / device[0]:.2f}x that, w=1 {(ours1 or 0) / device[0]:.2f}x"
        )


_DEVICE = "device write x2"


def _device_case(nbytes: int) -> Case:
    seconds: list[float] = []

    def run(out: str) -> dict[str, Any]:
        found = (fio_write if shutil.which("fio") else direct_write_probe)(nbytes, 2, out)
        if "device_s" in found:
            seconds.append(found["device_s"])
            found["device_s"] = statistics.median(seconds)  # of every run so far
        return found

    return Case(name=_DEVICE, family="device write", procs=2, run=run)


if __name__ == "__main__":
    main()
