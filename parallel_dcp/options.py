"""The one validated set of options a job runs with; the API and the CLI only fill it in."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Options", "usable_cores"]


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), not the machine's total."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """Options of one save or load.

    Attributes:
        workers: worker processes; None means every usable core.
        overwrite: replace an existing checkpoint (atomically) instead of refusing.
        progress: show a progress bar on stderr.
        sync_files: fsync every shard and ``.metadata`` before the commit (as stock DCP does).
        crc32: compute the per-record CRC32 of ``torch.save`` zip records. No DCP reader checks
            it and it costs most of a save's time, so it is off; stock readers load either way.
    """

    workers: int | None = None
    overwrite: bool = False
    progress: bool = False
    sync_files: bool = True
    crc32: bool = False

    def __post_init__(self) -> None:
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)):
            raise TypeError(f"workers must be an int or None, got {self.workers!r}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")

    def worker_count(self, tasks: int) -> int:
        """Workers to start for ``tasks`` tasks: never more than there are tasks."""
        wanted = self.workers if self.workers is not None else usable_cores()
        return max(1, min(wanted, tasks))
