"""One job across the ranks of a ``torch.distributed`` job (torchrun or srun), over gloo on CPU.

    rank 0: plan (split, check against the limit, tasks), take hold of the destination
       │ broadcast: units, chunk threshold, worker count, task budget, where to write (save id)
       ▼
    every rank: the same task list (planned identically); its share, balanced by bytes over
       │ the ranks; runs it on its own worker pool under its own memory limit. Part indices
       │ are the global task indices, so no two ranks write the same file.
       ▼ all_gather: (error or results) from every rank
    rank 0: any error → this save's files removed; else merge, commit once, publish
       │ broadcast: the outcome
       ▼
    every rank returns the same SaveResult, or raises DistributedJobError naming each failed
    rank with its worker and keys (so every rank exits non-zero)

The destination must be on a file system every rank sees at the same path. Every collective has
the process group's timeout (``dist_timeout``, 30 min by default), so a dead rank cannot hang
the others forever; torchrun also stops the remaining ranks when one exits with an error.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import hashlib
import heapq
import os
import socket
from pathlib import Path
from typing import Any

import torch.distributed as dist

from parallel_dcp.engine.held_interrupts import HeldInterrupts
from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.pool import TaskResult
from parallel_dcp.errors import DistributedJobError
from parallel_dcp.jobs import pipeline
from parallel_dcp.jobs.dcp_commit import in_band
from parallel_dcp.jobs.source_check import plan_checks
from parallel_dcp.jobs.targets import AnyStaging, Job, Target
from parallel_dcp.options import Options
from parallel_dcp.storage.protocol import WriteLocation

__all__ = ["run_job", "share"]


def share(tasks: list[Task], ranks: int) -> list[list[Task]]:
    """Tasks dealt to ``ranks`` by bytes, largest first, each to the least loaded rank."""
    shares: list[list[Task]] = [[] for _ in range(ranks)]
    heap = [(0, r) for r in range(ranks)]
    for task in sorted(tasks, key=lambda t: (-t.nbytes, t.index)):
        load, rank = heapq.heappop(heap)
        shares[rank].append(task)
        heapq.heappush(heap, (load + task.nbytes + 1, rank))
    return shares


def _group(options: Options) -> Any:
    """The gloo group to use (None: the default group). A group this creates lives until the
    process exits, so that a batch of conversions shares it."""
    timeout = datetime.timedelta(seconds=options.dist_timeout)
    if not dist.is_available():
        raise DistributedJobError("distributed=True needs torch.distributed, which this torch build lacks", failures={})
    if not dist.is_initialized():
        if "RANK" not in os.environ and "SLURM_PROCID" not in os.environ:
            raise DistributedJobError(
                "distributed=True needs a torch.distributed launcher: run under torchrun (or srun with "
                "MASTER_ADDR and MASTER_PORT set); see docs/several-nodes.md",
                failures={},
            )
        _from_slurm()
        dist.init_process_group(backend="gloo", timeout=timeout)
        atexit.register(_destroy)
        return None
    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=timeout)  # e.g. NCCL by default: objects need gloo


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _from_slurm() -> None:
    """Fill torch's variables from Slurm's when launched by srun without torchrun."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise DistributedJobError(
            "under srun, set MASTER_ADDR and MASTER_PORT (see docs/several-nodes.md)", failures={}
        )


def _fingerprint(job: Job) -> str:
    """What every rank must agree on: the source's tensors (names, dtypes, shapes) and values."""
    digest = hashlib.sha256()
    for key, entry in job.source.entries.items():
        digest.update(f"{key}|{entry.dtype}|{entry.shape};".encode())
    for key in job.source.values:
        digest.update(f"{key};".encode())
    return digest.hexdigest()


def _broadcast(value: Any, group: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _gather(value: Any, group: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def run_job(
    job: Job, target: Target, options: Options, governor: MemoryGovernor, *, start: float
) -> pipeline.SaveResult:
    """Run ``job`` as one rank; see the module docstring. Every rank calls this."""
    group = _group(options)
    return _run(job, target, options, governor, start, group)


def _run(
    job: Job, target: Target, options: Options, governor: MemoryGovernor, start: float, group: Any
) -> pipeline.SaveResult:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    host = socket.gethostname()
    fingerprints = _gather(_fingerprint(job), group)
    if len(set(fingerprints)) > 1:
        differ = [r for r, f in enumerate(fingerprints) if f != fingerprints[0]]
        raise DistributedJobError(
            f"ranks {differ} see a different source than rank 0 (keys, dtypes or shapes differ): every rank "
            "must read the same source",
            failures={r: "different source" for r in differ},
        )

    # 1. Rank 0 plans and stages; every rank learns the plan or rank 0's error.
    staging = None
    announcement: dict[str, Any]
    if rank == 0:
        try:
            plan = pipeline.plan_job(job, target, options, governor, scale=world)
            staging = target.stage(options.overwrite, protect=list(job.source.files))
            staging.check_space(pipeline.needed_space(plan.job))
            announcement = {
                "threshold": plan.threshold,
                "workers": plan.workers,
                "budget": governor.task_budget(plan.workers),
                "location": staging.location,  # plain data: the directory and this save's id
            }
        except Exception as exc:
            if staging is not None:
                staging.discard()
            announcement = {"error": f"rank 0 ({host}): {_describe(exc)}"}
            _broadcast(announcement, group)
            raise
    announcement = _broadcast(announcement if rank == 0 else None, group)
    if "error" in announcement:
        raise DistributedJobError(f"the job failed before any write: {announcement['error']}", failures={0: ""})

    try:
        return _write_and_commit(job, target, options, governor, start, group, announcement, staging)
    except BaseException:
        if staging is not None:  # rank 0, interrupted (Ctrl-C) or failed outside the steps below
            staging.discard()
        raise


def _write_and_commit(
    job: Job,
    target: Target,
    options: Options,
    governor: MemoryGovernor,
    start: float,
    group: Any,
    announcement: dict[str, Any],
    staging: AnyStaging | None,
) -> pipeline.SaveResult:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    host = socket.gethostname()
    if announcement["threshold"]:
        job = job.split(announcement["threshold"])
    tasks = target.plan(job, announcement["workers"] * world, announcement["budget"])
    if job.checks is not None:  # the same duties on every rank: each file hashed by one task
        checks, tasks = plan_checks(job.checks, tasks, job.chunks)
        job = dataclasses.replace(job, checks=checks)
    mine = share(tasks, world)[rank]
    location: WriteLocation = announcement["location"]
    staging_path = location.root
    if rank == 0 and staging is not None:
        staging.expect(target.output_names(tasks))

    # 2. Every rank runs its share.
    outcome: tuple[str | None, list[Any]]
    try:
        if isinstance(staging_path, Path) and not staging_path.is_dir():
            raise FileNotFoundError(
                f"the destination directory {staging_path} that rank 0 prepared is not visible on {host}: the "
                "destination must be on a file system every rank shares"
            )
        workers = min(options.worker_count(len(mine)), announcement["workers"]) if mine else 0
        results = pipeline.run_tasks(job, target, mine, location, options, governor, max(workers, 1))
        # Pickled for the gather with no buffers beside it: a result's mapped views as bytes again.
        outcome = (None, [(r.task.index, r.worker, r.seconds, in_band(r.value)) for r in results])
    except Exception as exc:
        outcome = (f"rank {rank} ({host}): {_describe(exc)}", [])
    gathered = _gather(outcome, group)
    failures = {r: error for r, (error, _) in enumerate(gathered) if error}

    # 3. Rank 0 commits once, or removes what this save wrote.
    final: str | None = None
    files = 0
    held = HeldInterrupts()  # a Ctrl-C while committing and publishing: raised after them
    if rank == 0:
        assert staging is not None
        try:
            if failures:
                staging.discard()
            else:
                values = sorted((entry for _, entries in gathered for entry in entries), key=lambda e: e[0])
                with held:
                    files = target.commit(job, tasks, [value for *_, value in values], staging, options)
                    staging.publish()
        except Exception as exc:
            staging.discard()
            final = f"rank 0 ({host}) could not commit: {_describe(exc)}"
    final, files = _broadcast((final, files), group)
    committed = staging is not None and final is None and not failures
    held.deliver(committed=str(staging.location.root) if committed and staging is not None else None)
    if final is not None:
        failures[0] = final
    if failures:
        raise DistributedJobError(
            "nothing was committed; " + "; ".join(failures[r] for r in sorted(failures)), failures=failures
        )
    by_index = {task.index: task for task in tasks}
    per_rank = announcement["workers"]
    per_worker = [  # workers are numbered across ranks: rank r's worker w is r * per_rank + w
        TaskResult(task=by_index[index], worker=r * per_rank + worker, seconds=seconds, value=None)
        for r, (_, entries) in enumerate(gathered)
        for index, worker, seconds, _ in entries
    ]
    return pipeline.result_of(target, job, tasks, per_rank * world, per_worker, files, governor, options, start)
