"""``save``: an in-memory state dict, written as a DCP checkpoint by the pipeline."""

from __future__ import annotations

import os
import time
from typing import Any

from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.engine.pool import gc_paused
from parallel_dcp.engine.prompt_gil import prompt_gil
from parallel_dcp.formats.memory_format import MemorySource
from parallel_dcp.jobs import shared_workers
from parallel_dcp.jobs.pipeline import SaveResult
from parallel_dcp.jobs.runner import run_job
from parallel_dcp.jobs.targets import DcpTarget, Job
from parallel_dcp.options import Options

__all__ = ["save"]


def save(state_dict: Any, path: str | os.PathLike[str], options: Options) -> SaveResult:
    """Save an in-memory state dict as DCP; see :func:`parallel_dcp.save` for the contract."""
    if shared_workers.eligible(state_dict, options):  # large: on kept workers, outside this interpreter
        result = shared_workers.save(state_dict, path, options)
        if result is not None:
            return result
    start = time.perf_counter()
    target = DcpTarget(path, options.storage_options, compression=options.compression())
    governor = MemoryGovernor(options.memory_ceiling())
    with gc_paused():  # flattening 50,000 keys; see gc_paused
        source = MemorySource(str(path), state_dict=state_dict)
        job = Job(source, source.keys())
    # The coordinator (this thread) wakes for each worker's result and each watchdog reading; beside
    # a busy Python thread of the caller each wake-up would wait out the 5 ms switch interval.
    with prompt_gil():
        return run_job(job, target, options, governor, start=start)
