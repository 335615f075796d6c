"""``inspect --diff``: what changed between two checkpoints of any formats, after a migration.

    a, b ── open (headers only) ── keys, dtypes, shapes compared in the coordinator
                                   │
                                   └─ xxh3 of each tensor's bytes, by the worker pool under the
                                      memory limit, one key at a time (nothing held after hashing)
                                   ▼
                  added · removed · renamed (same checksum, dtype and shape, other name) · changed

Only the tensors a comparison needs are hashed: keys in both with the same dtype and shape (is
the content the same?) and keys in only one of them (was it renamed?). A key in both whose dtype
or shape differs is reported as such without reading it. Non-tensor values are compared as values:
containers element by element, tensors in them by dtype, shape and bits (a NaN equals the same NaN).
A key in both whose path passes an int key (an optimizer's parameter index) in one and another
key (``'0'``) in the other has changed its key type (jobs/key_types.py), whatever its bytes.

A tensor whose read does not fit in what one task may use under the memory limit is hashed in row
ranges, as ``verify`` compares it: one split threshold for the whole run (so both sides of a
comparison, and both tensors of a possible rename, are cut the same way), and the tensor's digest
is then the xxh3 of its ranges' digests. A unit of work is named by its key (both sides of a key
in both are hashed by one unit, one side after the other), so every message names keys as they are.

Longer than 300 lines because the memory-bounded hashing plan (row ranges, one threshold) and the
comparison it serves form one job.
"""

from __future__ import annotations

import os
import struct
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from parallel_dcp.engine.chunks import MIN_MEMORY_CHUNK_BYTES, Chunk, ChunkUnit, chunk_count, split
from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.engine.partition import Item, Task, partition
from parallel_dcp.engine.pool import WorkerPool
from parallel_dcp.errors import key_name, plural, printable
from parallel_dcp.formats import open_source
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.validate import empty_mapping
from parallel_dcp.jobs.key_types import key_type_changes, why_key_types_matter
from parallel_dcp.options import Options
from parallel_dcp.storage.location import CLIENT_MEMORY, is_url, locate

__all__ = ["DiffReport", "describe_diff", "diff", "tensor_checksum", "values_equal"]


@dataclass
class DiffReport:
    """Differences from checkpoint ``a`` to checkpoint ``b``; ``same`` when there are none.

    ``renamed`` pairs (name in a, name in b) whose tensors have the same dtype, shape and content
    checksum; ``changed`` lists ``{"key", "change": "dtype"|"shape"|"content"|"value"|"kind"|"key type",
    "a", "b"}`` for keys in both ("key type": a level of the key's path is a key that is not a
    string in one, an optimizer's int index, and another key in the other: ``"a"`` and ``"b"`` say
    how each holds it, ``"key 0 (int) under optimizer.state"``; a key may also change content).
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


def values_equal(a: Any, b: Any) -> bool:
    """Whether two non-tensor values are the same: containers element by element (same type and
    length), tensors by dtype, shape and bits, floats by their bits (as tensors are: -0.0 is not
    0.0, a NaN is the same NaN); never raises."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape or a.layout != b.layout or a.is_sparse or b.is_sparse:
            return False
        return _same_bits(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    try:
        return bool(a == b)
    except Exception:  # a type whose == raises or is not a truth value: compare what it shows
        return repr(a) == repr(b)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0:
        return True
    return torch.equal(
        a.detach().contiguous().reshape(-1).view(torch.uint8), b.detach().contiguous().reshape(-1).view(torch.uint8)
    )


@dataclass(frozen=True, slots=True)
class _Unit:
    """What one unit of work hashes: ``key`` (or ``chunk`` of it) on each of ``sides``."""

    key: str
    sides: tuple[str, ...]
    chunk: Chunk | None = None


def _hash_handler(sources: dict[str, Source], units: dict[str, _Unit]) -> Any:
    def run(task: Task) -> dict[str, dict[str, str]]:
        digests: dict[str, dict[str, str]] = {}
        for name in task.keys:  # one unit, one side at a time: a worker holds the largest read only
            unit = units[name]
            for side in unit.sides:
                source = sources[side]
                try:
                    tensor = source.read_chunk(unit.chunk) if unit.chunk else source.read([unit.key])[unit.key]
                    digests.setdefault(name, {})[side] = tensor_checksum(tensor)
                    del tensor
                finally:
                    source.release()
        return digests

    return run


def _memory(sources: dict[str, Source], unit: _Unit) -> int:
    """What a worker allocates for ``unit``: the largest of its reads (the sides are read in turn)."""
    return max(
        sources[side].chunk_memory(unit.chunk) if unit.chunk else sources[side].copied_bytes(unit.key)
        for side in unit.sides
    )


def _units(
    wanted: dict[str, tuple[str, ...]],
    sources: dict[str, Source],
    threshold: int,
    governor: MemoryGovernor,
    *,
    keep: bool = False,
) -> dict[str, _Unit]:
    """Every wanted key as one unit, or (larger than ``threshold``) as its row ranges, admitted by
    the governor before they are built (``keep``: this is the plan, not a trial)."""
    units: dict[str, _Unit] = {}
    for key, sides in wanted.items():
        entry = sources[sides[0]].entries[key]
        pieces = []
        if entry.nbytes > threshold:
            governor.admit_units(key, chunk_count(entry, threshold), entry.nbytes, keep=keep)
            pieces = split(entry, threshold)
        if not pieces:
            units[key] = _Unit(key, sides)
        for piece in pieces:
            units[ChunkUnit(piece)] = _Unit(key, sides, piece)  # equal to no key, whatever its name
    return units


def _plan(
    wanted: dict[str, tuple[str, ...]], sources: dict[str, Source], room: int, governor: MemoryGovernor
) -> dict[str, _Unit]:
    """Units whose reads fit in ``room``: one split threshold, halved until every unit fits. When
    none fits (down to ranges of ``MIN_MEMORY_CHUNK_BYTES``, or a source whose range reads cost
    as much as whole ones), the cheapest plan: the governor then refuses it, naming its key."""
    too_big = {
        key: sides for key, sides in wanted.items() if max(sources[side].copied_bytes(key) for side in sides) > room
    }
    if not too_big:
        return _units(wanted, sources, sys.maxsize, governor, keep=True)
    best = (
        max(_memory(sources, unit) for unit in _units(too_big, sources, sys.maxsize, governor).values()),
        sys.maxsize,
    )
    threshold = max(sources[sides[0]].entries[key].nbytes for key, sides in too_big.items())
    while threshold > MIN_MEMORY_CHUNK_BYTES and best[0] > room:
        threshold = max(MIN_MEMORY_CHUNK_BYTES, threshold // 2)
        worst = max(_memory(sources, unit) for unit in _units(too_big, sources, threshold, governor).values())
        best = min(best, (worst, threshold), key=lambda pair: pair[0])
    return _units(wanted, sources, best[1], governor, keep=True)


def _hash(
    wanted: list[tuple[str, str]], sources: dict[str, Source], options: Options, governor: MemoryGovernor
) -> dict[tuple[str, str], str]:
    """xxh3 of each (side, key) in ``wanted``, computed by the pool under the memory limit."""
    if not wanted:
        return {}
    by_key: dict[str, tuple[str, ...]] = {}
    for side, key in wanted:
        by_key[key] = (*by_key.get(key, ()), side)
    workers = options.worker_count(len(by_key))
    # As many workers as leave each task room for a row range of at least MIN_MEMORY_CHUNK_BYTES.
    while workers > 1 and governor.unit_room(workers) < 3 * MIN_MEMORY_CHUNK_BYTES:
        workers -= 1
    units = _plan(by_key, sources, governor.unit_room(workers), governor)
    items = []
    for name, unit in units.items():
        first = sources[unit.sides[0]]
        entry = first.entries[unit.key]
        nbytes = unit.chunk.nbytes(entry.dtype.itemsize) if unit.chunk else entry.nbytes
        transient = max(sources[side].transient_bytes(unit.key) for side in unit.sides)
        items.append(Item(name, nbytes, _memory(sources, unit), transient))
    workers = governor.workers_for(((it.key, it.memory) for it in items), workers)
    tasks = partition(items, workers, max_task_memory=governor.task_budget(workers), memory_adds_up=False)
    hashed: dict[str, dict[str, str]] = {}
    with (
        WorkerPool(
            min(workers, len(tasks)), _hash_handler(sources, units), initializer=lambda: torch.set_num_threads(1)
        ) as pool,
        governor.during("hashing"),
    ):
        for result in pool.run(tasks, governor=governor, task_timeout=options.task_timeout, retries=options.retries):
            hashed.update(result.value)
    names_of: dict[str, list[str]] = {}
    for name, unit in units.items():  # in the order of the ranges
        names_of.setdefault(unit.key, []).append(name)
    digests = {}
    for key, sides in by_key.items():
        names = names_of[key]
        for side in sides:
            if units[names[0]].chunk is None:
                digests[(side, key)] = hashed[names[0]][side]
            else:  # row ranges: the digest of their digests, in order
                joined = "\n".join(hashed[name][side] for name in names)
                digests[(side, key)] = xxhash.xxh3_64(joined.encode()).hexdigest()
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
    # (an empty mapping a torch.save file holds and another format drops is no difference)
    only_a = [k for k in keys_a if k not in in_b and not empty_mapping(a.values.get(k))]
    only_b = [k for k in keys_b if k not in in_a and not empty_mapping(b.values.get(k))]

    wanted: list[tuple[str, str]] = []
    for key in common:
        tensor_a, tensor_b = key in a.entries, key in b.entries
        if tensor_a != tensor_b:
            kinds = ("tensor" if tensor_a else "value", "tensor" if tensor_b else "value")
            report.changed.append({"key": key, "change": "kind", "a": kinds[0], "b": kinds[1]})
        elif not tensor_a:
            if not values_equal(a.values[key], b.values[key]):
                report.changed.append(
                    {"key": key, "change": "value", "a": repr(a.values[key]), "b": repr(b.values[key])}
                )
        elif a.entries[key].dtype != b.entries[key].dtype:
            report.changed.append({"key": key, "change": "dtype", "a": _describe(a, key), "b": _describe(b, key)})
        elif a.entries[key].shape != b.entries[key].shape:
            report.changed.append({"key": key, "change": "shape", "a": _describe(a, key), "b": _describe(b, key)})
        else:
            wanted += [("a", key), ("b", key)]
    for key, (held_a, held_b, where) in key_type_changes(a, b, common).items():  # (same names, other keys)
        report.changed.append({"key": key, "change": "key type", "a": f"{held_a} {where}", "b": f"{held_b} {where}"})
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
    governor.hold_coordinator()  # (its workers hash and compare under the limit beside it)
    if is_url(a) or is_url(b):
        governor.worker_extra = CLIENT_MEMORY
    limit = options.memory_ceiling()
    first = open_source(a, storage_options=options.storage_options, trust_pickle=trust_pickle, memory_limit=limit)
    try:
        second = open_source(b, storage_options=options.storage_options, trust_pickle=trust_pickle, memory_limit=limit)
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
    """A human-readable listing of a :class:`DiffReport` (names and values escaped)."""
    lines = [f"{printable(report.a)} ({report.format_a}) -> {printable(report.b)} ({report.format_b})"]
    if report.same:
        lines.append(f"  the same: {plural(report.unchanged, 'key')}, same dtypes, shapes and content")
        return "\n".join(lines)
    lines.append(
        f"  {len(report.added)} added, {len(report.removed)} removed, {len(report.renamed)} renamed, "
        f"{len({c['key'] for c in report.changed})} changed, {report.unchanged} unchanged"
    )
    lines += [f"  + {key_name(k)}" for k in report.added]
    lines += [f"  - {key_name(k)}" for k in report.removed]
    lines += [f"  renamed {key_name(old)} -> {key_name(new)}" for old, new in report.renamed]
    for c in report.changed:
        lines.append(f"  changed {key_name(c['key'])}: {c['change']} {printable(c['a'])} -> {printable(c['b'])}")
    if any(c["change"] == "key type" for c in report.changed):
        lines.append(f"  (a key type: {why_key_types_matter((report.format_a, report.format_b))})")
    return "\n".join(lines)
