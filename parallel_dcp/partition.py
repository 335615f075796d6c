"""Split a flat state dict into disjoint tasks of about equal cost.

A task is the unit of work a worker runs: one ``partial_save`` (or ``partial_load``) of a key
subset, with its own part index. The cost of a key is its bytes plus a fixed per-item overhead
(planning, one ``torch.save`` record, pickling its metadata), so that 50,000 tiny optimizer
entries spread as evenly as a few large embeddings do.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Item", "Task", "partition"]

# What one item costs beyond its bytes, in byte-equivalents: about 40 us of Python work per
# ``torch.save`` record at ~1.5 GiB/s.
ITEM_OVERHEAD_BYTES = 64 * 1024
# Several tasks per worker let a fast worker take over work from a slow one.
TASKS_PER_WORKER = 4
# ...but a task below this size costs more in per-task overhead than it gains in balance.
MIN_TASK_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Item:
    """One flattened key and the bytes it will take (0 for small non-tensor values)."""

    key: str
    nbytes: int

    @property
    def cost(self) -> int:
        return self.nbytes + ITEM_OVERHEAD_BYTES


@dataclass(frozen=True, slots=True)
class Task:
    """A disjoint set of keys, run as one part with its own ``part_idx`` (= ``index``)."""

    index: int
    keys: tuple[str, ...]
    nbytes: int


def partition(items: Sequence[Item], workers: int, *, max_task_bytes: int | None = None) -> list[Task]:
    """Group ``items`` into disjoint tasks balanced by cost, largest first.

    Args:
        items: the keys to distribute; each key must appear once.
        workers: how many workers will run the tasks; there are at least this many tasks
            when there are that many items.
        max_task_bytes: an upper bound on a task's bytes where it can be kept (a single item
            larger than it becomes a task of its own).

    Returns:
        Tasks with indices ``0..n-1`` ordered by decreasing cost, so that dispatching them in
        order to whichever worker is free keeps workers evenly loaded (longest-processing-time
        first). Every item lands in exactly one task.

    Raises:
        ValueError: ``workers < 1`` or a key appears twice.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    keys = [item.key for item in items]
    if len(set(keys)) != len(keys):
        raise ValueError("partition needs unique keys")
    if not items:
        return []
    total = sum(item.cost for item in items)
    wanted = max(workers * TASKS_PER_WORKER, 1)
    wanted = min(wanted, max(workers, math.ceil(total / MIN_TASK_BYTES)))
    if max_task_bytes is not None:
        wanted = max(wanted, math.ceil(sum(item.nbytes for item in items) / max(max_task_bytes, 1)))
    n_bins = min(len(items), wanted)

    # Greedy LPT: largest item into the currently cheapest bin.
    bins: list[list[Item]] = [[] for _ in range(n_bins)]
    heap = [(0, i) for i in range(n_bins)]
    for item in sorted(items, key=lambda it: it.cost, reverse=True):
        cost, i = heapq.heappop(heap)
        bins[i].append(item)
        heapq.heappush(heap, (cost + item.cost, i))

    bins = [b for b in bins if b]
    bins.sort(key=lambda b: sum(it.cost for it in b), reverse=True)
    return [
        Task(index=i, keys=tuple(it.key for it in b), nbytes=sum(it.nbytes for it in b)) for i, b in enumerate(bins)
    ]


def items_of(flat: Mapping[str, object]) -> list[Item]:
    """Items for a flat state dict: a tensor counts its bytes, any other value counts 0."""
    import torch

    return [
        Item(key, value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0)
        for key, value in flat.items()
    ]
