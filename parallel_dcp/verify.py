"""Verify a checkpoint: checksums from the manifest, every tensor read back, optionally compared.

    files ── manifest sizes + xxh3 checksums, hashed by the pool ───────────┐
    keys  ── each read back by the pool (and from --against, compared       ├─▶ VerifyReport
             bit for bit: dtype, shape and bytes, NaNs included)  ─────────┘

Every problem is reported (not only the first); a worker that cannot read a key reports it as a
problem rather than failing the run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.formats import open_source
from parallel_dcp.formats.base import Source
from parallel_dcp.manifest import FileDigest, file_digest, read_manifest
from parallel_dcp.memory import MemoryGovernor
from parallel_dcp.options import Options
from parallel_dcp.partition import Item, Task, partition
from parallel_dcp.pool import WorkerPool
from parallel_dcp.storage import CLIENT_MEMORY, Location, is_url, locate

__all__ = ["VerifyReport", "verify"]


@dataclass
class VerifyReport:
    """What ``verify`` checked and every problem it found; ``ok`` when there are none."""

    path: str
    format: str
    files_checked: int = 0
    keys_checked: int = 0
    bytes_checked: int = 0
    manifest: bool = False
    against: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "ok": self.ok,
            "manifest": self.manifest,
            "against": self.against,
            "files_checked": self.files_checked,
            "keys_checked": self.keys_checked,
            "bytes_checked": self.bytes_checked,
            "problems": self.problems,
        }


def _same(a: Any, b: Any) -> str | None:
    """None when equal bit for bit, else what differs."""
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return f"one is a tensor, the other a {type(b if isinstance(a, torch.Tensor) else a).__name__}"
    if not isinstance(a, torch.Tensor):
        return None if a == b else f"value {a!r} != {b!r}"
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} != {b.dtype}"
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    if a.numel() == 0:
        return None
    bits_a = a.contiguous().reshape(-1).view(torch.uint8)
    bits_b = b.contiguous().reshape(-1).view(torch.uint8)
    if torch.equal(bits_a, bits_b):
        return None
    first = int((bits_a != bits_b).nonzero()[0, 0]) // a.element_size()
    return f"data differs (first at element {first} of {a.numel()})"


def _read_cost(source: Source, reference: Source | None, key: str) -> int:
    """Memory a worker needs to check ``key``: its read here, and in the reference."""
    cost = source.copied_bytes(key)
    if reference is not None and key in reference.entries:
        cost += reference.copied_bytes(key)
    return cost


def _compare_handler(source: Source, reference: Source | None) -> Any:
    def run(task: Task) -> list[str]:
        problems = []
        for key in task.keys:  # one key at a time: memory is the largest key, not the task
            try:
                mine = source.read([key])[key] if key in source.entries else source.values[key]
                if reference is not None:
                    theirs = reference.read([key])[key] if key in reference.entries else reference.values[key]
                    diff = _same(mine, theirs)
                    if diff is not None:
                        problems.append(f"{key}: {diff}")
            except Exception as exc:
                problems.append(f"{key}: cannot be read: {type(exc).__name__}: {exc}")
            finally:
                source.release()
                if reference is not None:
                    reference.release()
        return problems

    return run


def _hash_handler(directory: Location, recorded: dict[str, FileDigest]) -> Any:
    def run(task: Task) -> list[str]:
        problems = []
        for name in task.keys:
            path = directory / name
            if not path.is_file():
                problems.append(f"file {name}: missing")
                continue
            want = recorded[name]
            found = file_digest(path, checksum=want.digest is not None)
            if found.size != want.size:
                problems.append(f"file {name}: {found.size} bytes, the manifest records {want.size} (truncated?)")
            elif want.digest is not None and found.digest != want.digest:
                problems.append(f"file {name}: checksum {found.digest} != {want.digest} recorded (corrupted)")
        return problems

    return run


def _run(tasks: list[Task], handler: Any, options: Options, governor: MemoryGovernor, workers: int) -> list[str]:
    problems: list[str] = []
    if not tasks:
        return problems
    with WorkerPool(min(workers, len(tasks)), handler, initializer=lambda: torch.set_num_threads(1)) as pool:
        for result in pool.run(tasks, governor=governor, task_timeout=options.task_timeout, retries=options.retries):
            problems.extend(result.value)
    return problems


def verify(
    path: str | os.PathLike[str],
    against: str | os.PathLike[str] | None,
    options: Options,
    *,
    trust_pickle: bool = False,
) -> VerifyReport:
    """See :func:`parallel_dcp.verify`."""
    for where in (path, against):
        if where is not None:
            locate(where, options.storage_options)  # a bad URL fails here; its filesystem is loaded
    governor = MemoryGovernor(options.memory_ceiling())
    if any(is_url(where) for where in (path, against)):
        governor.worker_extra = CLIENT_MEMORY  # each worker's own connection
    source = open_source(path, storage_options=options.storage_options, trust_pickle=trust_pickle)
    try:
        reference = (
            open_source(against, storage_options=options.storage_options, trust_pickle=trust_pickle)
            if against is not None
            else None
        )
        try:
            return _verify(source, reference, options, governor)
        finally:
            if reference is not None:
                reference.close()
    finally:
        source.close()


def _verify(source: Source, reference: Source | None, options: Options, governor: MemoryGovernor) -> VerifyReport:
    against = reference.path if reference is not None else None
    report = VerifyReport(path=source.path, format=source.kind, against=against)
    directory = source.location if source.location.is_dir() else None
    recorded = read_manifest(directory, current_only=True) if directory is not None else None
    workers = options.worker_count(max(1, len(source.entries)))

    if recorded is not None:
        assert directory is not None
        report.manifest = True
        sizes = [Item(name, d.size, 0) for name, d in recorded.items()]
        tasks = partition(sizes, workers, memory_adds_up=False)
        report.problems += _run(tasks, _hash_handler(directory, recorded), options, governor, workers)
        report.files_checked = len(recorded)

    keys = list(source.entries) + [k for k in source.values if k not in source.entries]
    if reference is not None:
        theirs = set(reference.entries) | set(reference.values)
        report.problems += [f"{k}: not in {against}" for k in keys if k not in theirs]
        report.problems += [f"{k}: in {against} but missing here" for k in sorted(theirs - set(keys))]
        keys = [k for k in keys if k in theirs]
    try:  # damaged shards are found before reading; unsafe values are refused by name
        source.check(keys)
    except CorruptCheckpointError as exc:
        report.problems.append(str(exc))
        return report
    for side in (source, reference):
        if side is not None:
            side.load_values(k for k in keys if k not in side.entries and k in side.values)
    items = [Item(k, source.entries[k].nbytes, _read_cost(source, reference, k)) for k in keys if k in source.entries]
    items += [Item(k, 0, 0) for k in keys if k not in source.entries]
    workers = governor.workers_for(((it.key, it.memory) for it in items), workers)
    tasks = partition(items, workers, max_task_memory=governor.task_budget(workers), memory_adds_up=False)
    report.problems += _run(tasks, _compare_handler(source, reference), options, governor, workers)
    report.keys_checked = len(keys)
    report.bytes_checked = sum(it.nbytes for it in items)
    return report
