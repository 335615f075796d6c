"""Run under torchrun by tests/test_fast_load_dist.py: one rank of a DTensor save or load.

torchrun --standalone --nnodes=1 --nproc_per_node=2 tests/dtensor_job.py save|load PATH

save: stock dcp.save of DTensors sharded Shard(0) over the ranks (gloo, CPU).
load: stock dcp.load with parallel_dcp.FastReader into DTensors sharded Shard(1) (another
sharding: every rank reads parts of both stored chunks); prints whether each equals the source.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import parallel_dcp


def source() -> dict[str, torch.Tensor]:
    """The full tensors, the same on every rank and in the test that checks them."""
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(64, 96, generator=g),
        "e": torch.randn(50, 128, generator=g).to(torch.bfloat16),
        "b": torch.randn(30, generator=g),
    }


def main() -> int:
    mode, path = sys.argv[1:3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = source()
    if mode == "save":
        dcp.save({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}, checkpoint_id=path)
    else:
        sd = {
            k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1) if v.dim() > 1 else Shard(0)])
            for k, v in full.items()
        }
        reader = parallel_dcp.FastReader(path, workers=2)
        dcp.load(sd, storage_reader=reader)
        equal = {k: bool(torch.equal(sd[k].full_tensor(), full[k])) for k in full}
        stats = reader.stats
        print(json.dumps({"rank": rank, "equal": equal, "fast": stats.fast, "fallback": stats.fallback}))
    dist.destroy_process_group()
    # torch's process-group threads sometimes abort the interpreter's teardown ("terminate called
    # without an active exception") after everything above has finished and printed.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
