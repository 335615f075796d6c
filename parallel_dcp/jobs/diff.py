"""``inspect --diff``: what changed between two checkpoints of any formats, after a migration.

    a, b ── open (headers only) ── keys, dtypes, shapes compared in the coordinator
                                   │
                                   └─ xxh3 of each tensor's bytes, by the worker pool under the
                                      memory limit, one key at a time (nothing held after hashing)
                                   ▼
                  added · removed · renamed (same checksum, dtype and shape, other name) · changed

Only the tensors a comparison needs are hashed: keys in both with the same dtype and shape (is
the content the same?) and keys in only one of them (was it renamed?). A key in both whose dtype
or shape differs is reported as such without reading it. Non-tensor values are compared as values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.engine.partition import Item, Task, partition
from parallel_dcp.engine.pool import WorkerPool
from parallel_dcp.formats import open_source
from parallel_dcp.formats.base import Source
from parallel_dcp.options import Options
from parallel_dcp.storage.location import CLIENT_MEMORY, is_url, locate

__all__ = ["DiffReport", "describe_diff", "diff", "tensor_checksum"]


@dataclass
class DiffReport:
    """Differences from checkpoint ``a`` to checkpoint ``b``; ``same`` when there are none.

    ``renamed`` pairs (name in a, name in b) whose tensors have the same dtype, shape and content
    checksum; ``changed`` lists ``{"key", "change": "dtype"|"shape"|"content"|"value"|"kind",
    "a", "b"}`` for keys in both.
    """

    a: str
    b: str
    format_a: str
    format_b: str
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    renamed: list[tuple[str, str]] = field(default_factory=list)
    changed: list[dict[str, Any]] = field(default_factory=list)
    unchanged: int = 0
    bytes_hashed: int = 0

    @property
    def same(self) -> bool:
        return not (self.added or self.removed or self.renamed or self.changed)

    def as_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "format_a": self.format_a,
            "format_b": self.format_b,
            "same": self.same,
            "added": self.added,
            "removed": self.removed,
            "renamed": [list(pair) for pair in self.renamed],
            "changed": self.changed,
            "unchanged": self.unchanged,
            "bytes_hashed": self.bytes_hashed,
        }


def tensor_checksum(tensor: torch.Tensor) -> str:
    """xxh3-64 of a tensor's bytes in row-major order (its dtype and shape are not included)."""
    hasher = xxhash.xxh3_64()
    if tensor.numel():
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        hasher.update(flat.numpy().data)
    return hasher.hexdigest()


def _hash_handler(sources: dict[str, Source]) -> Any:
    def run(task: Task) -> dict[str, str]:
        digests = {}
        for unit in task.keys:  # one key at a time: a worker holds the largest key, not the task
            side, key = unit.split("\0", 1)
            source = sources[side]
            try:
                digests[unit] = tensor_checksum(source.read([key])[key])
            finally:
                source.release()
        return digests

    return run


def _hash(
    wanted: list[tuple[str, str]], sources: dict[str, Source], options: Options, governor: MemoryGovernor
) -> dict[tuple[str, str], str]:
    """xxh3 of each (side, key) in ``wanted``, computed by the pool under the memory limit."""
    if not wanted:
        return {}
    items = [
        Item(
            f"{side}\0{key}",
            sources[side].entries[key].nbytes,
            sources[side].copied_bytes(key),
            sources[side].transient_bytes(key),
        )
        for side, key in wanted
    ]
    workers = governor.workers_for(((it.key, it.memory) for it in items), options.worker_count(len(items)))
    tasks = partition(items, workers, max_task_memory=governor.task_budget(workers), memory_adds_up=False)
    digests: dict[tuple[str, str], str] = {}
    with WorkerPool(
        min(workers, len(tasks)), _hash_handler(sources), initializer=lambda: torch.set_num_threads(1)
    ) as pool:
        for result in pool.run(tasks, governor=governor, task_timeout=options.task_timeout, retries=options.retries):
            for unit, digest in result.value.items():
                side, key = unit.split("\0", 1)
                digests[(side, key)] = digest
    return digests


def _keys(source: Source) -> list[str]:
    return list(source.entries) + [k for k in source.values if k not in source.entries]


def _describe(source: Source, key: str) -> str:
    entry = source.entries[key]
    return f"{str(entry.dtype).removeprefix('torch.')}{list(entry.shape)}"


def _compare(a: Source, b: Source, options: Options, governor: MemoryGovernor) -> DiffReport:
    report = DiffReport(a=a.path, b=b.path, format_a=a.kind, format_b=b.kind)
    keys_a, keys_b = _keys(a), _keys(b)
    in_b = set(keys_b)
    in_a = set(keys_a)
    common = [k for k in keys_a if k in in_b]
    only_a = [k for k in keys_a if k not in in_b]
    only_b = [k for k in keys_b if k not in in_a]

    wanted: list[tuple[str, str]] = []
    for key in common:
        tensor_a, tensor_b = key in a.entries, key in b.entries
        if tensor_a != tensor_b:
            kinds = ("tensor" if tensor_a else "value", "tensor" if tensor_b else "value")
            report.changed.append({"key": key, "change": "kind", "a": kinds[0], "b": kinds[1]})
        elif not tensor_a:
            if a.values[key] != b.values[key]:
                report.changed.append(
                    {"key": key, "change": "value", "a": repr(a.values[key]), "b": repr(b.values[key])}
                )
        elif a.entries[key].dtype != b.entries[key].dtype:
            report.changed.append({"key": key, "change": "dtype", "a": _describe(a, key), "b": _describe(b, key)})
        elif a.entries[key].shape != b.entries[key].shape:
            report.changed.append({"key": key, "change": "shape", "a": _describe(a, key), "b": _describe(b, key)})
        else:
            wanted += [("a", key), ("b", key)]
    wanted += [("a", k) for k in only_a if k in a.entries] + [("b", k) for k in only_b if k in b.entries]
    sources = {"a": a, "b": b}
    digests = _hash(wanted, sources, options, governor)
    report.bytes_hashed = sum(sources[side].entries[key].nbytes for side, key in wanted)

    content_changed = set()
    for key in common:
        if ("a", key) in digests and digests[("a", key)] != digests[("b", key)]:
            content_changed.add(key)
            report.changed.append({"key": key, "change": "content", "a": digests[("a", key)], "b": digests[("b", key)]})
    changed_keys = {c["key"] for c in report.changed}
    report.unchanged = sum(1 for k in common if k not in changed_keys)

    # A removed tensor and an added one with the same dtype, shape and bytes: a rename.
    def identity(source: Source, side: str, key: str) -> tuple[Any, ...]:
        entry = source.entries[key]
        return (entry.dtype, entry.shape, digests[(side, key)])

    pool: dict[tuple[Any, ...], list[str]] = {}
    for key in only_a:
        if key in a.entries:
            pool.setdefault(identity(a, "a", key), []).append(key)
    matched = set()
    for key in only_b:
        candidates = pool.get(identity(b, "b", key)) if key in b.entries else None
        if candidates:
            old = candidates.pop(0)
            matched.add(old)
            report.renamed.append((old, key))
        else:
            report.added.append(key)
    report.removed = [k for k in only_a if k not in matched]
    return report


def diff(
    a: str | os.PathLike[str], b: str | os.PathLike[str], options: Options, *, trust_pickle: bool = False
) -> DiffReport:
    """See :func:`parallel_dcp.diff`."""
    for where in (a, b):
        locate(where, options.storage_options)
    governor = MemoryGovernor(options.memory_ceiling())
    if is_url(a) or is_url(b):
        governor.worker_extra = CLIENT_MEMORY
    first = open_source(a, storage_options=options.storage_options, trust_pickle=trust_pickle)
    try:
        second = open_source(b, storage_options=options.storage_options, trust_pickle=trust_pickle)
        try:
            for side in (first, second):  # damaged files found, unsafe values refused, before any read
                side.check()
                side.load_values(k for k in side.values if k not in side.entries)
            return _compare(first, second, options, governor)
        finally:
            second.close()
    finally:
        first.close()


def describe_diff(report: DiffReport) -> str:
    """A human-readable listing of a :class:`DiffReport`."""
    lines = [f"{report.a} ({report.format_a}) -> {report.b} ({report.format_b})"]
    if report.same:
        lines.append(f"  the same: {report.unchanged} keys, same dtypes, shapes and content")
        return "\n".join(lines)
    lines.append(
        f"  {len(report.added)} added, {len(report.removed)} removed, {len(report.renamed)} renamed, "
        f"{len(report.changed)} changed, {report.unchanged} unchanged"
    )
    lines += [f"  + {k}" for k in report.added]
    lines += [f"  - {k}" for k in report.removed]
    lines += [f"  renamed {old} -> {new}" for old, new in report.renamed]
    for c in report.changed:
        lines.append(f"  changed {c['key']}: {c['change']} {c['a']} -> {c['b']}")
    return "\n".join(lines)
