"""Fuzzing ``.metadata`` geometry and ``planner_data`` (issue 24): every case ends in a
ParallelDCPError or in a metadata that is what it claims -- chunks that tile each tensor exactly,
records shared by no two entries, a nesting that builds every key at its path and nothing else --
and, for cases loaded from real shards, in the right data. Never a raw exception, never wrong data.

Seeded (``random.Random``), so a failure names its case and reproduces.
"""

from __future__ import annotations

import copy
import itertools
import math
import pickle
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import parallel_dcp
from parallel_dcp import _compat
from parallel_dcp.errors import CorruptCheckpointError, ParallelDCPError
from parallel_dcp.storage.metadata import check_metadata

pytestmark = pytest.mark.timeout(300)

IN_MEMORY_CASES = 6000
LOADED_CASES = 160


# --- generating valid metadata ---------------------------------------------------------------------


def _tiling(rng: random.Random, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Chunks that tile ``shape`` exactly: a grid, or guillotine cuts."""
    ndim = len(shape)
    if ndim == 0 or math.prod(shape) == 0:
        return [((0,) * ndim, shape)]
    if rng.random() < 0.3:  # a regular grid
        cuts = []
        for n in shape:
            points = sorted(rng.sample(range(1, n), k=min(n - 1, rng.randint(0, 2)))) if n > 1 else []
            edges = [0, *points, n]
            cuts.append([(a, b - a) for a, b in itertools.pairwise(edges)])
        return [(tuple(c[0] for c in cell), tuple(c[1] for c in cell)) for cell in itertools.product(*cuts)]
    boxes = [((0,) * ndim, shape)]
    for _ in range(rng.randint(0, 5)):  # guillotine cuts of random boxes along random dims
        i = rng.randrange(len(boxes))
        offsets, sizes = boxes[i]
        dims = [d for d in range(ndim) if sizes[d] > 1]
        if not dims:
            continue
        d = rng.choice(dims)
        cut = rng.randint(1, sizes[d] - 1)
        a = (offsets, (*sizes[:d], cut, *sizes[d + 1 :]))
        b = ((*offsets[:d], offsets[d] + cut, *offsets[d + 1 :]), (*sizes[:d], sizes[d] - cut, *sizes[d + 1 :]))
        boxes[i : i + 1] = [a, b]
    return boxes


def _nesting(rng: random.Random, count: int) -> dict[str, Any]:
    """A random nested state dict of ``count`` tensor leaves (dicts and lists)."""
    root: dict[str, Any] = {}
    names = ["a", "b", "c", "layers", "opt", "0"]
    for n in range(count):
        container: Any = root
        for _ in range(rng.randint(0, 3)):
            if isinstance(container, dict):
                name = rng.choice(names)
                child = container.get(name)
                if not isinstance(child, (dict, list)):
                    child = container[name] = [] if rng.random() < 0.3 else {}
                container = child
            else:
                if container and rng.random() < 0.5 and isinstance(container[-1], (dict, list)):
                    container = container[-1]
                else:
                    container.append({})
                    container = container[-1]
        leaf = torch.full((1,), float(n))
        if isinstance(container, dict):
            container[f"t{n}"] = leaf
        else:
            container.append(leaf)
    return root


def _valid_metadata(rng: random.Random) -> Metadata:
    state = _nesting(rng, rng.randint(1, 6))
    flat, mapping = _compat.flatten_state_dict(state)
    state_meta: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    offset = 0
    for key in flat:
        if rng.random() < 0.15:
            state_meta[key] = BytesStorageMetadata()
            storage[MetadataIndex(key)] = _compat.storage_info("__0_0.distcp", offset, 50)
            offset += 50
            continue
        shape = tuple(rng.randint(0, 5) if rng.random() < 0.1 else rng.randint(1, 5) for _ in range(rng.randint(0, 3)))
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in _tiling(rng, shape)]
        state_meta[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), chunks)
        for chunk in chunks:
            length = math.prod(chunk.sizes) * 4 + 100
            storage[MetadataIndex(key, chunk.offsets)] = _compat.storage_info("__0_0.distcp", offset, length)
            offset += length
    planner_data = dict(mapping) if rng.random() < 0.9 else {}
    return Metadata(state_dict_metadata=state_meta, planner_data=planner_data, storage_data=storage)


# --- mutations ---------------------------------------------------------------------------------------


def _tensor_keys(m: Metadata) -> list[str]:
    return [k for k, v in m.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]


def _a_chunk(rng: random.Random, m: Metadata) -> tuple[str, ChunkStorageMetadata] | None:
    keys = [k for k in _tensor_keys(m) if m.state_dict_metadata[k].chunks]  # type: ignore[union-attr]
    if not keys:
        return None
    key = rng.choice(keys)
    return key, rng.choice(m.state_dict_metadata[key].chunks)  # type: ignore[union-attr]


def _reindex(m: Metadata, key: str, old: torch.Size, new: torch.Size) -> None:
    info = m.storage_data.pop(MetadataIndex(key, old), None)
    if info is not None:
        m.storage_data[MetadataIndex(key, new)] = info


def _nudge(values: torch.Size, rng: random.Random) -> torch.Size:
    if not len(values):
        return torch.Size([rng.choice([1, -1])])  # a rank-0 chunk given a rank
    d = rng.randrange(len(values))
    out = list(values)
    out[d] = rng.choice([out[d] + 1, out[d] - 1, 0, 2**40, -(2**70)])
    return torch.Size(out) if all(v >= 0 for v in out) else tuple(out)  # type: ignore[return-value]


def _shift(rng: random.Random, m: Metadata) -> None:
    found = _a_chunk(rng, m)
    if found:
        key, chunk = found
        old = chunk.offsets
        chunk.offsets = _nudge(chunk.offsets, rng)
        _reindex(m, key, old, chunk.offsets)


def _resize(rng: random.Random, m: Metadata) -> None:
    found = _a_chunk(rng, m)
    if found:
        found[1].sizes = _nudge(found[1].sizes, rng)


def _duplicate_or_drop(rng: random.Random, m: Metadata) -> None:
    found = _a_chunk(rng, m)
    if found:
        key, chunk = found
        chunks = m.state_dict_metadata[key].chunks  # type: ignore[union-attr]
        if rng.random() < 0.5:
            chunks.append(copy.deepcopy(chunk))
        else:
            chunks.remove(chunk)


def _tensor_size(rng: random.Random, m: Metadata) -> None:
    keys = _tensor_keys(m)
    if keys:
        meta = m.state_dict_metadata[rng.choice(keys)]
        meta.size = _nudge(meta.size, rng)  # type: ignore[union-attr]


def _share_record(rng: random.Random, m: Metadata) -> None:
    indices = list(m.storage_data)
    if len(indices) > 1:
        a, b = rng.sample(indices, 2)
        m.storage_data[b] = copy.copy(m.storage_data[a])


def _overlap_record(rng: random.Random, m: Metadata) -> None:
    info = m.storage_data[rng.choice(list(m.storage_data))]
    info.offset = max(0, info.offset + rng.choice([-1, 1, -50]))


def _planner(rng: random.Random, m: Metadata) -> None:
    pd = m.planner_data
    if not isinstance(pd, dict) or not pd:
        m.planner_data = {k: (k,) for k in m.state_dict_metadata}
        pd = m.planner_data
    keys = list(pd)
    key = rng.choice(keys)
    path = list(pd[key])
    choice = rng.randrange(12)
    if choice == 0:
        path.append(rng.choice([None, -1, 10**8, True, 1.5, b"x"]))
    elif choice == 1:
        path[rng.randrange(len(path))] = rng.choice([None, -1, 10**8, 7, "zz", 0])
    elif choice == 2 and len(keys) > 1:
        path = list(pd[rng.choice([k for k in keys if k != key])])  # two keys, one path
    elif choice == 3 and len(keys) > 1:
        path = [*pd[rng.choice([k for k in keys if k != key])], "leaf"]  # a value is a level
    elif choice == 4:
        del pd[key]
        return
    elif choice == 5:
        path = []
    elif choice == 6:
        path = ["deep"] * rng.choice([64, 65, 200])
    elif choice == 7:
        m.planner_data = rng.choice([[1, 2], "x", 3, None])
        return
    elif choice == 8:
        pd[rng.choice([None, 1, ("t",)])] = (key,)
        return
    elif choice == 9 and len(path) > 1:
        path[-1] = 0 if isinstance(path[-1], str) else "name"  # a dict and a list at one level
    elif choice == 10:
        path = [0, *path]
    else:
        path = path[:-1] if len(path) > 1 else [*path, "x"]
    pd[key] = tuple(path) if rng.random() < 0.9 else path


# planner_data three times: its mutations are many kinds, and an earlier check often refuses first
MUTATIONS = [_shift, _resize, _duplicate_or_drop, _tensor_size, _share_record, _overlap_record, *[_planner] * 3]


# --- what a metadata that passed must be ------------------------------------------------------------


def _assert_tiles(key: str, meta: TensorStorageMetadata) -> None:
    shape = tuple(meta.size)
    cover = torch.zeros(shape, dtype=torch.int32) if len(shape) else torch.zeros((), dtype=torch.int32)
    for chunk in meta.chunks:
        assert len(chunk.offsets) == len(shape) == len(chunk.sizes), key
        region = cover
        for d, (o, s) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
            assert o >= 0 and s >= 0 and o + s <= shape[d], key
            region = region.narrow(d, o, s)
        region += 1
    assert bool((cover == 1).all()), f"{key}: chunks do not tile {shape}"


def _assert_records_unshared(m: Metadata) -> None:
    spans = sorted((str(i.relative_path), i.offset, i.offset + i.length) for i in m.storage_data.values())
    for (f1, s1, e1), (f2, s2, _) in itertools.pairwise(spans):
        assert f1 != f2 or (s2 >= e1 and s2 != s1), "two entries share a record"


def _assert_nesting(m: Metadata) -> None:
    pd = m.planner_data or {}
    keys = list(m.state_dict_metadata)
    sentinels = {k: object() for k in keys}
    nested = _compat.unflatten_state_dict(dict(sentinels), {k: pd.get(k, (k,)) for k in keys})
    for key in keys:
        node: Any = nested
        for part in pd.get(key, (key,)):
            node = node[part]
        assert node is sentinels[key], f"{key} is not at its path"
    found, slots = 0, 0
    stack = [nested]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            slots += len(node)
            stack.extend(node)
        elif node is not None:
            found += 1
    assert found == len(keys), "a key was dropped or doubled"
    assert slots <= 2 * len(pd) + 64, "lists far longer than their entries"


def test_fuzzed_geometry_and_planner_data_in_memory() -> None:
    rng = random.Random(20261203)
    refused = passed = 0
    for case in range(IN_MEMORY_CASES):
        metadata = _valid_metadata(rng)
        mutated = rng.random() < 0.8
        if mutated:
            for mutate in rng.sample(MUTATIONS, rng.randint(1, 2)):
                mutate(rng, metadata)
        try:
            check_metadata(metadata, f"case {case}")
        except CorruptCheckpointError:
            assert mutated, f"case {case}: a valid metadata was refused"
            refused += 1
            continue
        except Exception as exc:
            raise AssertionError(f"case {case}: raw {type(exc).__name__}: {exc}") from exc
        passed += 1
        for key in _tensor_keys(metadata):
            _assert_tiles(key, metadata.state_dict_metadata[key])  # type: ignore[arg-type]
        _assert_records_unshared(metadata)
        _assert_nesting(metadata)
    assert refused > IN_MEMORY_CASES // 3 and passed > IN_MEMORY_CASES // 5, (refused, passed)


# --- real loads from real shards -------------------------------------------------------------------


def _state() -> dict[str, Any]:
    return {
        "w": torch.arange(64.0).reshape(8, 8),
        "v": torch.arange(8, dtype=torch.int32),
        "n": {"x": torch.ones(3), "l": [torch.zeros(2), torch.full((2,), 2.0)]},
        "step": 5,
    }


def _at(nested: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        nested = nested[part]
    return nested


def test_fuzzed_metadata_over_real_shards_loads_right_or_fails_cleanly(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    parallel_dcp.save(_state(), ckpt, workers=2, chunk_size=64)
    original = pickle.loads((ckpt / ".metadata").read_bytes())
    flat, _ = _compat.flatten_state_dict(_state())
    rng = random.Random(24)
    outcomes = {"loaded": 0, "refused": 0}
    for case in range(LOADED_CASES):
        metadata = copy.deepcopy(original)
        for mutate in rng.sample(MUTATIONS, rng.randint(1, 2)):
            mutate(rng, metadata)
        (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
        try:
            got = parallel_dcp.load(ckpt, workers=rng.choice([1, 2]))
        except ParallelDCPError:
            outcomes["refused"] += 1
            continue
        except Exception as exc:
            raise AssertionError(f"case {case}: raw {type(exc).__name__}: {exc}") from exc
        outcomes["loaded"] += 1
        planner_data = metadata.planner_data or {}
        for key in metadata.state_dict_metadata:
            value = _at(got, tuple(planner_data.get(key, (key,))))
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, flat[key]), f"case {case}: wrong data for {key!r}"
            else:
                assert value == flat[key], f"case {case}: wrong value for {key!r}"
    assert outcomes["refused"] > LOADED_CASES // 2 and outcomes["loaded"] > 5, outcomes
