"""Run a write job here, or as one rank of a torchrun/srun job: the only place that chooses.

Both run the same steps of :mod:`parallel_dcp.jobs.pipeline` (plan, stage, run, commit,
publish); distributed mode changes who runs which tasks and who commits.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable

from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.jobs import distributed, pipeline, resume
from parallel_dcp.jobs.pipeline import SaveResult, terminate_as_interrupt
from parallel_dcp.jobs.targets import Job, Target, prepare_io
from parallel_dcp.options import Options
from parallel_dcp.storage.protocol import WriteLocation

__all__ = ["run_job"]


def run_job(
    job: Job,
    target: Target,
    options: Options,
    governor: MemoryGovernor,
    *,
    start: float | None = None,
    before_tasks: Callable[[WriteLocation, int], None] | None = None,
) -> SaveResult:
    """See :func:`parallel_dcp.jobs.pipeline.run_job`; with ``options.distributed``, as one rank
    (``before_tasks`` then does not run)."""
    if options.resume:
        resume.refuse_unsupported(job, target, options)  # before anything is written
    options = prepare_io(target, options)  # io="direct" where O_DIRECT cannot be used fails here
    if options.distributed:
        with terminate_as_interrupt():
            return distributed.run_job(
                job, target, options, governor, start=time.perf_counter() if start is None else start
            )
    try:
        return pipeline.run_job(job, target, options, governor, start=start, before_tasks=before_tasks)
    except OSError as failure:
        explain_os_error(failure, target.path)
        raise


# What a bare errno says, and what to do: a full file system (of bytes, or of inodes where the
# byte check passed), or a process out of file descriptors. The message itself may name only a
# hidden temporary file.
_HINTS = {
    errno.ENOSPC: "the file system holding {where} is full (of bytes, or of inodes: see df -i)",
    errno.EDQUOT: "the disk quota of the file system holding {where} is used up",
    errno.EMFILE: "this process has too many open files: raise the limit (ulimit -n) or lower --workers",
    errno.ENFILE: "the system has too many open files: lower --workers, or retry when fewer are open",
}


def explain_os_error(failure: OSError, where: object) -> None:
    """Add a note to ``failure`` (a write to ``where`` that failed) saying what its errno means;
    the message itself may name only a hidden temporary file."""
    hint = _HINTS.get(failure.errno) if failure.errno is not None else None
    if hint is not None:
        failure.add_note(hint.format(where=where))
