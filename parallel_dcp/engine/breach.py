"""Who pushed a job over its memory ceiling, said in the :class:`MemoryLimitExceeded` the watchdog
raises once a second, exact reading confirmed the breach.

The ceiling counts the whole tree: the coordinator (the caller's own process, with every thread
the caller runs beside the job) and the workers. The one named is the process that grew the most
since the job's baseline, not always a worker: a thread of the caller that allocated 700 MiB
during a save was blamed on the worker with the most private memory (20 MiB).

How far each process grew (:func:`growth`) is not how far its charge (PSS) moved: a worker forked
during the job takes half of every page it shares with the coordinator, whose charge drops by as
much (a worker holding 8 MiB of its own was charged 105 MiB, in a caller of 200 MiB). Nor is a
forked worker's private memory all its own: a page it inherited becomes private to it when the
coordinator frees its own mapping of it (a large tensor the caller drops, or garbage collected
mid-job) or writes to it (the coordinator's copy is then a new page), without the worker
allocating anything; a caller that freed 100 MiB and then allocated 192 MiB was reported as
"worker 0 ... grew by 107.7 MiB". So:

- a process held from before the job (a ``Saver``'s workers and fork server): its charge now less
  its charge in the baseline;
- a worker forked during the job, read at its start (:meth:`JobStart.forked`: its ``RssAnon`` then
  is what it inherited, and the coordinator's frees do not lower it): its private memory, less
  the inherited anonymous pages it now maps alone (its private anonymous pages beyond the growth of
  its ``RssAnon``) as far as the coordinator can have let them go;
- the coordinator: its anonymous resident memory (``RssAnon + RssShmem``, which sharing does not
  move) now less when the job started, plus those pages. What it can have let go since the start
  (freed, or copied by writing to a shared page) is at most its minor faults since then (one for
  each page it allocated or copied; one for each huge page) less the growth of its anonymous
  memory: a quiet caller is never charged the pages a worker copied itself (8-30 MiB of Python
  objects a worker, measured), a caller that freed what its worker still maps always is.

The parts add up to the total (the ceiling's charge) as closely as before; only who is named, and
the split, changed. Not told apart (open): pages the coordinator lets go while two or more workers
still map them stay shared among those workers (counted in their charges, in nobody's growth); and
where the coordinator's faults leave room for them (a caller that allocated and freed much since
the start), the copies a busy worker made of its inherited pages count to the coordinator.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from parallel_dcp.engine.proc_reading import PAGE, AnonymousPages, Counters, read_counters
from parallel_dcp.engine.sizes import format_bytes
from parallel_dcp.errors import MemoryLimitExceeded, describe_keys

__all__ = ["JobStart", "anonymous_bytes", "breach_error", "growth"]


def anonymous_bytes(pid: int) -> int:
    """``RssAnon + RssShmem`` of ``pid`` (0 when it cannot be read)."""
    counters = read_counters(pid)
    return 0 if counters is None else counters.anon


@dataclass(slots=True)
class JobStart:
    """What :func:`growth` keeps from a job's start: the coordinator's counters at the baseline
    (None where not read), and each worker's ``RssAnon`` at its start (pid -> bytes)."""

    coordinator: int
    counters: Counters | None = None
    born: dict[int, int] = field(default_factory=dict)

    @classmethod
    def read(cls, coordinator: int) -> JobStart:
        """The start of a job whose coordinator is ``coordinator``, read now (its counters: ~0.03 ms)."""
        return cls(coordinator, read_counters(coordinator))

    def forked(self, pids: Iterable[int]) -> None:
        """Workers just started (or first seen by the job): what each maps of anonymous memory now
        is what it inherited (~0.03 ms a worker; read once)."""
        for pid in pids:
            if pid not in self.born:
                counters = read_counters(pid)
                if counters is not None:
                    self.born[pid] = counters.anon - counters.shmem


def growth(
    charged: Mapping[int, int],
    started: Mapping[int, int],
    private: Mapping[int, int],
    start: JobStart,
    now: Counters | None,
    anonymous: Mapping[int, AnonymousPages],
) -> dict[int, int]:
    """How far each process in ``charged`` (pid -> its charge now) grew since the job's start (see
    the module docstring): ``started`` (pid -> its charge in the baseline, for the processes held
    from before it), ``private`` (each worker's private bytes now), ``now`` the coordinator's
    counters read with the reading of ``charged`` (read later, a caller's thread still allocating
    would show more than the reading holds: the parts of the message would exceed its total), and
    ``anonymous`` each process's anonymous pages from that reading (an exact one)."""
    me = start.coordinator
    grown: dict[int, int] = {}
    left: dict[int, int] = {}  # worker -> inherited anonymous bytes it now maps alone
    for pid, charge in charged.items():
        if pid == me:
            continue
        if pid in started:
            grown[pid] = charge - started[pid]
            continue
        grown[pid] = private.get(pid, 0)
        pages, born = anonymous.get(pid), start.born.get(pid)
        if pages is not None and born is not None:
            added = min(pages.private, max(0, pages.resident - born))  # its RssAnon's growth: all private
            left[pid] = max(0, min(grown[pid], pages.private - added))
    then = start.counters
    if then is None or now is None:
        anon_grew = released = 0
    else:
        anon_grew = now.anon - then.anon
        huge = anonymous[me].huge if me in anonymous else 0
        released = max(0, (now.faults - then.faults) * PAGE + huge - anon_grew)
    inherited = sum(left.values())
    given = min(inherited, released)
    for pid, alone in left.items():
        grown[pid] -= alone * given // inherited
    if me in charged:
        grown[me] = anon_grew + given
    return grown


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
