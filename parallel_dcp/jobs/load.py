"""The load pipeline: read any subset of a checkpoint with a pool of workers, into shared memory.

.metadata ── allow-list unpickler (never plain pickle) ── select keys
  │ allocate every selected tensor in one anonymous shared mapping (before the fork)
  ▼
partition by bytes ── WorkerPool (fork)
  │ worker: partial_load(extract_metadata(its keys)) straight into the shared tensors
  │ ◀── only non-tensor values (small pickles) travel back through the pipe
  ▼
unflatten with planner_data → the original nesting
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from parallel_dcp import _compat
from parallel_dcp.engine import progress
from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.engine.partition import Item, Task, partition
from parallel_dcp.engine.pool import WorkerPool
from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.options import Options
from parallel_dcp.partial import extract_metadata, partial_load
from parallel_dcp.storage.location import CLIENT_MEMORY, Location, Remote, dcp_reader, file_size, listdir, locate
from parallel_dcp.storage.metadata import read_metadata

__all__ = ["load"]

_ALIGN = 64


def _nbytes(meta: TensorStorageMetadata) -> int:
    return math.prod(meta.size) * torch.empty((), dtype=meta.properties.dtype).element_size()


def _shared_tensors(metas: dict[str, TensorStorageMetadata]) -> dict[str, torch.Tensor]:
    """Empty tensors that live in one MAP_SHARED anonymous mapping, so forked workers fill them."""
    offsets: dict[str, int] = {}
    total = 0
    for key, meta in metas.items():
        offsets[key] = total
        total += -(-_nbytes(meta) // _ALIGN) * _ALIGN
    tensors: dict[str, torch.Tensor] = {}
    if total == 0:
        return {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype) for key, meta in metas.items()}
    buffer = mmap.mmap(-1, total, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    for key, meta in metas.items():
        nbytes = _nbytes(meta)
        if nbytes == 0:
            tensors[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            continue
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offsets[key])
        tensors[key] = raw.view(meta.properties.dtype).view(tuple(meta.size))
    return tensors


def _check_shards(path: Location, metadata: Metadata, keys: list[str]) -> None:
    """Refuse, before reading, a checkpoint whose shard files are missing or shorter than recorded."""
    wanted = set(keys)
    needed: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn in wanted:
            name = str(info.relative_path)
            needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    present = set(listdir(path))
    for name, end in needed.items():
        if name not in present:
            raise CorruptCheckpointError(f"{path} is damaged: shard {name} is missing")
        size = file_size(path / name)
        if size < end:
            raise CorruptCheckpointError(
                f"{path} is damaged: shard {name} has {size} bytes but the metadata records data up to byte {end} "
                "(truncated file)"
            )


def _load_handler(path: Location, metadata: Metadata, targets: dict[str, torch.Tensor | None]) -> Any:
    def run(task: Task) -> dict[str, Any]:
        part = {key: targets[key] for key in task.keys}
        # No flattening of any kind: the planner must write bytes values into `part` itself.
        planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        loaded = partial_load(extract_metadata(task.keys, metadata), dcp_reader(path), planner, state_dict=part)
        progress.report(task.nbytes)
        progress.flush()
        # Tensors were filled in place in shared memory; only other values travel back.
        return {key: loaded[key] for key in task.keys if targets[key] is None}

    return run


def load(path: str | os.PathLike[str], keys: Iterable[str] | None, options: Options) -> dict[str, Any]:
    """Run the load pipeline above; see :func:`parallel_dcp.load` for the contract."""
    _compat.check_torch()
    path = locate(path, options.storage_options)
    metadata = read_metadata(path)
    selected = list(metadata.state_dict_metadata) if keys is None else list(dict.fromkeys(keys))
    missing = [k for k in selected if k not in metadata.state_dict_metadata]
    if missing:
        raise KeyError(f"not in the checkpoint at {path}: {missing[:8]}" + (" ..." if len(missing) > 8 else ""))
    tensor_metas = {k: m for k in selected if isinstance(m := metadata.state_dict_metadata[k], TensorStorageMetadata)}
    items = [Item(k, n, n) for k in selected for n in [_nbytes(tensor_metas[k]) if k in tensor_metas else 0]]
    # The output lives in memory for good; each item also needs a read buffer of its size.
    governor = MemoryGovernor(options.memory_ceiling())
    if isinstance(path, Remote):
        governor.worker_extra = CLIENT_MEMORY  # each worker's own connection
    governor.reserve(sum(item.nbytes for item in items), f"loading {len(items)} keys from {path}")
    workers = governor.workers_for(((it.key, it.memory) for it in items), options.worker_count(len(items)))
    tasks = partition(items, workers, max_task_memory=governor.task_budget(workers), memory_adds_up=False)
    _check_shards(path, metadata, selected)
    targets: dict[str, torch.Tensor | None] = {k: None for k in selected}
    targets.update(_shared_tensors(tensor_metas))

    flat: dict[str, Any] = dict(targets)
    if tasks:
        with (
            progress.Progress(total=sum(t.nbytes for t in tasks), enabled=options.progress, desc="load") as bar,
            WorkerPool(
                min(workers, len(tasks)),
                _load_handler(path, metadata, targets),
                initializer=lambda: torch.set_num_threads(1),
            ) as pool,
        ):
            for result in pool.run(
                tasks,
                governor=governor,
                task_timeout=options.task_timeout,
                retries=options.retries,
                on_tick=bar.refresh,
            ):
                flat.update(result.value)
                bar.refresh()
    planner_data = metadata.planner_data or {}
    mapping = {k: planner_data.get(k, (k,)) for k in selected}
    return _compat.unflatten_state_dict(flat, mapping)
