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

import math
from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy
import torch

__all__ = ["AliasedTargets", "aliased_later", "check_no_aliases", "later_in", "overlapping", "tensor_span"]


# of a small record's entry (its target is contiguous, of the stored dtype and shape)
_KEY, _DTYPE, _SHAPE, _ADDRESS = itemgetter(2), itemgetter(5), itemgetter(6), itemgetter(7)


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
    with its key, the target's data address and the stored dtype and shape, which its target
    has); ``general``: (key, target tensor) of the others."""
    entries = list(chain.from_iterable(small))
    starts = list(map(_ADDRESS, entries))
    # sized by class (the stored shape and dtype): a target's own nbytes is a cache miss a key
    lengths = list(map(_ClassBytes().__getitem__, zip(map(_SHAPE, entries), map(_DTYPE, entries))))
    keys: list[str] = []
    for key, target in general:
        span = tensor_span(target)
        if span is not None:
            keys.append(key)
            starts.append(span[0])
            lengths.append(span[1])
    clusters = overlapping(starts, lengths)
    if not clusters:
        return []
    places = {key: i for i, key in enumerate(order)}

    def key_of(n: int) -> str:
        return str(_KEY(entries[n])) if n < len(entries) else keys[n - len(entries)]

    later = [key_of(n) for n in later_in(clusters, lambda n: places[key_of(n)])]
    return sorted(later, key=places.__getitem__)


def check_no_aliases(items: Sequence[Any], targets: Sequence[Any], of: Sequence[Any]) -> None:
    """For a storage reader: raise :class:`AliasedTargets` (``later``: positions in ``items``) when
    the ``targets`` of the read items ``of`` (each one of ``items``) overlap; the reader then reads
    those after the others, one at a time."""
    if len(targets) < 2:
        return
    index = {id(item): n for n, item in enumerate(items)}
    places, starts, lengths = [], [], []
    for item, target in zip(of, targets):
        span = tensor_span(target)
        if span is not None:
            places.append(index[id(item)])
            starts.append(span[0])
            lengths.append(span[1])
    clusters = overlapping(starts, lengths)
    if clusters:
        raise AliasedTargets(sorted(places[n] for n in later_in(clusters, places.__getitem__)), [])


def overlapping(starts: list[int], lengths: list[int]) -> list[list[int]]:
    """Runs of spans (``[start, start + length)``, by their place in the lists) that overlap, each
    of two or more; [] when none overlap: one vectorized pass (single-threaded numpy), the common
    case."""
    if len(starts) < 2:
        return []
    begin = numpy.array(starts, dtype=numpy.int64)
    end = begin + numpy.array(lengths, dtype=numpy.int64)
    by_start = numpy.argsort(begin, kind="stable")
    begin, end = begin[by_start], end[by_start]
    if not bool((begin[1:] < numpy.maximum.accumulate(end)[:-1]).any()):
        return []
    clusters: list[list[int]] = []
    run: list[int] = []
    reach = -1
    for n, first, last in zip(by_start.tolist(), begin.tolist(), end.tolist()):
        if run and first >= reach:
            clusters += [run] if len(run) > 1 else []
            run = []
        run.append(n)
        reach = max(reach, last) if len(run) > 1 else last
    return clusters + ([run] if len(run) > 1 else [])


def later_in(clusters: list[list[int]], position: Callable[[int], int]) -> list[int]:
    """In each run, every member but the first by ``position``."""
    return [n for run in clusters for n in sorted(run, key=position)[1:]]


class _ClassBytes(dict[tuple[Any, Any], int]):
    """(shape, dtype) -> bytes, each class computed once."""

    def __missing__(self, kind: tuple[Any, Any]) -> int:
        shape, dtype = kind
        size = self[kind] = int(math.prod(shape)) * int(dtype.itemsize)
        return size


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
