"""The conversion suite: safetensors shards and a torch.save file into DCP, ours against stock.

Sources are built once, before any timing, in the scenario's directory:

    sources/model.pt                                    torch.save of the state dict
    sources/hf/model-0000i-of-0000n.safetensors + model.safetensors.index.json
                                                        (parallel_dcp.convert, ~4 shards)

Rows:
- ``st->dcp parallel_dcp w=n``: ``parallel_dcp.convert(hf_dir, out, workers=n, memory_limit=...)``.
- ``st->dcp stock``: ``safetensors.torch.load_file`` of every shard, then ``dcp.save`` (one process).
- ``pt->dcp parallel_dcp w=n``: ``parallel_dcp.convert(model.pt, out, ...)``.
- ``pt->dcp stock``: ``torch.distributed.checkpoint.format_utils.torch_save_to_dcp`` (with sync off,
  its own two steps, ``torch.load`` then ``dcp.save``, with ``sync_files=False``, since it has no
  such switch).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.format_utils import torch_save_to_dcp
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import parallel_dcp
from parallel_dcp.benchmark.measure import Case
from parallel_dcp.benchmark.writers import fsync_file
from parallel_dcp.engine.memory import ITEM_MEMORY_BYTES, TASK_MEMORY_BYTES, WORKER_MEMORY_BYTES

__all__ = ["Sources", "build_sources", "convert_cases", "convert_memory_limit"]

_SHARDS = 4
_INDEX = "model.safetensors.index.json"
# Slack over the library's own per-task estimates, so that the default limit never makes it
# drop a worker for want of a few MiB.
_MARGIN = 32 * 2**20


class Sources:
    """The converted inputs: a torch.save file and a sharded safetensors directory."""

    def __init__(self, root: str) -> None:
        self.root = os.path.join(root, "sources")
        self.torch_file = os.path.join(self.root, "model.pt")
        self.safetensors_dir = os.path.join(self.root, "hf")

    def shard_files(self) -> list[str]:
        with open(os.path.join(self.safetensors_dir, _INDEX)) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(self.safetensors_dir, name) for name in names]


def build_sources(state_dict: dict[str, torch.Tensor], root: str, nbytes: int) -> Sources:
    """Write the torch.save file and the safetensors shards (untimed, durable)."""
    sources = Sources(root)
    os.makedirs(sources.root)
    torch.save(state_dict, sources.torch_file)
    fsync_file(sources.torch_file)
    shard_size = max(1, nbytes // _SHARDS)
    parallel_dcp.convert(sources.torch_file, sources.safetensors_dir, to="safetensors", shard_size=shard_size)
    return sources


def convert_memory_limit(nbytes: int, largest: int, workers: int) -> int:
    """The default ``memory_limit`` of our conversions: a quarter of the state dict's size, raised
    where that would not let each of ``workers`` workers hold the largest tensor (as read from
    the source, a tensor is its worker's own memory)."""
    per_worker = largest + TASK_MEMORY_BYTES + ITEM_MEMORY_BYTES + WORKER_MEMORY_BYTES
    return max(nbytes // 4, workers * per_worker + _MARGIN)


def _ours(kind: str, source: str, workers: int, sync: bool, memory_limit: int) -> Case:
    def run(out: str) -> dict[str, Any]:
        result = parallel_dcp.convert(source, out, workers=workers, memory_limit=memory_limit, sync_files=sync)
        assert isinstance(result, parallel_dcp.SaveResult)
        return {"workers_used": result.workers, "tasks": result.tasks, "memory_limit": memory_limit}

    return Case(
        name=f"{kind}->dcp parallel_dcp w={workers}",
        family=f"{kind}->dcp parallel_dcp",
        procs=workers,
        run=run,
        baseline=f"{kind}->dcp stock",
        limit=f"plain write x{workers}",
    )


def _stock_safetensors(sources: Sources, sync: bool) -> Case:
    def run(out: str) -> None:
        state_dict: dict[str, torch.Tensor] = {}
        for shard in sources.shard_files():
            state_dict.update(load_file(shard))
        dcp_save(state_dict, storage_writer=FileSystemWriter(out, sync_files=sync), no_dist=True)

    return Case(name="st->dcp stock", family="st->dcp stock", procs=1, run=run, limit="plain write x1")


def _stock_torch(sources: Sources, sync: bool) -> Case:
    def run(out: str) -> None:
        if sync:
            torch_save_to_dcp(sources.torch_file, out)
            return
        state_dict = torch.load(sources.torch_file, weights_only=False)  # what torch_save_to_dcp does
        dcp_save(state_dict, storage_writer=FileSystemWriter(out, sync_files=False), no_dist=True)

    note = "" if sync else "torch_save_to_dcp's steps with sync_files=False"
    return Case(name="pt->dcp stock", family="pt->dcp stock", procs=1, run=run, limit="plain write x1", note=note)


def convert_cases(sources: Sources, workers: list[int], sync: bool, memory_limit: int) -> list[Case]:
    """Our conversions at every count in ``workers`` and the stock path, for both sources."""
    cases = [_ours("st", sources.safetensors_dir, n, sync, memory_limit) for n in workers]
    cases.append(_stock_safetensors(sources, sync))
    cases += [_ours("pt", sources.torch_file, n, sync, memory_limit) for n in workers]
    cases.append(_stock_torch(sources, sync))
    return cases
