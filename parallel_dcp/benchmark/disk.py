"""The ``disk`` suite: where checkpoints live. Ours against stock and against the device's limits.

rows (one worker count N, the largest asked for; interleaved like every suite):
    save: parallel_dcp w=N io=auto | io=buffered | no-checksums      stock dcp t=N
          device direct write xN (the limit: fio, direct libaio iodepth 8, N jobs, the same bytes,
          when fio is on PATH; otherwise N threads of 8 MiB O_DIRECT pwrites from aligned buffers)
          each save row reports the page-cache growth it left (Dirty + Cached of /proc/meminfo)
    cold reads (the page cache dropped before each run when root, else the row says "warm"):
          load into w=N (io=auto: its details give the read choice and the rates it measured)
          | load into w=N io=direct | io=buffered | FastReader w=N | stock dcp.load (preallocated)
          plain read xN direct | plain read xN buffered (the limit is the faster of the two)
          the same reads of a checkpoint written by stock dcp.save(thread_count=N)
    convert: safetensors -> DCP w=N from a cold source (io=auto | io=buffered: the mmap path)
             | stock load_file + dcp.save t=N
             device read+write xN (the combined limit: the source read and as many bytes written
             at once, fio or the built-in probe; the slower of the two alone where the device
             serves both independently, their sum where they share it)
    verify:  verify w=N (checksums + read-back) | stock dcp.load of every key + torch.equal

Longer than 300 lines because every row of the suite is built here, beside the untimed checkpoints
and source they read, so that one function shows what the suite compares with what.
"""

from __future__ import annotations

import os
import shutil
import statistics
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import parallel_dcp
from parallel_dcp.benchmark.device import direct_write_probe, fio_read_write, fio_write, plain_read, read_write_probe
from parallel_dcp.benchmark.measure import Case
from parallel_dcp.benchmark.writers import flat_tensors
from parallel_dcp.storage.read_choice import ReadChoice

__all__ = ["disk_cases", "drop_caches", "page_cache_bytes"]

_BLOCK = 8 << 20


def page_cache_bytes() -> int:
    """Dirty + Cached of /proc/meminfo, in bytes."""
    found = {}
    with open("/proc/meminfo", encoding="ascii") as info:
        for line in info:
            name, value = line.split(":", 1)
            if name in ("Dirty", "Cached"):
                found[name] = int(value.split()[0]) * 1024
    return sum(found.values())


def drop_caches() -> bool:
    """Write back and drop the page cache (root only); False when it could not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def _cache_growth(run: Callable[[str], Any]) -> Callable[[str], dict[str, Any]]:
    def measured(out: str) -> dict[str, Any]:
        before = page_cache_bytes()
        details = run(out) or {}
        return {**details, "page_cache_growth": page_cache_bytes() - before}

    return measured


def disk_cases(state_dict: Any, root: str, workers: int, sync: bool) -> tuple[list[Case], list[str]]:
    """Every row of the disk suite at ``workers`` (see the module docstring); writes the
    checkpoint and the safetensors source it reads under ``root`` first (untimed)."""
    flat = flat_tensors(state_dict)
    nbytes = sum(t.nbytes for t in flat.values())
    n = workers
    limit_name = f"device direct write x{n}"
    stock_save = f"stock dcp t={n}"
    root_ok = os.geteuid() == 0
    cold = "" if root_ok else " (warm)"

    def save(**options: Any) -> Callable[[str], Any]:
        def run(out: str) -> dict[str, Any]:
            result = parallel_dcp.save(state_dict, out, workers=n, sync_files=sync, **options)
            return {"io": result.io}

        return _cache_growth(run)

    def stock(out: str) -> None:
        dcp_save(state_dict, storage_writer=FileSystemWriter(out, sync_files=sync, thread_count=n), no_dist=True)

    fio = shutil.which("fio") is not None

    write_seconds: list[float] = []

    def limit(out: str) -> dict[str, Any]:
        found = (fio_write if fio else direct_write_probe)(nbytes, n, out)
        if "device_s" not in found:
            return found
        write_seconds.append(found["device_s"])
        return found | {"device_s": statistics.median(write_seconds)}  # of every run so far

    cases = [
        Case(name=f"save w={n} io=auto", family="save", procs=n, run=save(), baseline=stock_save, limit=limit_name),
        Case(
            name=f"save w={n} io=buffered",
            family="save buffered",
            procs=n,
            run=save(io="buffered"),
            baseline=stock_save,
            limit=limit_name,
        ),
        Case(
            name=f"save w={n} no-checksums",
            family="save no-checksums",
            procs=n,
            run=save(checksums=False),
            baseline=stock_save,
            limit=limit_name,
        ),
        Case(
            name=stock_save,
            family="stock dcp",
            procs=n,
            run=_cache_growth(stock),
            baseline=stock_save,
            limit=limit_name,
        ),
        Case(
            name=limit_name,
            family="device limit",
            procs=n,
            run=_cache_growth(limit),
            note="fio" if fio else "fio not on PATH: built-in O_DIRECT probe",
        ),
    ]

    # The checkpoints the read rows read (ours and stock's), and the safetensors source of the convert rows.
    ckpt, source = os.path.join(root, "ckpt"), os.path.join(root, "model.safetensors")
    parallel_dcp.save(state_dict, ckpt, workers=n)
    stock_ckpt = os.path.join(root, "stock-ckpt")
    stock(stock_ckpt)
    save_file({k: t.contiguous() for k, t in flat.items()}, source)
    targets = parallel_dcp.load(ckpt, workers=n)  # also where io="auto" measures, once, at the rows' thread count
    cases += _read_cases(ckpt, "", targets, n, cold)
    cases += _read_cases(stock_ckpt, " (stock-written)", targets, n, cold)

    def convert(io: str) -> Callable[[str], dict[str, Any]]:
        def run(out: str) -> dict[str, Any]:
            result = parallel_dcp.convert(source, out, workers=n, sync_files=sync, io=io)
            assert isinstance(result, parallel_dcp.SaveResult)
            # how the source was read (io=auto: ring or mmap, as measured beside the writes)
            return _choice_details(result.read_choice)

        return run

    device_seconds: list[float] = []

    def both(out: str) -> dict[str, Any]:
        found = (fio_read_write if fio else read_write_probe)(source, n, out)
        device_seconds.append(found["device_s"])
        return found | {"device_s": statistics.median(device_seconds)}  # of every run so far

    def stock_convert(out: str) -> None:
        loaded = load_file(source)
        dcp_save(loaded, storage_writer=FileSystemWriter(out, sync_files=sync, thread_count=n), no_dist=True)

    def verify(out: str) -> None:
        report = parallel_dcp.verify(ckpt, workers=n)
        if not report.ok:
            raise RuntimeError(f"verify failed: {report.problems[:2]}")

    def stock_verify(out: str) -> None:
        loaded = {k: torch.empty_like(t) for k, t in flat.items()}
        dcp_load(loaded, storage_reader=FileSystemReader(ckpt), no_dist=True)
        if not all(torch.equal(loaded[k], t) for k, t in flat.items()):
            raise RuntimeError("stock load differs")

    stock_conv, stock_ver = f"stock load_file + dcp.save t={n}{cold}", f"stock dcp.load + torch.equal{cold}"
    both_name = f"device read+write x{n}{cold}"
    cases += [
        Case(
            name=f"convert safetensors w={n}{cold}",
            family="convert",
            procs=n,
            run=convert("auto"),
            prepare=drop_caches,
            baseline=stock_conv,
            limit=both_name,
        ),
        Case(
            name=f"convert safetensors w={n} io=buffered{cold}",
            family="convert buffered",
            procs=n,
            run=convert("buffered"),
            prepare=drop_caches,
            baseline=stock_conv,
            limit=both_name,
            note="reads through the library's mmap",
        ),
        Case(
            name=both_name,
            family="device read+write",
            procs=n,
            run=both,
            prepare=drop_caches,
            note="the source read and as many bytes written, at once" + ("" if fio else " (built-in probe)"),
        ),
        Case(
            name=stock_conv,
            family="stock convert",
            procs=n,
            run=stock_convert,
            prepare=drop_caches,
            baseline=stock_conv,
        ),
        Case(name=f"verify w={n}{cold}", family="verify", procs=n, run=verify, prepare=drop_caches, baseline=stock_ver),
        Case(name=stock_ver, family="stock verify", procs=1, run=stock_verify, prepare=drop_caches, baseline=stock_ver),
    ]
    notes = [
        f"limit: {'fio --direct=1 --ioengine=libaio --iodepth=8 --bs=8m' if fio else 'built-in O_DIRECT probe'}"
        f" --numjobs={n}, {nbytes >> 20} MiB in all, fsynced",
        "page_cache_growth: Dirty + Cached of /proc/meminfo after the run minus before (per save row)",
        "cold reads: the page cache dropped (sync; echo 3 > drop_caches) before each timed run"
        if root_ok
        else "not root: the page cache cannot be dropped, every read row is warm",
    ]
    return cases, notes


def _choice_details(choice: ReadChoice | None) -> dict[str, Any]:
    """How ``io="auto"`` read, for a read row's details."""
    if choice is None:
        return {}
    details: dict[str, Any] = {"read_io": choice.reads, "read_reason": choice.reason}
    if choice.measured:
        assert choice.direct_bytes_per_s is not None and choice.buffered_bytes_per_s is not None
        details |= {
            "probe_direct_gib_s": round(choice.direct_bytes_per_s / 2**30, 3),
            "probe_buffered_gib_s": round(choice.buffered_bytes_per_s / 2**30, 3),
            "probe_s": round(choice.probe_seconds, 3),
        }
    if choice.beside_writes is not None:  # a conversion's: direct = the O_DIRECT ring, buffered = the mmap
        details["probe_beside"] = choice.beside_writes
    return details


def _read_cases(ckpt: str, label: str, targets: dict[str, Any], n: int, cold: str) -> list[Case]:
    """The cold read rows of one checkpoint: ours (auto, direct, buffered), FastReader, stock's
    dcp.load and the plain parallel reads of its shards (the limit: the faster of the two)."""
    shards = sorted(os.path.join(ckpt, name) for name in os.listdir(ckpt) if name.endswith(".distcp"))

    def into(io: str) -> Callable[[str], dict[str, Any]]:
        def run(out: str) -> dict[str, Any]:
            stats = parallel_dcp.ReadStats()
            parallel_dcp.load(ckpt, workers=n, into=targets, io=io, stats=stats)
            return _choice_details(stats.read_choice)

        return run

    def fast_reader(out: str) -> dict[str, Any]:
        reader = parallel_dcp.FastReader(ckpt, workers=n)
        dcp_load(targets, storage_reader=reader, no_dist=True)
        return _choice_details(reader.read_choice)

    def stock_load(out: str) -> None:
        dcp_load(targets, storage_reader=FileSystemReader(ckpt), no_dist=True)

    read_limit = f"plain read x{n} direct{label}{cold}"
    stock_read = f"stock dcp.load{label}{cold}"
    family = "stock-written " if label else ""
    rows = [
        (f"load into w={n}{label}{cold}", "load into", into("auto")),
        (f"load into w={n} io=direct{label}{cold}", "load into direct", into("direct")),
        (f"load into w={n} io=buffered{label}{cold}", "load into buffered", into("buffered")),
        (f"FastReader w={n}{label}{cold}", "FastReader", fast_reader),
    ]
    cases = [
        Case(
            name=name,
            family=family + kind,
            procs=n,
            run=run,
            prepare=drop_caches,
            baseline=stock_read,
            limit=read_limit,
        )
        for name, kind, run in rows
    ]
    return [
        *cases,
        Case(
            name=stock_read,
            family=family + "stock dcp.load",
            procs=1,
            run=stock_load,
            prepare=drop_caches,
            baseline=stock_read,
            limit=read_limit,
        ),
        Case(
            name=read_limit,
            family=family + "plain read direct",
            procs=n,
            run=plain_read(shards, n, True),
            prepare=drop_caches,
        ),
        Case(
            name=f"plain read x{n} buffered{label}{cold}",
            family=family + "plain read buffered",
            procs=n,
            run=plain_read(shards, n, False),
            prepare=drop_caches,
            limit=read_limit,
        ),
    ]
