"""The geometry of a hostile ``.metadata``, checked exactly before anything is built from it.

A reader trusts three things ``.metadata`` says, and each can be crafted:

- **chunks** (per tensor key): every chunk lies inside the tensor, no two overlap, and together
  they cover it. Summing element counts is not enough: two overlapping chunks can hide a hole,
  which a reader would leave as ``torch.empty`` garbage or the caller's old values.
- **records** (``storage_data``): no two entries (two keys, or two chunks of one key) name the
  same bytes of a shard. A record shared by two keys would be read as the second key's dtype and
  shape too (float bits read as int32, or a longer shape reading past the tensor). Checked over
  the records' columns in storage/metadata_check.py.
- **nesting** (``planner_data``): the path each key is rebuilt at. DCP's ``unflatten_state_dict``
  trusts it: an index of 10**8 builds a list of 10**8 entries, two keys on one path drop one of
  them silently, a ``None`` becomes a dict key.

The chunk check costs O(n log n) for the layouts DCP writes (chunks split along one dimension,
or a regular grid of them) and falls back to a pairwise test, bounded in total work, for any
other layout; a layout too irregular to check within that bound is refused rather than trusted.

Longer than 300 lines because the chunk and nesting checks share one error vocabulary and the
layouts' fast paths.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.storage.location import Location, Remote, check_name, file_size, listdir
from parallel_dcp.storage.safe_files import regular_size, vanished

__all__ = [
    "MAX_PATH_DEPTH",
    "MissingShard",
    "PairBudget",
    "check_chunks",
    "check_planner_data",
    "check_shard_sizes",
    "check_shards",
    "describe_index",
]

# A nesting deeper than this is not a model's state dict (torchtitan's deepest is about 8).
MAX_PATH_DEPTH = 64
# Offsets and sizes are compared as int64 in the pairwise fallback.
_MAX_COORD = 1 << 62
# Chunk pairs the pairwise fallback may compare, over the whole .metadata (~1 s of work).
_PAIR_BUDGET = 1 << 27
_BLOCK = 256
_PARTS = {str, int}


class PairBudget:
    """What is left of the pairwise fallback's work for one ``.metadata``."""

    def __init__(self, pairs: int = _PAIR_BUDGET) -> None:
        self.pairs = pairs

    def spend(self, pairs: int) -> bool:
        self.pairs -= pairs
        return self.pairs >= 0


def check_chunks(
    key: str, size: Sequence[int], chunks: Sequence[Any], where: object, budget: PairBudget | None = None
) -> None:
    """The chunks of ``key`` (offsets, sizes) tile the tensor of ``size`` exactly.

    Raises:
        CorruptCheckpointError: a chunk of the wrong rank or outside the tensor, two chunks that
            overlap, a part of the tensor in no chunk, or a layout too irregular to check.
    """
    shape = tuple(size)
    ndim = len(shape)
    strides = 1
    for dim in shape:  # a zero-size tensor passes every byte count whatever its other dimensions
        strides *= max(dim, 1) if type(dim) is int else _MAX_COORD
    if strides >= _MAX_COORD:
        raise CorruptCheckpointError(
            f"{where}: key {key!r} has the impossible shape {list(shape)} (its dimensions multiply past "
            "what torch can index)"
        )
    if len(chunks) == 1 and _whole(chunks[0], shape):  # the common case, checked quickly
        return
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for chunk in chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != ndim or len(sizes) != ndim:
            raise CorruptCheckpointError(f"{where}: key {key!r} has a chunk of the wrong rank")
        for offset, length, whole in zip(offsets, sizes, shape, strict=True):
            if not (_count(offset) and _count(length) and offset + length <= whole < _MAX_COORD):
                raise CorruptCheckpointError(
                    f"{where}: key {key!r} has a chunk outside the tensor "
                    f"(offsets {list(offsets)}, sizes {list(sizes)}, tensor {list(shape)})"
                )
        boxes.append((offsets, sizes))
    total = math.prod(shape)
    if total == 0:
        return  # nothing to cover; every chunk is inside and empty
    boxes = [b for b in boxes if math.prod(b[1]) > 0]  # an empty chunk covers nothing, overlaps nothing
    covered = sum(math.prod(b[1]) for b in boxes)
    if covered != total:
        what = "leave part of it in no chunk" if covered < total else "overlap"
        raise CorruptCheckpointError(
            f"{where}: key {key!r} has chunks of {covered} elements in all for a tensor of {total} "
            f"(impossible chunks: they {what})"
        )
    # Equal volumes: the chunks tile the tensor exactly if and only if no two overlap.
    if _split_along_one_dim(boxes, shape) or _regular_grid(boxes, shape):
        return
    pair = _overlapping_pair(boxes, budget or PairBudget())
    if pair is None:
        raise CorruptCheckpointError(
            f"{where}: key {key!r} has {len(boxes)} chunks in a layout too irregular to check (refused, not trusted)"
        )
    if pair:
        (o1, s1), (o2, s2) = pair
        raise CorruptCheckpointError(
            f"{where}: key {key!r} has overlapping chunks (offsets {list(o1)} sizes {list(s1)} and offsets "
            f"{list(o2)} sizes {list(s2)}), so part of the tensor is in no chunk"
        )


def _whole(chunk: Any, shape: tuple[int, ...]) -> bool:
    """True for one chunk that is the whole tensor (every offset 0, every size the tensor's)."""
    offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
    return (
        len(offsets) == len(shape)
        and all(type(o) is int and o == 0 for o in offsets)
        and all(type(n) is int for n in sizes)
        and sizes == shape
        and max(shape, default=0) < _MAX_COORD
    )


def _count(value: object) -> bool:
    return type(value) is int and value >= 0


def _split_along_one_dim(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], shape: tuple[int, ...]) -> bool:
    """True when every chunk spans the whole tensor but along one dimension, where they lie back to
    back from 0 to its end (row-wise or column-wise sharding; a single whole chunk)."""
    split = {d for offsets, sizes in boxes for d, n in enumerate(shape) if offsets[d] != 0 or sizes[d] != n}
    if len(split) > 1:
        return False
    if not split:
        return len(boxes) == 1
    (dim,) = split
    end = 0
    for offsets, sizes in sorted(boxes, key=lambda b: b[0][dim]):
        if offsets[dim] != end:
            return False
        end += sizes[dim]
    return end == shape[dim]


def _regular_grid(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], shape: tuple[int, ...]) -> bool:
    """True when the chunks are the cells of a grid: along each dimension their intervals tile it,
    and each combination of intervals is exactly one chunk (2-D and 3-D parallel sharding)."""
    grid: list[dict[int, int]] = []
    for d, n in enumerate(shape):
        intervals = {offsets[d]: sizes[d] for offsets, sizes in boxes}
        if any(intervals.get(offsets[d]) != sizes[d] for offsets, sizes in boxes):
            return False
        end = 0
        for start in sorted(intervals):
            if start != end:
                return False
            end += intervals[start]
        if end != n:
            return False
        grid.append(intervals)
    cells = {offsets for offsets, _ in boxes}
    return len(cells) == len(boxes) == math.prod(len(g) for g in grid)


def _overlapping_pair(
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], budget: PairBudget
) -> tuple[Any, Any] | tuple[()] | None:
    """Two chunks that overlap, () when none do, None when the budget cannot afford the test."""
    n = len(boxes)
    if not budget.spend(n * n):
        return None
    starts = torch.tensor([b[0] for b in boxes], dtype=torch.int64)
    ends = starts + torch.tensor([b[1] for b in boxes], dtype=torch.int64)
    for first in range(0, n, _BLOCK):
        s, e = starts[first : first + _BLOCK, None, :], ends[first : first + _BLOCK, None, :]
        overlap = ((s < ends[None, :, :]) & (starts[None, :, :] < e)).all(dim=-1)
        rows = torch.arange(overlap.shape[0])
        overlap[rows, rows + first] = False  # a chunk with itself
        hits = overlap.nonzero()
        if len(hits):
            i, j = int(hits[0][0]) + first, int(hits[0][1])
            return boxes[i], boxes[j]
    return ()


def check_shards(path: Location, metadata: Any, keys: list[str] | None = None) -> None:
    """Refuse, before reading, a checkpoint whose shard files (for ``keys``, or all) are missing
    or shorter than ``.metadata`` records.

    Raises:
        CorruptCheckpointError: naming the shard.
    """
    wanted = None if keys is None else set(keys)
    needed: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        if wanted is None or index.fqn in wanted:
            name = info.relative_path
            end = int(info.offset) + int(info.length)
            if type(name) is not str or name not in needed:  # each name checked once
                needed[check_name(name, path)] = end
            elif end > needed[name]:
                needed[name] = end
    check_shard_sizes(path, needed)


def check_shard_sizes(path: Location, needed: dict[str, int]) -> None:
    """Refuse, before reading, shard files that are missing or shorter than ``needed`` (name ->
    the end of the last byte read from it; every name already checked plain, as .metadata's
    check does for each of its names).

    Raises:
        CorruptCheckpointError: naming the shard.
    """
    present = set(listdir(path))
    for name, end in needed.items():
        if name not in present:
            raise MissingShard(path, name)
        try:  # a local shard by the one rule: a symlink or a FIFO planted there is refused by name
            size = file_size(path / name) if isinstance(path, Remote) else regular_size(path / name)
        except FileNotFoundError:
            raise vanished(path / name) from None
        if size < end:
            raise CorruptCheckpointError(
                f"{path} is damaged: shard {name} has {size} bytes but the metadata records data up to byte {end} "
                "(truncated file)"
            )


class MissingShard(CorruptCheckpointError):
    """A shard that ``.metadata`` (as read) names and the folder lacks; storage/metadata.py's
    ``check_shards`` tells damage from another save that replaced the checkpoint since."""

    def __init__(self, path: Location, name: str) -> None:
        super().__init__(f"{path} is damaged: shard {name} is missing")
        self.name = name


def describe_index(index: object) -> str:
    """``key 'w' (chunk at [0, 4])``: a storage index, named for an error."""
    fqn, offset = getattr(index, "fqn", index), getattr(index, "offset", None)
    return f"key {fqn!r}" + (f" (chunk at {list(offset)})" if offset is not None else "")


def check_planner_data(planner_data: object, keys: Sequence[str], where: object) -> None:
    """``planner_data`` (flattened key -> path in the nesting) describes a nesting that can be
    built: a mapping of string keys to paths of strings (dict keys) and non-negative integers
    (list indices), starting with a string, at most ``MAX_PATH_DEPTH`` long; every key of the
    state dict has one; no two keys share a path; no key's path passes through another's (a value
    that would also be a level); at each level either all names or all indices; and list indices
    no larger than the entries that fill them allow (a list is never mostly holes).

    An empty or missing ``planner_data`` means flat keys (DCP's ``flatten_state_dict=False``).

    Raises:
        CorruptCheckpointError: naming the key.
    """
    if planner_data is None:
        return
    if not isinstance(planner_data, dict):
        raise CorruptCheckpointError(f"{where}: planner_data is a {type(planner_data).__name__}, not a mapping")
    if not planner_data:
        return
    missing = [k for k in keys if k not in planner_data]
    if missing:
        raise CorruptCheckpointError(f"{where}: planner_data has no path for key {missing[0]!r}")
    paths: dict[tuple[Any, ...], str] = {}
    levels: dict[tuple[Any, ...], tuple[type, str]] = {}  # prefix -> str (a dict) or int (a list), and
    lists: dict[tuple[Any, ...], int] = {}  # the key that made it; prefix of a list -> its length
    for key, path in planner_data.items():
        if type(key) is not str:
            raise CorruptCheckpointError(f"{where}: planner_data has a key that is not a string ({key!r:.80})")
        if type(path) not in (tuple, list) or not 0 < len(path) <= MAX_PATH_DEPTH:
            raise CorruptCheckpointError(f"{where}: planner_data gives key {key!r} an impossible path {path!r:.200}")
        path = tuple(path)
        # A parent already met: its prefixes and parts were checked with the path that made it
        # (equal parts of the same types: a bool equals an int, so the types are compared), so
        # only the last part is new.
        first = len(path) - 1 if len(path) > 1 and path[:-1] in levels and {*map(type, path[:-1])} <= _PARTS else 0
        for depth in range(first, len(path)):
            part = path[depth]
            kind = type(part)
            if not (kind is str or (kind is int and part >= 0 and depth > 0)):
                raise CorruptCheckpointError(
                    f"{where}: planner_data gives key {key!r} a path with {part!r:.80} at depth {depth} "
                    "(a path holds names, and after the first, non-negative list indices)"
                )
            if depth:
                prefix = path[:depth]
                level = levels.setdefault(prefix, (kind, key))
                if level[0] is not kind:
                    raise CorruptCheckpointError(
                        f"{where}: planner_data makes {list(prefix)!r:.200} both a dict and a list (key {key!r})"
                    )
                if kind is int:
                    lists[prefix] = max(lists.get(prefix, 0), part + 1)
        other = paths.setdefault(path, key)
        if other != key:
            raise CorruptCheckpointError(f"{where}: planner_data gives keys {other!r} and {key!r} the same path")
    for path, key in paths.items():
        if path in levels:
            raise CorruptCheckpointError(
                f"{where}: planner_data puts key {key!r} at {list(path)!r:.200}, where key {levels[path][1]!r} "
                "has a level of the nesting"
            )
    # A list's length comes from its largest index; entries (or whole empty levels) may be missing
    # from it, but never more slots than twice the paths of the whole mapping plus a little.
    slots = sum(lists.values())
    if slots > 2 * len(paths) + 64:
        raise CorruptCheckpointError(
            f"{where}: planner_data's list indices need {slots} list entries for {len(paths)} keys (impossible nesting)"
        )
