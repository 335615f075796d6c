"""A Saver's save that sends its first tasks before it has checked the layout (speculative dispatch).

The layout check of a kept plan (jobs/plan_reuse.py: the nesting walk, every tensor's address,
and without ``layout_unchanged`` its dtype, shape and strides) is the largest part of a Saver's
second save that runs before any worker works (~40-120 ms at 50,000 keys). Here the workers start
on the plan of the save before while the coordinator checks:

    coordinator                                         workers
    ───────────                                         ───────
    plan and stage as the kept layout's listing says  (no look at the state dict: sizes and the
      partition depend on the layout only)
    first task per worker, its part as kept       ──▶  copy the tensors where they lay at the
                                                         last save (process_vm_readv), write them
    the check (in the pool's loop, right after the
      first tasks went out): the state dict laid out
      as the kept layout, every tensor where it lay?
      yes ─ the speculative source becomes this
            save's; the rest as any save   ──────▶  ... commit as any save
      no  ─ StalePlan: every task sent is waited for, its files discarded with the staging (no
            ``.metadata``, no lock left), and the save runs afresh as ``save()`` would

Before the check nothing reads the caller's state dict: the speculative source's tensors and
values stand behind :class:`_Deferred` mappings that run the check at the first look (planning a
split, a part with values, a part that was not kept), so no code path can take a stale value.
The parts sent before the check are the kept ones, made for the addresses of the last save: the
check requires every tensor at the same address, so a worker copies what the state dict holds
now (a tensor freed and another allocated at its address, of its layout: its bytes, the right
ones). A tensor freed and not replaced there makes the worker's copy fail (``StaleRead``), which
the pool reports as a stale plan too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.pool import gc_paused
from parallel_dcp.errors import StalePlan
from parallel_dcp.formats.remote_memory_source import RemoteMemorySource
from parallel_dcp.jobs.targets import Job
from parallel_dcp.jobs.task_parts import JobParts, KeptPart

__all__ = ["SPECULATE", "Speculation", "SpeculativeParts"]

# Off: every save checks its layout before its first task (the code path of a first save).
SPECULATE = True


class KeptLayout(Protocol):
    """What a speculation uses of a layout the plan memo kept (jobs/plan_reuse.py's ``_Kept``,
    which imports this module: named here by what it has, not imported)."""

    layout: Any
    listing: RemoteMemorySource
    caches: tuple[Any, Any, Any, Any]
    parts: dict[int, KeptPart]
    parted: list[Task]
    steady: bool


class _Deferred(Mapping[str, Any]):
    """A mapping whose keys are known (``keys``; None: unknown) but whose values are this save's:
    a look at a value (or at the keys where unknown) runs the check first, then answers from what
    the check found (``real()``)."""

    def __init__(self, keys: Sequence[str] | None, real: Callable[[], Mapping[str, Any]]) -> None:
        self._keys = dict.fromkeys(keys) if keys is not None else None
        self._real = real

    def __getitem__(self, key: str) -> Any:
        return self._real()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys if self._keys is not None else self._real())

    def __len__(self) -> int:
        return len(self._keys if self._keys is not None else self._real())

    def __contains__(self, key: object) -> bool:
        return key in (self._keys if self._keys is not None else self._real())


class Speculation:
    """One speculative save on ``kept`` (the most recently saved layout): ``source`` (its listing,
    no tensor, no value) and ``job`` are what is planned and sent before the check;
    :meth:`confirm` runs the check once and fills ``source`` with this save's state dict, or raises
    :class:`StalePlan`. ``check(kept)`` is the plan memo's own layout check (the source it found,
    or None), ``moved()`` whether the tensors lay elsewhere than at the kept layout's last save."""

    def __init__(
        self,
        kept: KeptLayout,
        path: str,
        check: Callable[[], RemoteMemorySource | None],
        workers: int,
    ) -> None:
        self.kept = kept
        self.workers = workers
        self.confirmed = False
        self._check = check
        layout = kept.layout
        self.source = kept.listing.reopened(None, {}, {}, path)
        self.source._flat = _Deferred(None, self._flat)  # type: ignore[assignment]
        self.source.values = _Deferred(layout.value_keys, self._values)  # type: ignore[assignment]
        self.job = Job(self.source, layout.keys, None, {}, *kept.caches)

    def _flat(self) -> Mapping[str, Any]:
        self.confirm()
        return self.source._flat

    def _values(self) -> Mapping[str, Any]:
        self.confirm()
        return self.source.values

    def drop(self) -> None:
        """After a stale plan: the kept parts are made again (a worker may have found one stale).
        (The caller marks the layout unsteady once its save is over: the next save of it checks
        before it sends.)"""
        self.kept.parts, self.kept.parted = {}, []

    def close(self) -> None:
        """Drop the check (it holds the state dict): the save is over."""
        self._check = _unchecked

    def confirm(self) -> None:
        """The layout check; once it passes, this save's state dict is the source's.

        Raises:
            StalePlan: the state dict is not laid out as the kept layout, or its tensors moved.
        """
        if self.confirmed:
            return
        with gc_paused():
            found = self._check()
        if found is None or not self.kept.steady:
            raise StalePlan(
                "the plan of the last save no longer fits this state dict (its layout changed or its tensors moved)",
                worker=-1,
                keys=[],
                error_type=StalePlan.__qualname__,
            )
        vars(self.source).update(vars(found))  # the speculative source is now this save's
        self.confirmed = True


def _unchecked() -> RemoteMemorySource | None:
    return None


class SpeculativeParts(JobParts):
    """The job's parts, as :class:`JobParts` makes them, sent on a speculation: the first one per
    worker as kept (bytes made at the last save, and dispatched first); the check runs before any
    other part is made and at the pool's first pass through its loop (``ahead``), while the first
    tasks run."""

    def __init__(self, speculation: Speculation, job: Job, tasks: Sequence[Task], kept: dict[int, KeptPart]) -> None:
        # The tasks whose parts were kept whole (no value: a value is this save's) go first, so
        # that each worker's first task leaves before the check (a part with values waits for it).
        ready = [task for task in tasks if isinstance(kept.get(task.index), bytes)][: speculation.workers]
        first = {task.index for task in ready}
        super().__init__(job, speculation.source, ready + [t for t in tasks if t.index not in first], kept)
        self._speculation = speculation
        self._free = speculation.workers  # parts sent before the check: one per worker

    def __call__(self, task: Task) -> bytes:
        if self._free > 0 and isinstance(self._kept.get(task.index) if self._kept else None, bytes):
            self._free -= 1
        else:
            self._speculation.confirm()
        return super().__call__(task)

    def ahead(self) -> None:
        self._speculation.confirm()
        super().ahead()
