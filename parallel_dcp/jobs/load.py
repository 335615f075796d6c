"""The load pipeline: read any subset of a checkpoint with a pool of workers, into shared memory.

.metadata ── allow-list unpickler (never plain pickle) ── select keys
  │ allocate every selected tensor in one anonymous shared mapping (before the fork)
  ▼
partition by bytes ── WorkerPool (fork)
  │ worker: partial_load(extract_metadata(its keys)) straight into the shared tensors
  │ (non-tensor values are read before the fork, unpickled with weights_only=True)
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
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from parallel_dcp import _compat
from parallel_dcp.engine import progress
from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.engine.partition import Item, Task, partition
from parallel_dcp.engine.pool import WorkerPool
from parallel_dcp.formats.dcp_format import read_keys
from parallel_dcp.options import Options
from parallel_dcp.partial import extract_metadata, partial_load
from parallel_dcp.storage.location import CLIENT_MEMORY, Location, Remote, dcp_reader, locate
from parallel_dcp.storage.metadata import SafeLoadPlanner, check_shards, read_metadata, reading

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


def _load_handler(
    path: Location, metadata: Metadata, targets: dict[str, torch.Tensor | None], trust_pickle: bool
) -> Any:
    def run(task: Task) -> dict[str, Any]:
        # No flattening of any kind: tensors are filled in place, in shared memory.
        planner = SafeLoadPlanner(
            flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True, trust_pickle=trust_pickle
        )
        keys = [key for key in task.keys if targets[key] is not None]  # values were read before the fork
        part = {key: targets[key] for key in keys}
        with reading(path, keys):
            partial_load(extract_metadata(keys, metadata), dcp_reader(path), planner, state_dict=part)
        progress.report(task.nbytes)
        progress.flush()
        return {}

    return run


def load(
    path: str | os.PathLike[str], keys: Iterable[str] | None, options: Options, *, trust_pickle: bool = False
) -> dict[str, Any]:
    """Run the load pipeline above; see :func:`parallel_dcp.load` for the contract."""
    _compat.check_torch()
    path = locate(path, options.storage_options)
    metadata = read_metadata(path)
    selected = list(metadata.state_dict_metadata) if keys is None else list(dict.fromkeys(keys))
    missing = [k for k in selected if k not in metadata.state_dict_metadata]
    if missing:
        raise KeyError(f"not in the checkpoint at {path}: {missing[:8]}" + (" ..." if len(missing) > 8 else ""))
    tensor_metas = {k: m for k in selected if isinstance(m := metadata.state_dict_metadata[k], TensorStorageMetadata)}
    values = {k: sum(int(i.length) for x, i in (metadata.storage_data or {}).items() if x.fqn == k) for k in selected}
    # A value's record is read, then unpickled: twice its stored size, for admission.
    items = [Item(k, n, n) for k in selected for n in [_nbytes(tensor_metas[k]) if k in tensor_metas else 0]]
    items = [it if it.key in tensor_metas else Item(it.key, 0, 2 * values[it.key]) for it in items]
    # The output lives in memory for good; each item also needs a read buffer of its size.
    governor = MemoryGovernor(options.memory_ceiling())
    if isinstance(path, Remote):
        governor.worker_extra = CLIENT_MEMORY  # each worker's own connection
    governor.reserve(sum(item.nbytes for item in items), f"loading {len(items)} keys from {path}")
    workers = governor.workers_for(((it.key, it.memory) for it in items), options.worker_count(len(items)))
    tasks = partition(items, workers, max_task_memory=governor.task_budget(workers), memory_adds_up=False)
    check_shards(path, metadata, selected)
    targets: dict[str, torch.Tensor | None] = {k: None for k in selected}
    targets.update(_shared_tensors(tensor_metas))

    flat: dict[str, Any] = dict(targets)
    # Non-tensor values are read here, before the fork: small, and an unsafe one is refused by
    # name (UnsafeCheckpointError) rather than inside a worker.
    value_keys = [k for k in selected if k not in tensor_metas]
    if value_keys:
        flat.update(read_keys(path, metadata, value_keys, {k: None for k in value_keys}, trust_pickle=trust_pickle))
    tasks = [t for t in tasks if any(k in tensor_metas for k in t.keys)]
    if tasks:
        with (
            progress.Progress(total=sum(t.nbytes for t in tasks), enabled=options.progress, desc="load") as bar,
            WorkerPool(
                min(workers, len(tasks)),
                _load_handler(path, metadata, targets, trust_pickle),
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
