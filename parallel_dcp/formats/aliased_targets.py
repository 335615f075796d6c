"""Targets of a ``load(into=)`` that share memory across keys, read one key after the other.

    into = {"embed.weight": t, "lm_head.weight": t}       (a tied model; or overlapping views)
        │  every target's bytes [data_ptr, data_ptr + extent), sorted: one vectorized pass
        ▼  (no overlap, the common case: nothing changes)
    the keys whose target overlaps an earlier key's (in the template's order) are left out of
    the parallel read and read after it, one at a time, in that order

Reading threads fill targets at once, so two keys whose targets share bytes were written
concurrently: where the checkpoint holds different values for them (an untied checkpoint into a
tied model), each load gave another mix of the two, and bytes torn between both (1.0 and 2.0 read
as 4.0). Stock ``dcp.load`` copies key by key. Now the overlapping bytes end up as the last of
those keys in the template's order holds them, every time; a tied model's own checkpoint (the
same values under both keys) loads as before, its second key read after the others.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any, TypeVar

import torch

__all__ = ["AliasedTargets", "aliased_later", "check_no_aliases", "later_overlapping", "tensor_span"]

K = TypeVar("K")

_KEY, _TARGET, _ADDRESS = itemgetter(2), itemgetter(3), itemgetter(7)  # of a small record's entry
_NBYTES = attrgetter("nbytes")  # (a small record's target is contiguous: its bytes are its extent)


class AliasedTargets(Exception):
    """Raised by the planning of a load whose targets overlap across keys, before anything is read:
    ``later`` (in the template's order) are to be read after the others, one at a time."""

    def __init__(self, later: list[Any], chosen: list[str]) -> None:
        super().__init__(f"{len(later)} targets share memory with earlier ones")
        self.later = later
        self.chosen = chosen


def aliased_later(order: Sequence[str], small: Iterable[list[Any]], general: Iterable[tuple[str, Any]]) -> list[str]:
    """The keys of ``order`` whose target overlaps the target of a key earlier in ``order``, in
    that order; [] when no two targets share a byte. ``small``: the small records' entries (each
    with its key, target and the target's data address); ``general``: (key, target tensor) of the
    others."""
    entries = list(chain.from_iterable(small))
    starts = list(map(_ADDRESS, entries))
    lengths = list(map(_NBYTES, map(_TARGET, entries)))
    names: list[int | str] = list(range(len(entries)))  # an entry's place (its key looked up only if it overlaps)
    for key, target in general:
        span = tensor_span(target)
        if span is not None:
            names.append(key)
            starts.append(span[0])
            lengths.append(span[1])
    if len(names) < 2:
        return []
    positions: dict[str, int] = {}

    def key_of(name: int | str) -> str:
        return _KEY(entries[name]) if isinstance(name, int) else name

    def position(name: int | str) -> int:
        if not positions:  # (made only where targets overlap: a rare load)
            positions.update((key, i) for i, key in enumerate(order))
        return positions[key_of(name)]

    return [key_of(name) for name in later_overlapping(names, starts, lengths, position)]


def check_no_aliases(items: Sequence[Any], targets: Sequence[Any], of: Sequence[Any]) -> None:
    """For a storage reader: raise :class:`AliasedTargets` (``later``: positions in ``items``) when
    the ``targets`` of the read items ``of`` (each one of ``items``) overlap; the reader then reads
    those after the others, one at a time."""
    if len(targets) < 2:
        return
    index = {id(item): n for n, item in enumerate(items)}
    names, starts, lengths = [], [], []
    for item, target in zip(of, targets):
        span = tensor_span(target)
        if span is not None:
            names.append(index[id(item)])
            starts.append(span[0])
            lengths.append(span[1])
    later = later_overlapping(names, starts, lengths, int)
    if later:
        raise AliasedTargets(later, [])


def later_overlapping(names: list[K], starts: list[int], lengths: list[int], position: Callable[[K], int]) -> list[K]:
    """Of ``names`` (each with the bytes ``[start, start + length)`` of its target), those that
    overlap one coming earlier by ``position``, ordered by it; [] when none overlap (one
    vectorized pass: the common case)."""
    if len(names) < 2:
        return []
    begin = torch.frombuffer(array("q", starts), dtype=torch.int64)  # (torch.tensor of a list: 5x slower)
    end = begin + torch.frombuffer(array("q", lengths), dtype=torch.int64)
    by_start = torch.argsort(begin, stable=True)
    begin, end = begin[by_start], end[by_start]
    reach = torch.cummax(end, 0).values
    if not bool((begin[1:] < reach[:-1]).any()):
        return []
    return _later_of_clusters([names[i] for i in by_start.tolist()], begin.tolist(), end.tolist(), position)


def _later_of_clusters(names: list[K], begin: list[int], end: list[int], position: Callable[[K], int]) -> list[K]:
    """Runs of overlapping targets (sorted by their first byte); in each, every name but the first
    by ``position``."""
    later: list[K] = []
    cluster: list[K] = []
    reach = -1
    for name, first, last in zip(names, begin, end):
        if cluster and first >= reach:
            later += sorted(cluster, key=position)[1:]
            cluster = []
        cluster.append(name)
        reach = max(reach, last) if len(cluster) > 1 else last
    later += sorted(cluster, key=position)[1:]
    return sorted(later, key=position)


def tensor_span(target: Any) -> tuple[int, int] | None:
    """(first byte, bytes to past the last element) of a tensor's memory; None for no tensor, an
    empty one or a meta one."""
    if not isinstance(target, torch.Tensor) or not target.numel() or target.is_meta:
        return None
    return target.data_ptr(), _extent(target)


def _extent(target: torch.Tensor) -> int:
    """The bytes from ``target``'s first element to past its last (its storage span; a strided
    view's gaps included)."""
    if target.is_contiguous():
        return int(target.nbytes)
    span = sum((size - 1) * stride for size, stride in zip(target.shape, target.stride()))
    return (span + 1) * target.element_size()
