"""Split a flat state dict into disjoint tasks of about equal cost.

A task is the unit of work a worker runs: one ``partial_save`` (or ``partial_load``) of a key
subset, with its own part index. The cost of a key is its bytes plus a fixed per-item overhead
(planning, one ``torch.save`` record, pickling its metadata), so that 50,000 tiny optimizer
entries spread as evenly as a few large embeddings do.

Longer than 300 lines because the three ways of filling tasks (consecutive runs of small items,
with or without a memory cap, and largest-first for the rest) share their cost and memory columns
here, and the task count they all cut to.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import itemgetter
from typing import NamedTuple

from parallel_dcp.engine.memory import ITEM_MEMORY_BYTES, TASK_MEMORY_BYTES

__all__ = ["CapRange", "Item", "Task", "one_task_memory", "partition", "planned_as_on", "task_count"]

# What one item costs beyond its bytes, in byte-equivalents: about 40 us of Python work per
# ``torch.save`` record at ~1.5 GiB/s.
ITEM_OVERHEAD_BYTES = 64 * 1024
# Several tasks per worker let a fast worker take over work from a slow one.
TASKS_PER_WORKER = 4
# ...but a task below this size costs more in per-task overhead than it gains in balance.
MIN_TASK_BYTES = 32 * 1024 * 1024
# The coordinator sends every task and takes every result in, for all workers in turn: ~0.4-0.7 ms
# of its CPU a task (docs/performance.md, "the coordinator's per-task work"). A task of at least
# this many bytes per worker keeps that under about a third of what a worker spends on the task
# (~2 ms for 2 MiB at a worker's ~1 GiB/s), however many workers share the one coordinator: at 64
# workers, 111 tasks of 32 MiB for 50,000 small keys kept it busier than the workers.
COORDINATOR_BYTES_PER_WORKER = 2 * 1024 * 1024
# Items this much smaller than a task are cut into consecutive runs instead of spread largest
# first: the balance is as good (within one small item) and a task's keys stay together.
_SMALL_ITEMS_PER_BIN = 8


class Item(NamedTuple):  # a named tuple: built once per key of a 50,000-key job, before any worker starts
    """One flattened key, the bytes it will take, and the memory its worker needs for it.

    ``memory`` is what handling the item adds to its worker beyond shared pages: 0 for a
    contiguous in-memory tensor (read copy-on-write), its bytes for a view that must be copied
    first, its bytes for a tensor read from storage.
    """

    key: str
    nbytes: int
    memory: int = 0
    # The part of ``memory`` its worker frees as soon as the item is read (a read buffer), so a
    # task holds only the largest of its items' transient bytes at once, not their sum.
    transient: int = 0

    @property
    def cost(self) -> int:
        return self.nbytes + ITEM_OVERHEAD_BYTES


@dataclass(frozen=True, slots=True)
class Task:
    """A disjoint set of keys, run as one part with its own ``part_idx`` (= ``index``)."""

    index: int
    keys: tuple[str, ...]
    nbytes: int
    memory: int = 0
    # What the task does before it reads its keys, for the messages that name it ("hashes
    # /src/model.pt (13.5 GiB) whole against its checksum": jobs/source_check.py plan_checks).
    duty: str = ""


@dataclass(slots=True)
class CapRange:
    """The caps (``max_task_memory``) ``lo <= cap < hi`` over which :func:`partition` of the same
    items on the same workers gives the same tasks: every decision it takes from its cap (whether
    one task could hold every item, how many runs, where a run is cut, which bin an item fits) is
    a comparison of a figure with the cap, and each comes out the same there. Filled in by
    :func:`partition`; a planner that outlives one job keeps a plan for the whole range
    (``jobs/plan_reuse.py``: the default limit moves with the memory available, save to save)."""

    lo: float = -math.inf
    hi: float = math.inf

    def __contains__(self, cap: float) -> bool:
        return self.lo <= cap < self.hi

    def fits(self, need: float, cap: float) -> bool:
        """``need <= cap``, noted: the range narrows to the caps on the same side of ``need``."""
        if need <= cap:
            self.lo = max(self.lo, need)
            return True
        self.hi = min(self.hi, need)
        return False


def one_task_memory(items: Sequence[Item], *, memory_adds_up: bool = True) -> int:
    """The memory of one task holding every item of ``items`` (not empty). Under a
    ``max_task_memory`` at least this, :func:`partition` gives the same tasks whatever the limit
    (its :class:`CapRange` then reaches up without end)."""
    kept: int = sum(map(_memory, items)) - (sum(map(_transient, items)) if memory_adds_up else 0)
    largest_read: int = max(map(_transient, items))
    return TASK_MEMORY_BYTES + kept + ITEM_MEMORY_BYTES * len(items) + largest_read


def partition(
    items: Sequence[Item],
    workers: int,
    *,
    max_task_memory: int | None = None,
    memory_adds_up: bool = True,
    caps: CapRange | None = None,
) -> list[Task]:
    """Group ``items`` into disjoint tasks balanced by cost, largest first.

    Args:
        items: the keys to distribute; each key must appear once.
        workers: how many workers will run the tasks; there are at least this many tasks
            when there are that many items.
        max_task_memory: no task's memory goes over this, except a task holding one item that
            alone is larger (the memory governor decides whether that one can run at all). A
            task's memory is ``TASK_MEMORY_BYTES`` plus ``ITEM_MEMORY_BYTES`` per item plus the
            items' buffers.
        memory_adds_up: a task's memory is the sum of its items' (a save keeps every copy of a
            file until the file is written) or, when False, the largest of them (a load frees
            each item's buffer before the next).
        caps: where given, set to the caps over which these very tasks come out (see
            :class:`CapRange`; the whole range where ``max_task_memory`` is None).

    Returns:
        Tasks with indices ``0..n-1`` ordered by decreasing cost, so that dispatching them in
        order to whichever worker is free keeps workers evenly loaded (longest-processing-time
        first). Every item lands in exactly one task.

    Raises:
        ValueError: ``workers < 1`` or a key appears twice.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if len(set(map(_key, items))) != len(items):
        raise ValueError("partition needs unique keys")
    seen = caps if caps is not None else CapRange()
    seen.lo, seen.hi = -math.inf, math.inf
    if not items:
        return []
    if max_task_memory is None:  # (no cap: every comparison fits, whatever the range says)
        return _partition(items, workers, math.inf, memory_adds_up, CapRange())
    return _partition(items, workers, max_task_memory, memory_adds_up, seen)


def _partition(items: Sequence[Item], workers: int, cap: float, memory_adds_up: bool, seen: CapRange) -> list[Task]:
    """:func:`partition` of ``items`` (not empty, keys checked) under ``cap``, noting in ``seen``
    each comparison with the cap."""
    # Column sums (C loops over the named tuples): this runs once over every key of a 50,000-key job.
    total = sum(map(_nbytes, items)) + ITEM_OVERHEAD_BYTES * len(items)
    n_bins = task_count(total, workers, len(items))

    def combined(memory: int, item: Item) -> int:
        buffers = memory + item.memory - item.transient if memory_adds_up else max(memory, item.memory)
        return buffers + ITEM_MEMORY_BYTES

    # Where every item in one task would fit, no bin can overflow: plain LPT, memory added after.
    if seen.fits(one_task_memory(items, memory_adds_up=memory_adds_up), cap):
        largest = max(map(_nbytes, items)) + ITEM_OVERHEAD_BYTES
        if largest * _SMALL_ITEMS_PER_BIN <= total / n_bins:
            return _tasks(_ranges(items, n_bins, total), memory_adds_up)
        return _tasks(_lpt(sorted(items, key=_cost, reverse=True), n_bins), memory_adds_up)
    if max(map(_nbytes, items)) + ITEM_OVERHEAD_BYTES <= total / n_bins / _SMALL_ITEMS_PER_BIN:
        return _tasks(_ranges_within(items, n_bins, total, cap, workers, memory_adds_up, seen), memory_adds_up)
    ordered = sorted(items, key=_cost, reverse=True)
    # Greedy LPT: each item, largest first, into the cheapest bin whose memory still fits it;
    # a new bin when none does. ``memory`` holds what a bin's items keep, ``transient`` the
    # largest read buffer among them (freed before the next item is read).
    bins: list[list[Item]] = [[] for _ in range(n_bins)]
    memory = [0] * n_bins
    transient = [0] * n_bins
    heap = [(0, i) for i in range(n_bins)]
    lightest = _lightest_after(ordered, memory_adds_up)

    def closed(i: int, after: int) -> bool:
        """Bin ``i`` fits none of the items after ``after``: it leaves the heap for good, so
        that a full bin is skipped once, not once per later item (keys x bins)."""
        kept, largest_read = lightest[after]
        if not memory_adds_up:
            return not seen.fits(TASK_MEMORY_BYTES + max(memory[i], kept) + ITEM_MEMORY_BYTES, cap)
        return not seen.fits(
            TASK_MEMORY_BYTES + memory[i] + kept + ITEM_MEMORY_BYTES + max(transient[i], largest_read), cap
        )

    for at, item in enumerate(ordered):
        skipped = []
        while (
            heap
            and bins[heap[0][1]]
            and not seen.fits(
                TASK_MEMORY_BYTES
                + combined(memory[heap[0][1]], item)
                + (max(transient[heap[0][1]], item.transient) if memory_adds_up else 0),
                cap,
            )
        ):
            skipped.append(heapq.heappop(heap))
        if heap:
            cost, i = heapq.heappop(heap)
        else:
            cost, i = 0, len(bins)
            bins.append([])
            memory.append(0)
            transient.append(0)
        bins[i].append(item)
        memory[i] = combined(memory[i], item)
        if memory_adds_up:
            transient[i] = max(transient[i], item.transient)
        heapq.heappush(heap, (cost + item.cost, i))
        for entry in skipped:
            if not closed(entry[1], at):
                heapq.heappush(heap, entry)

    return _ranked(bins, [m + t for m, t in zip(memory, transient, strict=True)])


# Set by planned_as_on: the workers every plan is cut for, whatever the workers given.
_planned_workers: int | None = None


@contextlib.contextmanager
def planned_as_on(workers: int) -> Iterator[None]:
    """Inside, :func:`task_count` (so :func:`partition`) cuts every job into the tasks of a job on
    ``workers`` workers, whatever the workers it is given: the scaling suite measures on one
    worker the coordinator's work for as many tasks as a save on many has (benchmark/pieces.py).
    For benchmarks only: the setting is the whole process's, so no job may run in another thread
    meanwhile, and uses may nest but not overlap across threads."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    global _planned_workers
    before, _planned_workers = _planned_workers, workers
    try:
        yield
    finally:
        _planned_workers = before


def task_count(total: int, workers: int, items: int) -> int:
    """How many tasks :func:`partition` makes of ``items`` keys costing ``total`` byte-equivalents
    on ``workers`` workers: up to ``TASKS_PER_WORKER`` a worker, none smaller than ``MIN_TASK_BYTES``
    or than ``COORDINATOR_BYTES_PER_WORKER`` times the workers, no more than the items, and, above
    one a worker, a whole number a worker (:func:`partition` adds tasks where a memory cap leaves
    them no room). (Tasks of about equal cost run in rounds: five on two
    workers take three tasks' time, where four take two; 111 on 64 workers take two rounds of
    the shorter tasks, where 64 take one of the longer.)"""
    workers = _planned_workers if _planned_workers is not None else workers
    smallest = max(MIN_TASK_BYTES, COORDINATOR_BYTES_PER_WORKER * workers)
    wanted = min(workers * TASKS_PER_WORKER, max(workers, math.ceil(total / smallest)), items)
    return wanted - wanted % workers if wanted > workers else wanted


def _cost(item: Item) -> int:
    return item.nbytes + ITEM_OVERHEAD_BYTES


def _lightest_after(ordered: list[Item], memory_adds_up: bool) -> list[tuple[float, float]]:
    """For each position ``j`` of ``ordered``, lower bounds of what any item after ``j`` adds to a
    bin: the least it keeps (its memory, less its read buffer when memory adds up) and the least
    read buffer; past the last item, bounds that no bin fits (nothing is left to place)."""
    bounds: list[tuple[float, float]] = [(0.0, 0.0)] * len(ordered)
    kept: float = math.inf
    largest_read: float = math.inf
    for j in range(len(ordered) - 1, -1, -1):
        bounds[j] = (kept, largest_read)
        item = ordered[j]
        kept = min(kept, item.memory - item.transient if memory_adds_up else item.memory)
        largest_read = min(largest_read, item.transient)
    return bounds


_key, _nbytes, _memory, _transient = (itemgetter(i) for i in range(4))  # Item's fields, as columns


def _ranges(items: Sequence[Item], n_bins: int, total: int) -> list[list[Item]]:
    """Consecutive runs of ``items`` (in their given order), each of about ``total / n_bins``:
    no run is off by more than one item's cost, and a task's keys stay together in the output
    (its part of ``.metadata`` is one piece, in the source's order).

    An item goes where its middle falls (cuts land within half an item of the ideal): item ``j``
    is in run ``i`` when ``i * total <= middle_j * n_bins < (i + 1) * total``. With ``2 * middle``
    (whole numbers) increasing along the items, each of the ``n_bins - 1`` cuts is one bisection:
    linear in the items, whatever the number of runs."""
    costs = [nbytes + ITEM_OVERHEAD_BYTES for nbytes in map(_nbytes, items)]
    middles = [2 * done + cost for done, cost in zip(accumulate(costs, initial=0), costs)]  # 2x each middle
    cuts = [0] + [bisect_left(middles, -(-2 * i * total // n_bins)) for i in range(1, n_bins)] + [len(items)]
    return [list(items[start:stop]) for start, stop in itertools.pairwise(cuts)]


def _ranges_within(
    items: Sequence[Item], n_bins: int, total: int, cap: float, workers: int, memory_adds_up: bool, seen: CapRange
) -> list[list[Item]]:
    """Consecutive runs of small ``items`` (as :func:`_ranges` cuts them) whose memory each fits
    under ``cap``: as many runs as the job's memory needs at ``cap`` a task (rounded up to whole
    rounds of ``workers``), and a run still over it cut further, in order, where it fills up.
    ``seen`` notes the caps that give the same runs and cuts.

    The greedy split below spreads small keys one by one over the cheapest task: 50,000 small
    tensors under a 493 MB task cap went out as 50,002 one-key pieces over 64 tasks, and the
    commit then built ``.metadata`` and the side index key by key (1.9-2.9 s of the coordinator's
    CPU a save at 16 workers, against 0.26-0.52 s for contiguous runs: docs/performance.md, round
    nine). Runs keep each task's keys together, as without a cap."""
    needed = _held(list(items), memory_adds_up)  # (one task of every item: what the runs share)

    def run_count(needs: int) -> int:  # the runs for ``needs`` tasks' worth of room, as cut below
        runs = max(n_bins, needs)
        return min(-(-runs // workers) * workers if runs > workers else runs, len(items))

    room = int(cap) - TASK_MEMORY_BYTES  # (caps are whole bytes)
    if seen.fits(TASK_MEMORY_BYTES + 1, cap):  # room > 0
        needs = -(-needed // room)  # ceil: the tasks of ``room`` the job's memory fills
        runs = run_count(needs)
        # Every cap whose ``needs`` gives as many runs gives these runs: ``needs`` is monotone
        # in the room, ``run_count`` in ``needs``; the ends found by bisection (a few steps).
        fewest = _first(lambda n: run_count(n) >= runs, 1, needs)
        most = _first(lambda n: run_count(n) > runs, needs, max(needs, len(items) * workers) + 1) - 1
        seen.fits(TASK_MEMORY_BYTES + -(-needed // most), cap)  # needs <= most: room >= needed / most
        if fewest > 1:  # needs >= fewest: room < needed / (fewest - 1), whole bytes
            seen.fits(TASK_MEMORY_BYTES + -(-needed // (fewest - 1)), cap)
    else:
        runs = len(items)
    cut: list[list[Item]] = []
    for run in _ranges(items, runs, total):
        if seen.fits(TASK_MEMORY_BYTES + _held(run, memory_adds_up), cap):
            cut.append(run)
        else:
            cut.extend(_filled_in_order(run, room, memory_adds_up, seen))
    return cut


def _first(holds: Callable[[int], bool], lo: int, hi: int) -> int:
    """The least ``n`` in ``lo..hi`` for which ``holds`` (monotone: False, then True), else ``hi``."""
    while lo < hi:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _filled_in_order(run: list[Item], room: int, memory_adds_up: bool, seen: CapRange) -> list[list[Item]]:
    """``run`` cut, in order, into pieces each holding what fits in ``room`` (an item alone larger
    than ``room`` is a piece of its own, as :func:`partition` promises); ``seen`` notes the caps
    (``room`` + ``TASK_MEMORY_BYTES``) that cut it the same."""
    pieces: list[list[Item]] = [[]]
    kept = largest_read = 0
    fitted, over = -math.inf, math.inf  # the most that fitted, the least that did not
    for item in run:
        for _ in range(2):  # in the current piece, else alone in a new one
            if memory_adds_up:
                now_kept = kept + item.memory - item.transient + ITEM_MEMORY_BYTES
                now_read = max(largest_read, item.transient)
            else:
                now_kept, now_read = max(kept, item.memory) + ITEM_MEMORY_BYTES, 0
            if not pieces[-1]:
                break
            if now_kept + now_read <= room:
                fitted = max(fitted, now_kept + now_read)
                break
            over = min(over, now_kept + now_read)
            pieces.append([])
            kept = largest_read = 0
        pieces[-1].append(item)
        kept, largest_read = now_kept, now_read
    seen.lo, seen.hi = max(seen.lo, TASK_MEMORY_BYTES + fitted), min(seen.hi, TASK_MEMORY_BYTES + over)
    return pieces


def _lpt(ordered: list[Item], n_bins: int) -> list[list[Item]]:
    """Each item, largest first, into the bin with the least cost so far."""
    bins: list[list[Item]] = [[] for _ in range(n_bins)]
    heap = [(0, i) for i in range(n_bins)]
    for item in ordered:
        cost, i = heap[0]
        bins[i].append(item)
        heapq.heapreplace(heap, (cost + item.nbytes + ITEM_OVERHEAD_BYTES, i))
    return bins


def _tasks(bins: list[list[Item]], memory_adds_up: bool) -> list[Task]:
    """Tasks of ``bins`` with the memory the checked loop of :func:`partition` would have added up."""
    return _ranked(bins, [_held(b, memory_adds_up) for b in bins])


def _held(b: list[Item], memory_adds_up: bool) -> int:
    """The memory a task of the items ``b`` holds beyond ``TASK_MEMORY_BYTES``."""
    if memory_adds_up:  # in columns: the sum of what each item keeps, and the largest read buffer
        kept: int = sum(map(_memory, b)) - sum(map(_transient, b)) + ITEM_MEMORY_BYTES * len(b)
        return kept + max(map(_transient, b), default=0)
    memory = 0
    for item in b:
        memory = max(memory, item.memory) + ITEM_MEMORY_BYTES
    return memory


def _ranked(bins: list[list[Item]], held: list[int]) -> list[Task]:
    """The non-empty bins as tasks ``0..n-1``, costliest first."""
    filled = sorted(
        ((b, m, sum(map(_nbytes, b))) for b, m in zip(bins, held, strict=True) if b),
        key=lambda bmn: bmn[2] + ITEM_OVERHEAD_BYTES * len(bmn[0]),
        reverse=True,
    )
    return [
        Task(index=i, keys=tuple(map(_key, b)), nbytes=nbytes, memory=TASK_MEMORY_BYTES + m)
        for i, (b, m, nbytes) in enumerate(filled)
    ]
