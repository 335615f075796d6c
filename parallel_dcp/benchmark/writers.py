"""The writers compared on one state dict, each as a :class:`Case` writing the same bytes to ``out``.

- ``parallel_dcp w=n``: ``parallel_dcp.save`` with its defaults at n workers (executor "auto":
  writer threads for large tensors, forked workers for many small ones; CRC off; checksums on).
- ``parallel_dcp w=N processes`` / ``no-checksums`` (N the most workers): forked workers forced,
  and the manifest's checksums off: what each default costs or saves.
- ``stock dcp t=n``: ``dcp.save`` with ``FileSystemWriter(thread_count=n)``, torch's defaults.
- ``stock dcp t=n crc-off``: the same with ``torch.serialization.set_crc32_options(False)``.
  That switch is thread-local in torch 2.13: it reaches only the files the calling thread writes,
  which is all of them at t=1 and the calling thread's share at t>1.
- ``torch.save`` and ``safetensors``: one file, one thread (safetensors holds tensors only).
- the limits: ``plain write xn`` (n forked processes write the tensors' ready buffers, no
  serialization) and ``memcpy`` (copying the bytes in RAM, no file at all).

With ``sync`` on, every writer makes its files durable (fsync) before it returns, as DCP's
``sync_files=True`` does; with it off none does.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import parallel_dcp
from parallel_dcp.benchmark.measure import Case

__all__ = ["CRC_NOTE", "flat_tensors", "limit_cases", "memcpy", "plain_write", "save_cases"]

CRC_NOTE = (
    "crc-off: torch.serialization.set_crc32_options(False) is thread-local in torch 2.13, so it reaches only the"
    " files that dcp.save writes in the calling thread: all of them at t=1, the calling thread's share at t>1"
)


def flat_tensors(state_dict: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict under a dotted name (DCP's flattening of dicts and lists)."""
    if isinstance(state_dict, torch.Tensor):
        return {prefix: state_dict}
    if isinstance(state_dict, dict):
        items: Any = state_dict.items()
    elif isinstance(state_dict, list):
        items = enumerate(state_dict)
    else:
        return {}
    flat: dict[str, torch.Tensor] = {}
    for key, value in items:
        flat.update(flat_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def fsync_file(path: str) -> None:
    """Make a file that was written through Python's buffers durable (what ``sync_files`` means)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plain_write(tensors: list[torch.Tensor], out: str, writers: int, sync: bool = True) -> None:
    """The storage's limit: ``writers`` forked processes write ready buffers (no serialization).

    Tensors are dealt largest first to the least loaded writer; writer i writes ``out/part{i}``.

    Raises:
        RuntimeError: a writer failed (its exit status is given).
    """
    os.makedirs(out)
    shares: list[list[torch.Tensor]] = [[] for _ in range(writers)]
    sizes = [0] * writers
    for t in sorted(tensors, key=lambda t: t.nbytes, reverse=True):
        i = sizes.index(min(sizes))
        shares[i].append(t)
        sizes[i] += t.nbytes
    pids = []
    for i, share in enumerate(shares):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child, which leaves by os._exit only
            code = 0
            try:
                with open(os.path.join(out, f"part{i}"), "wb") as f:
                    for t in share:
                        f.write(t.contiguous().view(torch.uint8).numpy().data)
                    if sync:
                        f.flush()
                        os.fsync(f.fileno())
            except BaseException:
                code = 1
            os._exit(code)
        pids.append(pid)
    statuses = [os.waitpid(pid, 0)[1] for pid in pids]  # reap every writer before judging any
    failed = [status for status in statuses if status != 0]
    if failed:
        raise RuntimeError(f"plain writer failed (wait status {failed[0]})")


def memcpy(tensors: list[torch.Tensor]) -> None:
    """Copy every tensor into freshly allocated memory (the RAM ceiling, page faults included)."""
    for t in tensors:
        torch.empty_like(t).copy_(t)


def _parallel_dcp(state_dict: Any, workers: int, sync: bool, variant: str = "") -> Case:
    """``variant``: "" (the defaults), "processes" (forked workers forced), "no-checksums", or
    "unsplit" (no tensor split into chunks)."""
    variants: dict[str, dict[str, Any]] = {
        "processes": {"executor": "processes"},
        "no-checksums": {"checksums": False},
        "unsplit": {"chunk_size": 2**62},
    }
    options = variants.get(variant, {})

    def run(out: str) -> dict[str, Any]:
        result = parallel_dcp.save(state_dict, out, workers=workers, sync_files=sync, **options)
        return {
            "workers_used": result.workers,
            "tasks": result.tasks,
            "files": result.files,
            "executor": result.executor,
        }

    return Case(
        name=f"parallel_dcp w={workers}" + (f" {variant}" if variant else ""),
        family="parallel_dcp" + (f" {variant}" if variant else ""),
        procs=workers,
        run=run,
        baseline=f"stock dcp t={workers}",
        limit=f"plain write x{workers}",
    )


def unsplit_case(state_dict: Any, workers: int, sync: bool) -> Case:
    """parallel_dcp with whole keys as the unit of work (what chunking is measured against)."""
    return _parallel_dcp(state_dict, workers, sync, "unsplit")


def _stock(state_dict: Any, threads: int, sync: bool, crc_off: bool) -> Case:
    def run(out: str) -> None:
        writer = FileSystemWriter(out, thread_count=threads, sync_files=sync)
        if not crc_off:  # torch's defaults, untouched
            dcp_save(state_dict, storage_writer=writer, no_dist=True)
            return
        previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            dcp_save(state_dict, storage_writer=writer, no_dist=True)
        finally:
            torch.serialization.set_crc32_options(previous)

    return Case(
        name=f"stock dcp t={threads}" + (" crc-off" if crc_off else ""),
        family="stock dcp crc-off" if crc_off else "stock dcp",
        procs=threads,
        run=run,
        baseline=f"stock dcp t={threads}" if crc_off else None,
        limit=f"plain write x{threads}",
        note="only the calling thread's files lose their CRC (see note)" if crc_off and threads > 1 else "",
    )


def _torch_save(state_dict: Any, sync: bool) -> Case:
    def run(out: str) -> None:
        os.makedirs(out)
        path = os.path.join(out, "model.pt")
        torch.save(state_dict, path)
        if sync:
            fsync_file(path)

    return Case(
        name="torch.save", family="torch.save", procs=1, run=run, baseline="stock dcp t=1", limit="plain write x1"
    )


def _safetensors(state_dict: Any, tensors: dict[str, torch.Tensor], sync: bool) -> Case:
    def run(out: str) -> None:
        os.makedirs(out)
        path = os.path.join(out, "model.safetensors")
        save_file(tensors, path)
        if sync:
            fsync_file(path)

    only_tensors = len(tensors) != _leaf_count(state_dict)
    return Case(
        name="safetensors",
        family="safetensors",
        procs=1,
        run=run,
        baseline="stock dcp t=1",
        limit="plain write x1",
        note="tensors only (no place for other values)" if only_tensors else "",
    )


def _leaf_count(state_dict: Any) -> int:
    if isinstance(state_dict, dict):
        return sum(_leaf_count(v) for v in state_dict.values())
    if isinstance(state_dict, list):
        return sum(_leaf_count(v) for v in state_dict)
    return 1


def _plain(tensors: list[torch.Tensor], writers: int, sync: bool) -> Case:
    def run(out: str) -> None:
        plain_write(tensors, out, writers, sync)

    return Case(name=f"plain write x{writers}", family="plain write", procs=writers, run=run)


def _memcpy(tensors: list[torch.Tensor]) -> Case:
    def run(out: str) -> None:
        memcpy(tensors)

    note = f"no file: the RAM ceiling (copy_ may use {torch.get_num_threads()} intra-op threads)"
    return Case(name="memcpy (RAM)", family="memcpy", procs=1, run=run, note=note)


def limit_cases(tensors: list[torch.Tensor], counts: list[int], sync: bool) -> list[Case]:
    """The plain write at every process count in ``counts``, and the memcpy figure."""
    return [*(_plain(tensors, n, sync) for n in counts), _memcpy(tensors)]


def save_cases(
    state_dict: Any, workers: list[int], sync: bool, peers: list[Case], with_files: bool = True
) -> list[Case]:
    """All writers of a save suite on ``state_dict``, in the order the table shows them.

    ``peers`` come after stock DCP; ``with_files`` adds the one-file writers (torch.save,
    safetensors). The limits (plain write at every count, memcpy) come last.
    """
    flat = flat_tensors(state_dict)
    cases = [_parallel_dcp(state_dict, n, sync) for n in workers]
    # What the defaults cost: forked workers instead of writer threads, and the manifest's checksums.
    cases += [_parallel_dcp(state_dict, max(workers), sync, variant) for variant in ("processes", "no-checksums")]
    cases += [_stock(state_dict, n, sync, crc_off=False) for n in workers]
    cases += [_stock(state_dict, n, sync, crc_off=True) for n in workers]
    cases += peers
    if with_files:
        cases += [_torch_save(state_dict, sync), _safetensors(state_dict, flat, sync)]
    return cases + limit_cases(list(flat.values()), workers, sync)
