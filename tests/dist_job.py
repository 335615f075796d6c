"""Run under torchrun by tests/test_distributed.py: one rank of a distributed conversion.

torchrun --standalone --nnodes=1 --nproc_per_node=2 tests/dist_job.py ok|fail SRC DST
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import parallel_dcp
from parallel_dcp.jobs import targets


def main() -> int:
    mode, src, dst = sys.argv[1:4]
    rank = int(os.environ["RANK"])
    if mode == "fail" and rank == 1:  # every task of rank 1 fails inside its worker

        def boom(self: Any, job: Any, task: Any, data: Any, staging: Any, options: Any) -> Any:
            raise RuntimeError(f"injected failure in task {task.index}")

        targets.DcpTarget.write = boom  # type: ignore[method-assign]
    try:
        result = parallel_dcp.convert(src, dst, workers=1, distributed=True, chunk_size="256KiB")
    except parallel_dcp.ParallelDCPError as exc:
        print(f"rank {rank} failed: {exc}", file=sys.stderr)
        return 1
    assert isinstance(result, parallel_dcp.SaveResult)
    print(json.dumps({"rank": rank, "tasks": result.tasks, "files": result.files, "bytes": result.bytes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
