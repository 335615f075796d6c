"""Saves of one layout on the same workers, listed, planned and parted once (a Saver's checkpoints).

A training loop saves a state dict of the same keys, shapes and dtypes again and again. The
coordinator's per-key work (50,000 keys: several us a key) is the serial part that caps a save on
many cores. A :class:`PlanReuse` (one per ``SaverWorkers``: a Saver, or the workers ``save()``
keeps) does that work for the first save of a layout only:

    save n (a layout not seen before)          save n + 1 (the same layout)
    ─────────────────────────────────          ────────────────────────────
    open: flatten; list, check and size        open: flatten; the layout's columns compared
      every tensor (RemoteMemorySource)          with save n's (C passes, no object per key):
    remember the layout's columns                save n's listing over save n + 1's tensors
    plan: the same decisions every save (limit, workers, chunk size, each item against the limit:
      O(1) or per task), then the partition, which depends on the layout and those decisions
      only; kept by them, with the range of task caps that give the same partition (a limit at
      least the whole job's memory: all of them; the default limit, which moves save to save
      with the memory available, mostly stays inside it)
    parts: each task's keys and addresses,     parts: save n's pickled bytes, where the tensors
      pickled (jobs/task_parts.py)               lie where they lay and the task holds no
                                                 non-tensor value; the others made again

The layout (:class:`Layout`) is what the listing and the plan depend on: every key in order, its
nesting, each tensor's type, dtype, shape, strides and ``requires_grad`` (which ``.metadata``
records; that it is a CPU strided tensor: checked again where its bytes moved), each other
value's key and size (``Source.value_bytes``), and
whether the writers copy large tensors themselves (``pending_writes``). Not in it: where the
tensors lie (the parts carry addresses: compared, the parts made again where they moved), storage
shared between tensors (a worker copies each tensor's own bytes; nothing is planned by storage),
the values' contents (sent with each task). A layout that differs in anything is listed and
planned afresh, as the first.

In-place changes (the tensor object stays, its layout changes) are caught by the same columns:
``set_`` and ``.data =`` to other memory and a ``resize_`` that reallocates move the bytes (the
address and then everything is compared again); ``resize_`` in place, ``t_``, ``as_strided_``,
``.data =`` a view of the same bytes change the shape, strides or dtype. Those three columns are
two Python passes over the tensors (0.4-0.8 us a key each at 50,000 keys: a method call and an
object made per tensor and attribute); once a later save passed them, the layout keeps a guard
that compares all three in one C++ pass (``_compat.layout_guard``, torch.compile's own tensor
guard: ~0.3 us a key), and the Python passes run only where it refuses (it compares more: a
refusal is no verdict). The tensors and values are taken from the nesting walk's leaves by
place (the tensors in one C call: a slice where they lie together, as in an optimizer's state),
and the dict of this save's leaves by key that the source keeps is made only where something looks
a key up (``RemoteMemorySource.reopened(leaves=...)``: a save whose parts were all kept never
does; ~4 ms at 50,000 keys). A
caller that knows its layout did not change says so (``Saver.save(layout_unchanged=True)``) and
they are compared only for the tensors whose bytes moved; a broken promise (a tensor reshaped or
retyped over the same bytes, or its ``requires_grad`` switched) is written with the shape,
strides, dtype and ``requires_grad`` of the save before.

The memo holds no tensor and no value of a past save: the listing is kept without them. It keeps
the last ``LAYOUTS`` layouts (a loop that saves its model and its optimizer in turn finds both).

Longer than 300 lines because the layout, its comparison with a new state dict and the reuse of
the plan and parts are one contract: each decides what the next may skip, and apart they would
have to re-prove each other's checks.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import Any, TypeVar

import torch

from parallel_dcp import _compat
from parallel_dcp.engine.chunks import lazy_bits
from parallel_dcp.engine.partition import CapRange, Item, Task
from parallel_dcp.formats import lean
from parallel_dcp.formats.nesting import Skeleton, leaves, skeleton
from parallel_dcp.formats.remote_memory_source import RemoteMemorySource
from parallel_dcp.formats.validate import flatten_checked
from parallel_dcp.jobs import speculation as speculative
from parallel_dcp.jobs.speculation import Speculation, SpeculativeParts
from parallel_dcp.jobs.targets import Job
from parallel_dcp.jobs.task_parts import JobParts, KeptPart, job_parts

__all__ = ["LAYOUTS", "Layout", "PlanReuse"]

_kind = attrgetter("dtype", "shape")
_stride, _address = torch.Tensor.stride, torch.Tensor.data_ptr
_grad = attrgetter("requires_grad")
# Partitions (and item lists) kept per layout: a few decisions (worker counts, limits) at a time.
_KEPT = 4
# Layouts kept: a training loop's model and optimizer, saved in turn, and a few more.
LAYOUTS = 4
V = TypeVar("V")


@dataclass(frozen=True, slots=True, eq=False)
class Layout:
    """A save's layout in columns (see the module docstring); compared, never hashed by value."""

    keys: tuple[str, ...]
    mapping: dict[str, tuple[Any, ...]]
    tensor_keys: tuple[str, ...]
    value_keys: tuple[str, ...]
    types: list[type]
    kinds: list[tuple[torch.dtype, torch.Size]]  # each tensor's dtype and shape
    strides: list[tuple[int, ...]]
    grads: list[bool]  # each tensor's requires_grad (.metadata records it; the parts carry it)
    # The lazy views by key, with their conjugate and negative bits (engine/chunks.lazy_bits: a
    # lazy view's bytes are not its values; the parts say which a worker resolves).
    lazy: dict[str, tuple[bool, bool]]
    value_sizes: list[int]
    pending_writes: bool
    nesting: Skeleton | None  # the containers flattened (formats/nesting.py): None, flatten again


class _Kept:
    """What is kept of one layout: its listing (no tensor, no value), its job's sizes and places,
    its partitions, and its tasks' parts with the addresses they were made for."""

    def __init__(self, layout: Layout, listing: RemoteMemorySource, job: Job, addresses: list[int]) -> None:
        self.layout = layout
        self.listing = listing
        self.caches = (job._sizes, job._ordered_sizes, job._positions, job._totals)  # filled as it is planned
        self.addresses = addresses  # where the current save's tensors lie, in tensor_keys order
        # Per (dtype, chunks) of a job over this layout: its items, their bytes, one task's memory.
        self.items: dict[Any, tuple[list[Item], int]] = {}
        # Per (shape, workers, decision): the last partitions made, each with the caps it holds for.
        self.tasks: dict[Any, list[tuple[CapRange, list[Task]]]] = {}
        # Pickled parts of the tasks in ``parted`` (the same Task objects), made for ``parted_at``.
        self.parts: dict[int, KeptPart] = {}
        self.parted: list[Task] = []
        self.parted_at: list[int] = []
        # The last save of this layout found its tensors where the save before left them: the
        # next one may send its first tasks before it checks (jobs/speculation.py).
        self.steady = True
        # The dtype, shape and strides check in one C pass (_same_kinds), made once a later save
        # of this layout passed the check of each tensor in Python; None until then.
        self.guard: _compat.LayoutGuard | None = None
        self._picks: tuple[Callable[[Sequence[Any]], list[Any]], list[int]] | None = None

    def picks(self) -> tuple[Callable[[Sequence[Any]], list[Any]], list[int]]:
        """Where the tensors and the values lie among the layout's leaves (in ``keys`` order):
        the tensors taken from a later save's leaves in one C call (a slice where they lie
        together, as in an optimizer's state), and each value's place. Made at the first later
        save (a pass over the keys, once per layout)."""
        if self._picks is None:
            layout = self.layout
            place = {key: i for i, key in enumerate(layout.keys)}
            self._picks = (
                _picker(list(map(place.__getitem__, layout.tensor_keys))),
                [place[k] for k in layout.value_keys],
            )
        return self._picks


class PlanReuse:
    """The listing, the partitions and the parts of the last ``LAYOUTS`` layouts saved (a training
    loop may save its model and its optimizer in turn; see the module docstring). ``reused``: how
    many saves found a layout saved before (for tests and benchmarks)."""

    def __init__(self) -> None:
        self.reused = 0
        self.speculations = 0  # saves whose first tasks went out before the check (jobs/speculation.py)
        self.speculated = 0  # of those, the ones whose check passed
        self._kept: list[_Kept] = []  # the most recently used first
        self._opened: weakref.ref[RemoteMemorySource] | None = None  # this save's source
        self._current: _Kept | None = None  # and its layout's
        self._speculation: weakref.ref[Speculation] | None = None  # the last one made (it holds the state dict)

    def __reduce__(self) -> Any:
        # Sent to workers with the target: the memo is the coordinator's, a worker gets none of it.
        return (PlanReuse, ())

    @property
    def _layout(self) -> Layout | None:
        """The layout of the last save (tests)."""
        return self._kept[0].layout if self._kept else None

    def job(self, state_dict: Any, path: str, *, pending_writes: bool, layout_unchanged: bool = False) -> Job:
        """The job of this save, every key of ``state_dict`` to ``path``: a kept layout's listing
        (and its job's sizes and places, made while it planned) over ``state_dict`` where the
        layout is the same, else ``state_dict`` listed afresh (which raises what opening raises).
        ``layout_unchanged``: the caller's promise that no tensor changed its dtype, shape or
        strides in place since this layout's last save (those are then compared only for the
        tensors that moved; see the module docstring)."""
        for kept, found_leaves, flat in _matches(self._kept, state_dict):
            found = _reopen(kept, found_leaves, state_dict, path, pending_writes, layout_unchanged, flat)
            if found is not None:
                self.reused += 1
                self._kept.remove(kept)
                self._kept.insert(0, kept)
                return Job(self._opening(found, kept), kept.layout.keys, None, {}, *kept.caches)
        source = RemoteMemorySource(path, state_dict=state_dict, pending_writes=pending_writes)
        tensors = list(map(source._flat.__getitem__, source.entries))
        layout = Layout(
            keys=source.keys(),
            mapping=source.mapping,
            tensor_keys=tuple(source.entries),
            value_keys=tuple(source.values),
            types=list(map(type, tensors)),
            kinds=list(map(_kind, tensors)),
            strides=list(map(_stride, tensors)),
            grads=list(map(_grad, tensors)),
            lazy=source._lazy,
            value_sizes=list(map(source.value_bytes, source.values)),
            pending_writes=source.pending_writes,
            nesting=skeleton(state_dict),
        )
        job = Job(source, layout.keys)
        kept = _Kept(layout, source.reopened(None, {}, {}, path), job, list(map(_address, tensors)))
        self._kept.insert(0, kept)
        del self._kept[LAYOUTS:]
        self._opening(source, kept)
        return job

    def speculation(
        self, state_dict: Any, path: str, *, pending_writes: bool, layout_unchanged: bool, workers: int
    ) -> Speculation | None:
        """A speculative save of ``state_dict`` on the kept layout its top level is (see
        jobs/speculation.py; a loop saving its model and its optimizer in turn finds each), where
        it may pay: that layout's last save found its tensors where they lay before (else None:
        check first). Where the top level matches, no earlier kept layout nests as ``state_dict``
        does, so the check passes exactly where :meth:`job` would take this layout."""
        if not speculative.SPECULATE:
            return None
        kept = next((k for k in self._kept if _top_level(k.layout.nesting, state_dict)), None)
        if kept is None or not kept.steady or not kept.layout.keys:  # (no key: no task runs the check)
            return None
        nesting = kept.layout.nesting
        assert nesting is not None  # (_top_level)

        def check() -> RemoteMemorySource | None:
            found = leaves(nesting, state_dict)
            if found is None:
                return None
            source = _reopen(kept, found, state_dict, path, pending_writes, layout_unchanged)
            if source is not None and kept.steady:
                self.reused += 1
                self.speculated += 1
                self._kept.remove(kept)
                self._kept.insert(0, kept)
            return source

        speculation = Speculation(kept, path, check, workers)
        self.speculations += 1
        self._opening(speculation.source, kept)
        self._speculation = weakref.ref(speculation)
        return speculation

    def job_parts(self, job: Job, tasks: Sequence[Task]) -> JobParts | None:
        """What the workers receive per task of ``job`` (jobs/task_parts.py): the kept parts where
        they are still right; on a speculation (``job`` is its job), parts that run its check."""
        kept = self.parts(job, tasks)
        speculation = self._speculation() if self._speculation is not None else None
        if speculation is not None and job.source is speculation.source and kept is not None:
            return SpeculativeParts(speculation, job, tasks, kept)  # (job: split as planned)
        return job_parts(job, tasks, kept)

    def _opening(self, source: RemoteMemorySource, kept: _Kept) -> RemoteMemorySource:
        self._opened, self._current = weakref.ref(source), kept
        return source

    def _this_save(self, job: Job) -> _Kept | None:
        """The kept layout of ``job``'s source, where it is this save's (else None: plan as without a memo)."""
        opened = self._opened() if self._opened is not None else None
        return self._current if opened is not None and job.source is opened else None

    def tasks(
        self,
        job: Job,
        workers: int,
        budget: int,
        items: Callable[[Any], list[Item]],
        room: Callable[[int, int], int],
        plan: Callable[[list[Item], int, int, CapRange], list[Task]],
        decision: tuple[Any, ...],
    ) -> list[Task]:
        """``plan(items(job), workers, budget, caps)`` (a target's partition of ``job``, which
        sets ``caps`` to the task caps that give the same tasks), kept by what it depends on: the
        job's shape over this layout, ``workers``, the target's ``decision`` (its I/O mode and what
        sizes its streams), and the room a task has (``room(bytes of the items, budget)``) as far
        as the partition's output depends on it: a kept plan is taken again wherever the room
        falls in its ``caps`` (every cap where one task could hold every item; under a cap that
        binds, the caps that give as many runs cut at the same keys). The default limit moves with
        the memory available, save to save: its saves found their plan again only where the cap
        did not bind."""
        kept = self._this_save(job)
        if kept is None:
            return plan(items(job), workers, budget, CapRange())
        shape = (job.dtype, tuple(job.chunks.items()))
        found = kept.items.get(shape)
        if found is None:
            listed = items(job)
            found = _keep(kept.items, shape, (listed, sum(map(itemgetter(1), listed))))
        listed, nbytes = found
        cap = room(nbytes, budget)
        key = (shape, workers, decision)
        plans = kept.tasks.get(key, [])
        tasks = next((tasks for caps, tasks in plans if cap in caps), None)
        if tasks is None:
            caps = CapRange()
            tasks = plan(listed, workers, budget, caps)
            kept.tasks.pop(key, None)  # (kept as the newest)
            _keep(kept.tasks, key, [(caps, tasks), *plans[: _KEPT - 1]])
        return list(tasks)

    def parts(self, job: Job, tasks: Sequence[Task]) -> dict[int, KeptPart] | None:
        """The parts kept for ``tasks`` of ``job`` (a job part per task index, to take and to
        fill; None: not this save's job): valid while the tasks are the same and the tensors lie
        where they lay when the parts were made."""
        kept = self._this_save(job)
        if kept is None:
            return None
        same = len(tasks) == len(kept.parted) and all(map(_is, tasks, kept.parted))
        if not same or kept.addresses != kept.parted_at:
            kept.parts = {}
            kept.parted, kept.parted_at = list(tasks), kept.addresses
        return kept.parts


def _top_level(nesting: Skeleton | None, state_dict: Any) -> bool:
    """Whether ``state_dict`` is a container of ``nesting``'s type with its keys (its top level)."""
    if nesting is None or type(state_dict) is not nesting.kind:
        return False
    top: Any = state_dict  # (the type check above narrows it to object)
    return tuple(top) == nesting.keys


def _matches(kept: list[_Kept], state_dict: Any) -> Iterator[tuple[_Kept, list[Any], dict[str, Any] | None]]:
    """The kept layouts whose keys and paths ``state_dict`` flattens to, each with its leaves in
    its keys' order (and by key where it was flattened; else None), most recently used first:
    first those it nests as (a walk that stops at the first difference: another layout's
    top-level keys cost a comparison, not a pass over the keys), then the rest compared with
    ``state_dict`` flattened, once whatever their number (the same keys and paths nested in
    other containers: a dict subclass, say)."""
    rest = []
    for each in kept:
        found = leaves(each.layout.nesting, state_dict) if each.layout.nesting is not None else None
        if found is None:
            rest.append(each)
        else:  # nested as before: DCP would give its leaves the same names and paths
            yield each, found, None
    if not rest:
        return
    try:
        flat, mapping = flatten_checked(state_dict, check_tensors=False)
    except Exception:
        return  # opening afresh raises it, with its message
    keys = tuple(flat)
    for each in rest:
        if keys == each.layout.keys and mapping == each.layout.mapping:
            yield each, list(flat.values()), flat


def _reopen(
    kept: _Kept,
    found: list[Any],
    state_dict: Any,
    path: str,
    pending_writes: bool,
    promised: bool = False,
    flat: dict[str, Any] | None = None,
) -> RemoteMemorySource | None:
    """``kept``'s listing over ``state_dict`` (``found``: its leaves in ``kept``'s keys' order,
    under ``kept``'s keys and paths; ``flat``: by key, where it was flattened, else made at its
    first use) when its layout is ``kept``'s (noting where its tensors lie); None when anything
    differs. ``promised``: the caller promises that no tensor changed its dtype, shape or strides
    in place (``Saver.save(layout_unchanged=True)``): those are compared only where a tensor moved."""
    layout = kept.layout
    take_tensors, value_places = kept.picks()
    tensors = take_tensors(found)
    # Each pass over 50,000 tensors spread in memory costs 0.2-0.5 us a key however little it
    # reads, so the passes are the fewest that catch every change, taken chunk by chunk (see
    # _chunked): each tensor's type and where its bytes lie (a tensor of another layout, sparse
    # or opaque, has none: data_ptr raises); on the CPU and strided only where that moved (see
    # _unchecked); then dtype and shape together, and strides (the guard).
    # The version counter would not do: ``.data =`` keeps it, every optimizer step bumps it.
    try:  # strides: no tensor of another layout gets this far (one that raises: none does)
        checked = _chunked(kept, tensors, guard_now=not promised)
        if checked is None:
            return None
        addresses, guarded = checked
        moved = addresses != kept.addresses
        if not all(map(_cpu_strided, _unchecked(tensors, addresses, kept.addresses, moved))):
            return None
        if (moved or not promised) and not guarded and not _same_kinds(kept, tensors, guard_tried=not promised):
            return None
    except RuntimeError:
        return None
    values = dict(zip(layout.value_keys, map(found.__getitem__, value_places), strict=True))
    if any(isinstance(value, torch.Tensor) for value in values.values()):
        return None
    if (pending_writes and lean.lean_eligible(values.values())) != layout.pending_writes:
        return None
    if flat is None:
        source = kept.listing.reopened(state_dict, {}, values, path, leaves=(layout.keys, found))
    else:
        source = kept.listing.reopened(state_dict, flat, values, path)
    if list(map(source.value_bytes, layout.value_keys)) != layout.value_sizes:
        return None
    kept.addresses, kept.steady = addresses, not moved
    return source


def _chunked(kept: _Kept, tensors: list[torch.Tensor], *, guard_now: bool) -> tuple[list[int], bool] | None:
    """Where each of ``tensors`` lies (its ``data_ptr``), with its exact type checked against the
    layout's, and where ``guard_now`` and ``kept`` has a guard, that guard's verdict on each tensor
    (see _same_kinds): (addresses, True where the guard said True for every chunk); None where a
    type differs. Chunk by chunk (``GUARD_CHUNK`` tensors): the passes over a chunk find its
    objects in the cache, where a pass over all 50,000 would find them evicted by the one before.

    Raises:
        RuntimeError: a tensor with no bytes to point at (sparse, opaque), as ``data_ptr`` raises it.
    """
    types = kept.layout.types
    if len(tensors) != len(types):
        return None
    guard = kept.guard if guard_now else None
    guarded = guard is not None and guard.count == len(tensors)
    size = guard.chunk if guard is not None else _compat.GUARD_CHUNK
    addresses: list[int] = []
    for k, start in enumerate(range(0, len(tensors), size)):
        part = tensors[start : start + size]
        if list(map(type, part)) != types[start : start + size]:
            return None
        addresses += map(_address, part)
        if guarded:
            assert guard is not None  # (for mypy: guarded says so)
            guarded = guard.part(tensors, k)
    return addresses, guarded


def _same_kinds(kept: _Kept, tensors: list[torch.Tensor], *, guard_tried: bool = False) -> bool:
    """Whether every tensor has the dtype, shape, strides, ``requires_grad`` and conjugate and
    negative bits of ``kept``'s layout: in C passes (``kept.guard``: 0.3 us a key at 50,000,
    against 1.2 for the Python passes) where it says so (``guard_tried``: it was asked already,
    by _chunked, and did not); else by the Python passes, which decide (the guard is stricter: it
    also compares each tensor's device and all its dispatch keys, of which those bits are two,
    and its False is no verdict). The guard
    is made from the first tensors the Python passes found laid out as the layout (and again
    where it refused tensors they accept: it then holds what this layout's tensors now are), so
    its True means what theirs does.

    Raises:
        RuntimeError: a tensor with no strides (not strided), as ``stride()`` raises it.
    """
    guard = kept.guard
    if guard is not None and not guard_tried and guard(tensors):
        return True
    layout = kept.layout
    if (
        list(map(_kind, tensors)) != layout.kinds
        or list(map(_stride, tensors)) != layout.strides
        or list(map(_grad, tensors)) != layout.grads
        or _lazy_views(layout, tensors) != layout.lazy
    ):
        return False
    kept.guard = _compat.layout_guard(tensors, [shape for _, shape in layout.kinds], layout.strides)
    return True


def _lazy_views(layout: Layout, tensors: list[torch.Tensor]) -> dict[str, tuple[bool, bool]]:
    """The lazy views among ``tensors`` (of the dtypes in ``layout.kinds``), as ``Layout.lazy``."""
    lazy = {}
    for key, tensor, (dtype, _) in zip(layout.tensor_keys, tensors, layout.kinds, strict=True):
        bits = lazy_bits(tensor, dtype)
        if bits is not None:
            lazy[key] = bits
    return lazy


def _unchecked(tensors: list[torch.Tensor], addresses: list[int], before: list[int], moved: bool) -> list[torch.Tensor]:
    """The tensors not known to be CPU strided tensors: those whose bytes do not lie where a
    checked tensor's bytes lay at the last save of this layout, and those with no bytes (an
    empty tensor, a meta one: address 0). A tensor whose bytes lie at a host address a CPU
    tensor's bytes lay at is a CPU tensor (another device's memory is not at a host address), and
    a strided one (a dense tensor cannot turn sparse or opaque in place: ``set_``, ``.data =``
    refuse, tested; a new object of another layout has no bytes, its data_ptr raises)."""
    if not moved:
        return [t for t, a in zip(tensors, addresses, strict=True) if not a] if 0 in addresses else []
    return [t for t, a, b in zip(tensors, addresses, before, strict=True) if a != b or not a]


def _picker(places: list[int]) -> Callable[[Sequence[Any]], list[Any]]:
    """What takes the items at ``places`` (ascending) of a sequence, as a list, in one C call."""
    if not places:
        return _none
    first = places[0]
    if places == list(range(first, first + len(places))):
        return itemgetter(slice(first, first + len(places)))
    if len(places) == 1:
        one = itemgetter(first)
        return lambda found: [one(found)]
    many = itemgetter(*places)
    return lambda found: list(many(found))


def _none(found: Sequence[Any]) -> list[Any]:
    return []


def _cpu_strided(tensor: torch.Tensor) -> bool:
    return tensor.is_cpu and tensor.layout is torch.strided


def _keep(memo: dict[Any, V], key: Any, value: V) -> V:
    """``memo[key] = value``, the oldest entries dropped past ``_KEPT``: a long training run must
    not keep every plan it made (a limit that binds and moves beyond a kept plan's caps, save to
    save, makes a new one each time)."""
    memo[key] = value
    while len(memo) > _KEPT:
        del memo[next(iter(memo))]
    return value


def _is(a: object, b: object) -> bool:
    return a is b
