"""The ``load`` suites: reading one checkpoint back, ours against stock DCP and the plain-read limits.

built once per scenario (untimed): the state dict, written twice on the target
    "stock": dcp.save(thread_count=N)      "pdcp": parallel_dcp.save(workers=N)
then the state dict is dropped; preallocated targets (touched) are built once and reused
rows, per checkpoint (interleaved, as every suite):
    load w=N            parallel_dcp.load(path, workers=N)        allocates the output
    load into w=N       parallel_dcp.load(path, into=targets)      fills ready tensors
    FastReader w=N      dcp.load(targets, storage_reader=FastReader(path, workers=N))
    stock dcp.load      dcp.load(targets, checkpoint_id=path)      (preallocated)
    stock alloc load    _load_state_dict_from_keys(checkpoint_id=path)  (what dcp_to_torch_save does)
    plain read xN ready N threads preadv the shard files into ready buffers (the limit)
    plain read xN fresh the same into buffers allocated per run (page faults included)
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import parallel_dcp
from parallel_dcp.benchmark.measure import Case

__all__ = ["SOURCES", "load_cases", "write_checkpoints"]

SOURCES = ("stock", "pdcp")
_PIECE = 64 << 20


def write_checkpoints(state_dict: Any, root: str, workers: int) -> dict[str, str]:
    """The two checkpoints every load row reads: written by stock DCP and by parallel_dcp."""
    paths = {source: os.path.join(root, f"ckpt-{source}") for source in SOURCES}
    dcp_save(state_dict, storage_writer=FileSystemWriter(paths["stock"], thread_count=workers), no_dist=True)
    parallel_dcp.save(state_dict, paths["pdcp"], workers=workers)
    return paths


def _targets(path: str) -> dict[str, Any]:
    """Preallocated, touched tensors of the checkpoint's shapes (what a trainer holds), nested."""
    out = parallel_dcp.load(path, workers=1)  # allocates and fills: every page exists
    return out


def _ranges(path: str, readers: int) -> list[list[tuple[str, int, int]]]:
    """The shard files' bytes in ``readers`` contiguous shares of (file, start, stop)."""
    files = sorted(
        (os.path.join(path, n), os.path.getsize(os.path.join(path, n)))
        for n in os.listdir(path)
        if n.endswith(".distcp")
    )
    total = sum(size for _, size in files)
    share = -(-total // readers)
    shares: list[list[tuple[str, int, int]]] = [[] for _ in range(readers)]
    done = 0
    for name, size in files:
        start = 0
        while start < size:
            i = min(done // share, readers - 1)
            stop = min(size, start + (i + 1) * share - done)
            shares[i].append((name, start, stop))
            done += stop - start
            start = stop
    return shares


def _read_share(share: list[tuple[str, int, int]], buffers: list[torch.Tensor] | None) -> None:
    for index, (name, start, stop) in enumerate(share):
        buffer = buffers[index] if buffers is not None else torch.empty(stop - start, dtype=torch.uint8)
        view = buffer.numpy().data.cast("B")
        fd = os.open(name, os.O_RDONLY)
        try:
            at = 0
            while at < stop - start:
                got = os.preadv(fd, [view[at : min(at + _PIECE, stop - start)]], start + at)
                if got <= 0:
                    raise EOFError(f"{name} ended early")
                at += got
        finally:
            os.close(fd)


def _plain_read(path: str, readers: int, ready: bool) -> Callable[[str], None]:
    shares = _ranges(path, readers)
    buffers = (
        [[torch.zeros(stop - start, dtype=torch.uint8) for _, start, stop in s] for s in shares] if ready else None
    )

    def run(out: str) -> None:
        with cf.ThreadPoolExecutor(readers) as pool:
            list(pool.map(_read_share, shares, buffers or [None] * readers))

    return run


def load_cases(paths: dict[str, str], workers: int) -> list[Case]:
    """Every row of a load scenario, for each checkpoint in ``paths``, at ``workers`` threads."""
    cases: list[Case] = []
    targets = _targets(next(iter(paths.values())))  # both checkpoints hold the same state dict
    for source, path in paths.items():
        tag = f" [{source}]"
        stock, alloc, limit = f"stock dcp.load{tag}", f"stock alloc load{tag}", f"plain read x{workers} ready{tag}"

        def ours(out: str, path: str = path) -> dict[str, Any]:
            stats = parallel_dcp.ReadStats()
            parallel_dcp.load(path, workers=workers, stats=stats)
            return {"fallback": stats.fallback}

        def into(out: str, path: str = path, targets: Any = targets) -> dict[str, Any]:
            stats = parallel_dcp.ReadStats()
            parallel_dcp.load(path, workers=workers, into=targets, stats=stats)
            records = stats.fast + stats.fallback + stats.values
            # what the plan was read from: the side index, or .metadata and why (ReadStats.index)
            return {"fallback": stats.fallback, "records": records, "plan": stats.index and stats.index.summary()}

        def fast_reader(out: str, path: str = path, targets: Any = targets) -> dict[str, Any]:
            reader = parallel_dcp.FastReader(path, workers=workers)
            dcp_load(targets, storage_reader=reader, no_dist=True)
            return {"fallback": reader.stats.fallback}

        def stock_load(out: str, path: str = path, targets: Any = targets) -> None:
            dcp_load(targets, storage_reader=FileSystemReader(path), no_dist=True)

        def stock_alloc(out: str, path: str = path) -> None:
            _load_state_dict_from_keys(storage_reader=FileSystemReader(path))

        cases += [
            Case(name=f"load w={workers}{tag}", family="load", procs=workers, run=ours, baseline=alloc, limit=limit),
            Case(
                name=f"load into w={workers}{tag}",
                family="load into",
                procs=workers,
                run=into,
                baseline=stock,
                limit=limit,
            ),
            Case(
                name=f"FastReader w={workers}{tag}",
                family="FastReader",
                procs=workers,
                run=fast_reader,
                baseline=stock,
                limit=limit,
            ),
            Case(name=stock, family="stock dcp.load", procs=1, run=stock_load, baseline=stock, limit=limit),
            Case(name=alloc, family="stock alloc load", procs=1, run=stock_alloc, baseline=alloc, limit=limit),
            Case(name=limit, family="plain read", procs=workers, run=_plain_read(path, workers, ready=True)),
            Case(
                name=f"plain read x{workers} fresh{tag}",
                family="plain read fresh",
                procs=workers,
                run=_plain_read(path, workers, ready=False),
                limit=limit,
            ),
        ]
    return cases


def load_summary(rows: dict[str, dict[str, Any]], workers: int) -> dict[str, Any]:
    """The issue's targets, per checkpoint: speedups over stock and time over the plain-read limit."""

    def median(name: str) -> float | None:
        value = rows.get(name, {}).get("median_s")
        return float(value) if value else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    result: dict[str, Any] = {"workers": workers}
    for source in SOURCES:
        tag = f" [{source}]"
        stock, alloc = median(f"stock dcp.load{tag}"), median(f"stock alloc load{tag}")
        limit = median(f"plain read x{workers} ready{tag}")
        into, reader = median(f"load into w={workers}{tag}"), median(f"FastReader w={workers}{tag}")
        ours = median(f"load w={workers}{tag}")
        details = rows.get(f"load into w={workers}{tag}", {}).get("details", {})
        records = details.get("records")
        result[source] = {
            "records": records,
            "into_plan": details.get("plan"),
            "into_us_per_record": into / records * 1e6 if into and records else None,
            "into_vs_stock": ratio(stock, into),
            "fast_reader_vs_stock": ratio(stock, reader),
            "load_vs_stock_alloc": ratio(alloc, ours),
            "into_time_vs_limit": ratio(into, limit),
            "fast_reader_time_vs_limit": ratio(reader, limit),
        }
    return result
