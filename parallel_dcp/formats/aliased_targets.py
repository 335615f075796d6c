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

__all__ = [
    "AliasedTargets",
    "aliased_later",
    "check_no_aliases",
    "later_in",
    "overlapping",
    "share_bytes",
    "tensor_span",
]


# of a small record's entry (its target is contiguous, of the stored dtype and shape)
_KEY, _TARGET, _DTYPE, _SHAPE, _ADDRESS = itemgetter(2), itemgetter(3), itemgetter(5), itemgetter(6), itemgetter(7)


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
    with its key, target, the target's data address and the stored dtype and shape, which its
    target has); ``general``: (key, target tensor) of the others."""
    entries = list(chain.from_iterable(small))
    starts = list(map(_ADDRESS, entries))
    # sized by class (the stored shape and dtype): a target's own nbytes is a cache miss a key
    lengths = list(map(_ClassBytes().__getitem__, zip(map(_SHAPE, entries), map(_DTYPE, entries))))
    keys: list[str] = []
    tensors: list[Any] = []
    for key, target in general:
        span = tensor_span(target)
        if span is not None:
            keys.append(key)
            tensors.append(target)
            starts.append(span[0])
            lengths.append(span[1])

    def key_of(n: int) -> str:
        return str(_KEY(entries[n])) if n < len(entries) else keys[n - len(entries)]

    def tensor_of(n: int) -> Any:
        return _TARGET(entries[n]) if n < len(entries) else tensors[n - len(entries)]

    clusters = overlapping(starts, lengths, tensor_of)
    if not clusters:
        return []
    places = {key: i for i, key in enumerate(order)}
    later = [key_of(n) for n in later_in(clusters, lambda n: places[key_of(n)])]
    return sorted(later, key=places.__getitem__)


def check_no_aliases(items: Sequence[Any], targets: Sequence[Any], of: Sequence[Any]) -> None:
    """For a storage reader: raise :class:`AliasedTargets` (``later``: positions in ``items``) when
    the ``targets`` of the read items ``of`` (each one of ``items``) overlap across keys; the
    reader then reads those after the others, one at a time. (The chunks of one key never share a
    byte: ``.metadata``'s geometry was checked.)"""
    if len(targets) < 2:
        return
    index = {id(item): n for n, item in enumerate(items)}
    places, starts, lengths, kept, keys = [], [], [], [], []
    for item, target in zip(of, targets):
        span = tensor_span(target)
        if span is not None:
            places.append(index[id(item)])
            starts.append(span[0])
            lengths.append(span[1])
            kept.append(target)
            keys.append(item.storage_index.fqn)
    clusters = overlapping(starts, lengths, kept.__getitem__, keys.__getitem__)
    if clusters:
        raise AliasedTargets(sorted(places[n] for n in later_in(clusters, places.__getitem__)), [])


def overlapping(
    starts: list[int],
    lengths: list[int],
    tensor_of: Callable[[int], Any],
    key_of: Callable[[int], str] | None = None,
) -> list[list[int]]:
    """Groups (by place in the lists, each of two or more) of targets that share bytes: spans
    ``[start, start + length)`` that overlap, found in one vectorized pass (single-threaded numpy:
    the common case, none, ends there), then told apart exactly (:func:`share_bytes`: column
    halves of one buffer, or its even and odd elements, share none). With ``key_of``, targets of
    one key never count as sharing (a key's chunks are disjoint)."""
    if len(starts) < 2:
        return []
    begin = numpy.array(starts, dtype=numpy.int64)
    end = begin + numpy.array(lengths, dtype=numpy.int64)
    by_start = numpy.argsort(begin, kind="stable")
    begin, end = begin[by_start], end[by_start]
    if not bool((begin[1:] < numpy.maximum.accumulate(end)[:-1]).any()):
        return []
    groups: list[list[int]] = []
    run: list[tuple[int, int, int]] = []
    reach = -1
    for n, first, last in zip(by_start.tolist(), begin.tolist(), end.tolist()):
        if run and first >= reach:
            groups += _sharing(run, tensor_of, key_of)
            run = []
        run.append((n, first, last))
        reach = max(reach, last) if len(run) > 1 else last
    return groups + _sharing(run, tensor_of, key_of)


def _sharing(
    run: list[tuple[int, int, int]], tensor_of: Callable[[int], Any], key_of: Callable[[int], str] | None
) -> list[list[int]]:
    """The groups of a run of spans that overlap in a chain: joined where two targets (of two
    keys) share a byte."""
    if len(run) < 2 or (key_of is not None and len({key_of(n) for n, _, _ in run}) < 2):
        return []
    parent = {n: n for n, _, _ in run}

    def root(n: int) -> int:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for i, (a, _, last_a) in enumerate(run):
        for b, first_b, _ in run[i + 1 :]:
            if first_b >= last_a:
                break  # sorted by first byte: none further on reaches into a
            if key_of is not None and key_of(a) == key_of(b):
                continue
            if root(a) != root(b) and share_bytes(tensor_of(a), tensor_of(b)):
                parent[root(b)] = root(a)
    found: dict[int, list[int]] = {}
    for n, _, _ in run:
        found.setdefault(root(n), []).append(n)
    return [group for group in found.values() if len(group) > 1]


def later_in(groups: list[list[int]], position: Callable[[int], int]) -> list[int]:
    """In each group, every member but the first by ``position``."""
    return [n for group in groups for n in sorted(group, key=position)[1:]]


def share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the elements of two tensors share a byte; True where that cannot be told simply.

    Both laid out by one set of strides (each dimension's stride at least the next one's times
    its reach: a row-major buffer's views), each is a box in that buffer's coordinates, and they
    share a byte exactly where the boxes meet, at the same offset within the last stride (the
    even and odd elements of a buffer never do)."""
    size = a.element_size()
    gap = b.data_ptr() - a.data_ptr()
    if b.element_size() != size or gap % size:
        return True
    used = {st for t in (a, b) for n, st in zip(t.shape, t.stride()) if n > 1}
    strides = sorted(used, reverse=True)
    if not strides or strides[-1] <= 0:
        return True
    boxes = []
    for tensor, offset in ((a, 0), (b, gap // size)):
        extent = dict.fromkeys(strides, 1)
        for n, st in zip(tensor.shape, tensor.stride()):
            if n > 1:
                if extent[st] != 1:
                    return True  # two dimensions of one stride
                extent[st] = n
        base = offset - min(0, gap // size)  # offsets from the lower of the two first elements
        corner = []
        for st in strides:
            corner.append(base // st)
            base %= st
        for k in range(1, len(strides)):  # a digit past its place would carry into the one above
            if (corner[k] + extent[strides[k]]) * strides[k] > strides[k - 1]:
                return True
        boxes.append((corner, [extent[st] for st in strides], base))
    (corner_a, reach_a, rest_a), (corner_b, reach_b, rest_b) = boxes
    if rest_a != rest_b:
        return False
    return all(
        ca < cb + nb and cb < ca + na for ca, na, cb, nb in zip(corner_a, reach_a, corner_b, reach_b, strict=True)
    )


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
