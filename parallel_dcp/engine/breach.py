"""Who pushed a job over its memory ceiling, said in the :class:`MemoryLimitExceeded` the watchdog
raises once a second, exact reading confirmed the breach.

The ceiling counts the whole tree: the coordinator (the caller's own process, with every thread
the caller runs beside the job) and the workers. The one named is the process that grew the most
since the job's baseline, not always a worker: a thread of the caller that allocated 700 MiB
during a save was blamed on the worker with the most private memory (20 MiB).

How far each process grew (:func:`growth`) is not how far its charge (PSS) moved: a worker forked
during the job takes half of every page it shares with the coordinator, whose charge drops by as
much (a worker holding 8 MiB of its own was charged 105 MiB, in a caller of 200 MiB). So:

- the coordinator: its anonymous resident memory (``RssAnon + RssShmem``, which sharing does not
  move) now less when the job started;
- a worker forked during the job: its private memory (all of it is the job's);
- a process held from before the job (a ``Saver``'s workers and fork server): its charge now less
  its charge in the baseline.

Not told apart (open): pages a worker forked from the caller still maps, which the caller frees
while the job runs (a large tensor it drops), become that worker's private memory without the
worker allocating anything, and leave the caller's anonymous memory; a caller that frees 100 MiB
and then allocates 192 MiB mid-job is reported as a worker that grew by ~109 MiB. The total (the
ceiling's charge) is right; only the name in the message is not.
"""

from __future__ import annotations

from collections.abc import Mapping

from parallel_dcp.engine.proc_reading import read_counters
from parallel_dcp.engine.sizes import format_bytes
from parallel_dcp.errors import MemoryLimitExceeded, describe_keys

__all__ = ["anonymous_bytes", "breach_error", "growth"]


def anonymous_bytes(pid: int) -> int:
    """``RssAnon + RssShmem`` of ``pid`` (0 when it cannot be read)."""
    counters = read_counters(pid)
    return 0 if counters is None else counters.anon


def growth(
    charged: Mapping[int, int],
    started: Mapping[int, int],
    private: Mapping[int, int],
    coordinator: int,
    anon: int,
    anon_now: int,
) -> dict[int, int]:
    """How far each process in ``charged`` (pid -> its charge now) grew since the job's baseline:
    ``started`` (pid -> its charge then), ``private`` (each worker's private bytes now), and
    ``anon``, the coordinator's anonymous memory then, ``anon_now`` the same read with the reading
    of ``charged`` (read later, a caller's thread still allocating would show more than the
    reading holds: the parts of the message would exceed its total)."""
    return {
        pid: anon_now - anon if pid == coordinator else now - started[pid] if pid in started else private.get(pid, 0)
        for pid, now in charged.items()
    }


def breach_error(
    *,
    added: int,
    limit: int,
    grown: Mapping[int, int],
    coordinator: int,
    workers: Mapping[int, tuple[int, tuple[str, ...]]],
    private: Mapping[int, int],
    phase: str,
    units: str,
) -> MemoryLimitExceeded:
    """The error for a confirmed breach of ``limit`` (the job at ``added`` bytes).

    Args:
        grown: pid -> how far its charge grew since the job's baseline, for every process read.
        coordinator: this process's pid.
        workers: pid -> (worker number, keys of its running task) for every live worker.
        private: pid -> private bytes of each worker (the culprit where no growth is known).
        phase, units: what the tasks do, and what they do it to, for the message (``"writing"``,
            ``"keys"``)
    """
    pid = max(grown, key=lambda p: grown[p]) if grown else coordinator
    if pid not in workers and pid != coordinator and private:
        pid = max(private, key=lambda p: private[p])  # a held process that is no worker: not expected
    over = f"pushed the job to {format_bytes(added)}, over the memory limit {format_bytes(limit)}"
    if pid == coordinator:
        others = sum(g for p, g in grown.items() if p != coordinator)
        return MemoryLimitExceeded(
            f"this process (pid {pid}: the caller, where the job's coordinator runs) {over}: its own memory grew by "
            f"{format_bytes(grown.get(pid, 0))} since the job started, the workers' by {format_bytes(others)}, "
            f"while they were {phase} {units}; they were stopped and nothing was committed. The limit counts what the "
            "caller's own threads allocate while the job runs: allocate less meanwhile, or raise --memory-limit",
            limit=limit,
            measured=added,
            keys=[],
        )
    worker, keys = workers[pid]
    return MemoryLimitExceeded(
        f"worker {worker} (pid {pid}) {over}, while {phase} {units} {describe_keys(keys)} (its memory grew by "
        f"{format_bytes(grown.get(pid, 0))} since the job started, its private memory: "
        f"{format_bytes(private.get(pid, 0))}); it was stopped and nothing was committed. "
        "Raise --memory-limit or lower --workers",
        limit=limit,
        measured=added,
        keys=keys,
        worker=worker,
    )
