"""What one process holds that a job can be charged for, read from ``/proc/<pid>/smaps``.

PSS splits a shared page among every process on the node that maps it, not only among the job's
own processes. Program code (torch's shared libraries: ~130 MiB resident in a process that has
imported torch) is mapped by every Python process using torch, so a process's PSS moves by tens of
MiB when an unrelated torch process starts or exits: measured, 329 MiB alone, 223 MiB beside four
other torch processes, 329 MiB again once they exit. A job's own memory did not change; a ceiling
counted in plain PSS would abort a job because a neighbour ended.

So the charge is PSS without the file-backed pages of program code: every mapping of a file that
this process maps executable somewhere (shared libraries, the interpreter), except the pages of
those mappings this process alone has dirtied (relocations, globals: its own memory). Everything
else counts as PSS: the heap and anonymous memory (shared only with the job's own forks), shared
memory, and any data file mapped in (a source read through mmap: its pages count once among the
job's processes that map it). What the charge leaves out is loading code, which every process
pays once and shares; not what a job's memory limit is about.

Reading ``smaps`` costs ~4-9 ms of CPU for a process that has imported torch (one text record
per mapping, hundreds of them; parsed in Python), ``smaps_rollup`` 0.6-1.5 ms (the kernel walks
every page table: 8 ms in a worker that inherited a 1 GiB state dict, most of it checking how many
processes map each shared page), ``/proc/<pid>/status`` and ``stat`` ~0.01 ms (counters the
kernel keeps). So :class:`ChargeReader` reads a process in full once, and then adds to that exact
charge only what no neighbour can move:

- anonymous and shared-memory pages (``Pss_Anon + Pss_Shmem`` from ``smaps_rollup``): anonymous
  pages are shared only with the process's own forks, whose starts and exits are the tree's own
  changes;
- file pages by their resident size (``RssFile`` growth, never below the exact reading): a data
  file mapped in (a source) is charged at most in full; a neighbour mapping or unmapping the same
  libraries moves PSS but not RSS.

Between two rollups of a process, its O(1) counters (``/proc/<pid>/stat`` minor faults, ``status``
RssAnon/RssShmem/RssFile) give an upper bound: the last rollup's charge plus its anonymous growth
since, plus every fault that added no resident page (an upper bound on pages copied on write),
with pages freed still charged. A reading rolls up at most one process in ``_ROLLUP_SHARE``
(those whose bound drifted most from the truth), so its cost stays a fraction of a rollup per
process however many of them allocated or freed since the last one.

Shares move between processes: when a process frees or copies a page it shared, or exits, the
other sharers' PSS grows while their counters stay still. The tree's sum stays an upper bound as
long as the releasing process is charged its bound; once its rollup lowers its charge, what it
gave up (no more than the drop, nor than what the others held of its pages and no longer do, as
two rollups tell it, each off by what the counters moved while it was read) is *carried*
(:attr:`ChargeReader.carried`) in every total until each other process has been rolled up since,
or read itself from a moment after the carry was seen (a report); not this reader's own process
where it shares no page (a Saver's coordinator: its workers are forked from the fork server).

A baseline (what a job subtracts from every later reading: a Saver's held processes) must never
be above the truth, or every reading after it under-counts: the counters' upper bound charged an
idle worker the buffers it had freed since its last rollup (a Saver's second save, 4 workers:
30-32 MiB over). A baseline reading (``plan(baseline=True)``) charges each process its counters'
lower bound (``LOWER``: the last rollup less what it may have freed since) where that is within
``_FAULT_SLACK`` of the upper, and reads it otherwise (rolled up, or in full where its file pages
moved: code and a data file's pages differ only in the full listing). Its workers' rollups come
from themselves: a Saver's pool asks each to read its own as a save ends (``own_charge.own_charge``, ~1.2 ms
of the worker's time while the coordinator commits), and learns them (:meth:`ChargeReader.learn`)
at the next baseline, which then reads only their counters. The reader's own process (the
coordinator, holding the state dict: a rollup of it walks every page, ~10 ms a GiB) is never rolled
up for a baseline: its anonymous memory is followed exactly from RssAnon where nothing of it is
shared, else it is *anchored* (``ChargeReader._anchor``): its counters' upper bound becomes its
charge and the job reads it from its counters alone, so that what it grew by since is what counts.

A reading is thus never below the exact charge by more than the counters' jitter (a few hundred
KiB a process), and above it by at most what the counters cannot tell apart (faults that were not
copies, pages freed, carried shares) until the next rollups settle it; before acting on a breach
the governor reads every process in full.

Longer than 300 lines because the charge model and its reader are one argument: the counters'
bound, the rollup budget and the carried shares are each safe only beside the others.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from parallel_dcp.engine.proc_reading import FAULT_SLACK as _FAULT_SLACK
from parallel_dcp.engine.proc_reading import PAGE as _PAGE
from parallel_dcp.engine.proc_reading import AnonymousPages, charged_memory, counter_drift
from parallel_dcp.engine.proc_reading import Counters as _Counters
from parallel_dcp.engine.proc_reading import exact_reading as _exact
from parallel_dcp.engine.proc_reading import read_counters as _counters
from parallel_dcp.engine.proc_reading import rollup_anon as _rollup_anon

__all__ = [
    "CHEAP",
    "FULL",
    "LOWER",
    "ROLLUP",
    "ChargeReader",
    "ChargeReport",
    "charged_memory",
]

# A process's exact charge is read again at least this often (seconds), one process per reading:
# the growth in RssFile (code paged in) it may have added is an over-count, never an under-count.
_CODE_REFRESH_S = 5.0
# A process whose counters show more than _FAULT_SLACK bytes of drift (faults that added no
# resident page, pages freed) since its last rollup is due one, and any process a second after it.
_ROLLUP_REFRESH_S = 1.0
# At most one process in _ROLLUP_SHARE (at least one) is rolled up or read in full per reading,
# besides processes never read before: a rollup walks every page table of the process (1.5 ms a
# torch process, 8 ms one that inherited a 1 GiB state dict), so rolling every process up when all
# of them allocated cost 1.5 ms a process a reading. The others are charged their counters' upper
# bound until their turn.
_ROLLUP_SHARE = 16
# ... and within a CPU credit of this many seconds a process a reading (rollup_budget).
_READ_CPU_S = 0.0005
_READ_CPU_MIN_S = 0.002  # a small tree: about one torch process's rollup a reading

CHEAP, ROLLUP, FULL = 0, 1, 2  # how a reading reads one process (ChargeReader.plan)
LOWER = 3  # ... a baseline's: the counters' lower bound (ChargeReader.plan, baseline=True)

# Forks of this process from Python (os.fork, multiprocessing's fork): after one, its anonymous
# pages may be shared with a child, and a charge that followed RssAnon alone would be too high.
_forks = [0]


def _count_fork() -> None:
    _forks[0] += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_parent=_count_fork)


@dataclass(frozen=True, slots=True)
class ChargeReport:
    """A process's own ``smaps_rollup`` (own_charge.own_charge), read by itself as it went idle,
    for its coordinator's :meth:`ChargeReader.learn`: ``rollup`` as ``_rollup_anon`` returns it,
    ``counters`` (RssAnon + RssShmem, RssFile, minor faults, RssShmem) read just before it, ``at`` when
    (``time.monotonic``: one clock for every process of the machine)."""

    at: float
    rollup: tuple[int, int, int]
    counters: tuple[int, int, int, int]
    exact: tuple[int, int] | None = None  # (charged, private) from its full smaps, where read
    # How far the rollup's shares held by others (resident less PSS) may be off: what the counters
    # moved by while it was read (proc_reading.counter_drift; None: unknown, a slack).
    jitter: int | None = None


def rollup_budget(processes: int) -> int:
    """How many of ``processes`` known processes one reading rolls up or reads in full, at most;
    fewer where their last rollups cost more CPU than the reader's credit (``_READ_CPU_S`` a
    process a reading, saved up while unused) holds."""
    return max(1, -(-processes // _ROLLUP_SHARE))


@dataclass(slots=True)
class _Known:
    exact: int  # the charge of the last full reading
    exact_anon: int  # Pss_Anon + Pss_Shmem then
    exact_file: int  # RssFile then
    at: float  # when
    charged: int  # the charge of the last rollup (or full reading)
    private: int
    counters: _Counters  # the counters then
    rolled_at: float
    rolled_anon: int  # Pss_Anon + Pss_Shmem then
    # Resident anonymous and shared-memory bytes less their PSS at the last rollup: what the other
    # sharers hold of the pages this process maps; None once a fork may have shared more.
    shared_away: int | None = None
    rolled_seq: int = 0  # the reading of the last rollup or full reading
    last: int = 0  # the last charge given
    cost: float = 0.0  # CPU seconds its last rollup took
    full_cost: float = 0.0  # and its last full reading
    forks: int = -1  # this process's fork count at its last rollup (the reader's own process only)
    given_up: int = 0  # the reader's _given_up at its last rollup
    anchored: bool = False  # ``charged`` is its counters' upper bound since (ChargeReader._anchor)
    # When the last reading it took of itself began (ChargeReader.learn): it counts every share
    # that had moved to it by then.
    reported_at: float = -math.inf
    jitter: int = _FAULT_SLACK  # how far ``shared_away`` may be off (:func:`_jitter`)


@dataclass(frozen=True, slots=True)
class _Carry:
    """Bytes of PSS that may have moved from ``source`` to processes not rolled up since reading
    ``seq`` (``source`` freed or copied shared pages, or exited): counted until each has been, or
    has read itself (a report) from a moment after ``at``, when the move had been seen (an exit
    seen by its absence: never by a report, as the process may not have ended yet)."""

    amount: int
    seq: int
    source: int
    at: float = math.inf

    def waits_on(self, known: _Known) -> bool:
        """Whether the process ``known`` may not count this carry's shares yet (asked only of the
        processes a share may move to: ChargeReader._sharing)."""
        return known.rolled_seq <= self.seq and known.reported_at <= self.at


class ChargeReader:
    """The charges of a process tree, read cheaply and repeatedly (module docstring).

    :meth:`plan` says how a reading reads each process: in full (``FULL``) a process never read in
    full, or all of them when the caller asks for an exact reading (before acting on a breach);
    otherwise ``CHEAP`` (the counters' upper bound, :meth:`charge`) except for at most
    :func:`rollup_budget` processes: ``ROLLUP`` those whose counters drifted most, or that a carry
    waits on, or a second after their last rollup, and ``FULL`` the stalest full reading once older
    than ``_CODE_REFRESH_S``. :meth:`charge` reads one process (thread-safe for distinct pids: the
    reads release the GIL in the kernel); :attr:`carried` is what the tree may hold beyond the sum
    of the charges (shares moved from a process to others not read since), part of every total.
    """

    def __init__(self) -> None:
        self._known: dict[int, _Known] = {}
        self._members: frozenset[int] = frozenset()
        self._counters: dict[int, _Counters] = {}  # read by plan, for this reading's charges
        self._carries: list[_Carry] = []
        self._credit = 0.0  # CPU seconds the next readings may spend on rollups (_plan)
        # Bytes of their sharers' parts the processes gave up (pages shared, then freed or copied)
        # over all rollups, reports and readings: a sharer's charge grew by up to as much.
        self._given_up = 0
        # This process, where its baseline was its counters' upper bound (_baseline_plan): read
        # from its counters alone until the next baseline.
        self._anchored: set[int] = set()
        # Each process's anonymous pages as its last full reading found them (who grew, when a
        # breach is confirmed by an exact reading: engine/breach.py).
        self.anonymous: dict[int, AnonymousPages] = {}
        self.full_reads = 0  # how many processes were read in full, over all readings
        self.rollups = 0  # how many were rolled up (counted by charge)
        self.readings = 0

    @property
    def carried(self) -> int:
        """Bytes the tree may hold beyond the sum of its charges (see :class:`_Carry`), as of the
        charges read so far."""
        self._expire()
        return sum(carry.amount for carry in self._carries)

    def _expire(self) -> None:
        """Drop the carries every process but their source has been rolled up (or read) since."""
        if not self._carries:
            return
        sharing = self._sharing()
        self._carries = [
            carry
            for carry in self._carries
            if any(
                carry.waits_on(known)
                for pid, known in sharing.items()
                if pid != carry.source and pid not in self._anchored
            )
        ]

    def _sharing(self) -> dict[int, _Known]:
        """The known processes a share may move to: all but this reader's own where it shares no
        page (nothing of it was shared at its last rollup, it has not forked since, and its shared
        memory is as it was: only a fork or a shared mapping makes a page shared; see _lower).
        The coordinator of a Saver, whose workers are forked from the fork server, is such."""
        me = os.getpid()
        known = self._known.get(me)
        if known is None or known.shared_away != 0 or known.forks != _forks[0]:
            return self._known
        counters = self._counters.get(me) or _counters(me)
        if counters is None or counters.shmem != known.counters.shmem:
            return self._known
        return {pid: each for pid, each in self._known.items() if pid != me}

    def plan(
        self, pids: Sequence[int], *, exact: bool = False, baseline: bool = False, shared: Sequence[int] = ()
    ) -> list[int]:
        """For each of ``pids``: how this reading reads it (``CHEAP``, ``ROLLUP`` or ``FULL``;
        ``LOWER`` for a ``baseline``: :meth:`_baseline_plan`, where ``shared`` are the processes
        whose pages the others share)."""
        now = time.monotonic()
        members = frozenset(pids)
        self.readings += 1
        self._counters = {}
        for pid in self._members - members:  # exited: its shares of pages others map move to them
            gone = self._known.pop(pid, None)
            if gone is not None and gone.last:
                away = gone.last if gone.shared_away is None else min(gone.last, gone.shared_away + _FAULT_SLACK)
                self._carries.append(_Carry(away, self.readings, pid))
        self._known = {pid: known for pid, known in self._known.items() if pid in members}
        self.anonymous = {pid: pages for pid, pages in self.anonymous.items() if pid in members}
        if self._members and members - self._members:  # a fork: pages newly shared with the child
            for known in self._known.values():
                known.shared_away = None
            self._given_up += 1 << 62  # what moved since is unknown: every sharer is read again
        self._members = members
        if exact:
            self._carries = []  # every process is read in full: nothing moved unseen
            plan = [CHEAP if pid in self._anchored else FULL for pid in pids]
        elif baseline:
            plan = self._baseline_plan(pids, shared)
        else:
            plan = self._plan(pids, now)
        self.full_reads += plan.count(FULL)
        return plan

    def _plan(self, pids: Sequence[int], now: float) -> list[int]:
        self._expire()
        plan = [CHEAP if pid in self._known else FULL for pid in pids]
        waiting: dict[int, int] = {}  # pid -> bytes of carries waiting on its rollup
        sharing = self._sharing() if self._carries else {}
        for carry in self._carries:
            for pid, known in sharing.items():
                if pid != carry.source and carry.waits_on(known) and pid not in self._anchored:
                    waiting[pid] = waiting.get(pid, 0) + carry.amount
        # Candidates, most useful first: those whose bound drifted (or that a carry waits on), by
        # the bytes a rollup would settle; then the stalest full reading once due; then by age.
        due: list[tuple[int, float, int, int]] = []  # (tier, order, index, how)
        stalest: tuple[float, int] | None = None
        for i, pid in enumerate(pids):
            entry = self._known.get(pid)
            if entry is None:
                continue
            counters = _counters(pid)
            if counters is None:
                continue
            self._counters[pid] = counters
            if pid in self._anchored:
                continue
            drift = _drift(entry, counters) + waiting.get(pid, 0)
            if drift > _FAULT_SLACK:
                due.append((0, -drift, i, ROLLUP))
            elif now - entry.rolled_at >= _ROLLUP_REFRESH_S:
                due.append((2, entry.rolled_at, i, ROLLUP))
            if stalest is None or entry.at < stalest[0]:
                stalest = (entry.at, i)
        if stalest is not None and now - stalest[0] >= _CODE_REFRESH_S and FULL not in plan:
            due.append((1, stalest[0], stalest[1], FULL))
        # Within a count (one process in _ROLLUP_SHARE) and a CPU credit (_READ_CPU_S a process a
        # reading, saved up while unused): a rollup of a worker that inherited a large state dict
        # costs 10-20 ms, more than one in 16 of them may take at every reading.
        credit_per_reading = max(_READ_CPU_MIN_S, _READ_CPU_S * len(self._known))
        dearest = max((max(known.cost, known.full_cost) for known in self._known.values()), default=0.0)
        self._credit = min(self._credit + credit_per_reading, 4 * credit_per_reading + dearest)
        budget = rollup_budget(len(self._known))
        for _, _, i, how in sorted(due):
            if budget <= 0 or plan[i] != CHEAP:
                continue
            entry = self._known[pids[i]]
            cost = entry.full_cost if how == FULL else entry.cost
            if cost > self._credit:
                break  # not yet: the credit builds up for it, the others wait their turn
            self._credit -= cost
            plan[i] = how
            budget -= 1
        return plan

    def _baseline_plan(self, pids: Sequence[int], shared: Sequence[int]) -> list[int]:
        """A baseline: what a job subtracts from every later reading, so it must never be above
        the truth. The counters' upper bound is: a worker that freed its task's buffers since
        its last rollup is charged them still (a Saver's baseline at 8 workers that had each
        freed 8 MiB: 64 MiB over, an under-count of the whole save once they were rolled up).
        So each known process is charged its counters' lower bound (``LOWER``) where that is
        within ``_FAULT_SLACK`` of the upper, and rolled up otherwise (and where a carry waits
        on it); read in full where its file pages moved by more since its last full reading (code
        paged in, or a data file's pages: only the full listing tells, and a baseline that took
        code for data would be undone by the next full reading: 7.5 MiB a worker after a Saver's
        first save), or it never was. A process whose pages the others share (a Saver's fork
        server: ``shared``) grows as they copy or free those pages, with nothing of its own
        moving (4.6 MiB after 4 workers' first save): rolled up once they gave up more since its
        last rollup than a slack a process of the reading (each of them gave up less than a slack,
        or its rollup carried it; so it is as loose as the others, and no looser over many saves)."""
        self._anchored = set()
        me = os.getpid()
        allowance = _FAULT_SLACK * len(pids)
        sharing = self._sharing() if self._carries else {}
        waiting = {
            pid for pid in shared if pid in self._known and self._given_up - self._known[pid].given_up > allowance
        } | {
            pid
            for carry in self._carries
            for pid, known in sharing.items()
            if pid != carry.source and carry.waits_on(known)
        }
        plan: list[int] = []
        for pid in pids:
            known = self._known.get(pid)
            counters = _counters(pid) if known is not None else None
            if known is None or counters is None:
                plan.append(FULL)
                continue
            self._counters[pid] = counters
            moved = abs(counters.file - known.exact_file) > _FAULT_SLACK
            loose = moved or pid in waiting or known.anchored or _lower(known, counters, pid)[1] > _FAULT_SLACK
            if loose and pid == me:
                self._anchor(known, counters)
                plan.append(CHEAP)
            elif moved:
                plan.append(FULL)
            else:
                plan.append(ROLLUP if loose else LOWER)
        return plan

    def _anchor(self, known: _Known, counters: _Counters) -> None:
        """This process, where its counters moved since its last rollup (a training step between
        two saves): a rollup walks every page it maps (~10 ms a GiB here: 40 ms a save holding a
        4 GiB state dict). Its counters' upper bound instead, made its charge as of now, and the
        job reads it from those counters alone (never rolled up or read in full, even to confirm
        a breach): every reading then charges it what it grew by since the baseline, at most, as
        the baseline's own value cancels out; only a rollup, taking a value the baseline did not
        use, could under-count it. (A Saver's workers share nothing with this process.)"""
        charged, private = _bound(known, counters)
        known.charged, known.private, known.counters, known.anchored = charged, private, counters, True
        self._anchored.add(os.getpid())

    def learn(self, pid: int, report: ChargeReport) -> None:
        """Take ``pid``'s own rollup (own_charge.own_charge) as if this reader had rolled it up then;
        ignored where this reader has read it more recently, or never in full (its code share
        unknown). It settles the carries seen before it began (the shares had moved to it by
        then); later ones keep waiting (it may predate what they moved)."""
        known = self._known.get(pid)
        if known is None or report.at <= known.rolled_at:
            return
        counters = _Counters(*report.counters)
        jitter = _FAULT_SLACK if report.jitter is None else report.jitter
        if report.exact is not None:
            self._known[pid] = _Known(
                report.exact[0],
                report.rollup[0],
                counters.file,
                report.at,
                report.exact[0],
                report.exact[1],
                counters,
                report.at,
                report.rollup[0],
                _shared_away(report.rollup, counters),
                known.rolled_seq,
                report.exact[0],
                known.cost,
                known.full_cost,
                -1,
                known.given_up,
                reported_at=report.at,
                jitter=jitter,
            )
            if known.shared_away is not None:
                self._given_up += max(0, known.shared_away - _shared_away(report.rollup, counters))
            return
        seq = known.rolled_seq
        self._take_rollup(pid, known, report.rollup, counters, _bound(known, counters)[0], report.at, jitter)
        known.rolled_seq, known.reported_at = seq, report.at

    def _take_rollup(
        self,
        pid: int,
        known: _Known,
        rollup: tuple[int, int, int],
        counters: _Counters,
        bound: int,
        at: float,
        jitter: int,
    ) -> tuple[int, int]:
        """Record a rollup of ``pid`` read at ``counters``; ``bound``: its counters' upper bound
        there, before it; ``jitter``: how far its shares held by others may be off (:func:`_jitter`).
        (charged, private) as the rollup gives them."""
        anon, private, _ = rollup
        charged = max(0, known.exact + anon - known.exact_anon + max(0, counters.file - known.exact_file))
        shared_away = _shared_away(rollup, counters)
        # Shares this process gave up (pages freed or copied on write) went to the other
        # sharers, whose charges do not show it until their own rollup: carried till then.
        # No more than the bound's excess over this rollup, nor than what the others held
        # of its pages and no longer do (as the two rollups tell it, each off by its jitter: an
        # idle worker's own report, a few KiB; a slack where not measured).
        moved = max(0, bound - charged)
        if known.shared_away is not None:
            self._given_up += max(0, known.shared_away - shared_away)
            moved = min(moved, max(0, known.shared_away - shared_away) + known.jitter + jitter)
        if moved > _FAULT_SLACK:
            self._carries.append(_Carry(moved, self.readings, pid, time.monotonic()))
        known.charged, known.private, known.counters = charged, private, counters
        known.rolled_at, known.rolled_anon = at, anon
        known.shared_away, known.rolled_seq, known.last = shared_away, self.readings, charged
        known.forks = _forks[0] if pid == os.getpid() else -1
        known.given_up = self._given_up
        known.anchored, known.jitter = False, jitter
        return charged, private

    def charge(self, pid: int, how: int) -> tuple[int, int]:
        """(charged, private) bytes of ``pid``, read as ``how`` says (:meth:`plan`); (0, 0) once
        it is gone. Exact where the kernel offers no rollup or the process was never read in full."""
        known = self._known.get(pid)
        if how != FULL and known is not None:
            counters = self._counters.pop(pid, None) or _counters(pid)
            if counters is None:
                return 0, 0
            bound = _bound(known, counters)
            if how in (CHEAP, LOWER):
                known.last = bound[0]  # (what its exit may hand to the others: the most it holds)
                return bound if how == CHEAP else (_lower(known, counters, pid)[0], known.private)
            started = time.thread_time()
            rollup = _rollup_anon(pid)
            if rollup is not None:
                known.cost = time.thread_time() - started
                self.rollups += 1
                jitter = _jitter(counters, _counters(pid))
                return self._take_rollup(pid, known, rollup, counters, bound[0], time.monotonic(), jitter)
        return self._full(pid)

    def _full(self, pid: int) -> tuple[int, int]:
        started = time.thread_time()
        counters = _counters(pid)
        rollup = _rollup_anon(pid)
        after = _counters(pid)
        rolled = time.thread_time()
        charged, private, pss, pages = _exact(pid)
        done = time.thread_time()
        if pages is None:
            self.anonymous.pop(pid, None)
        else:
            self.anonymous[pid] = pages
        if counters is None or not (pss or private):
            self._known.pop(pid, None)
            return charged, private
        if rollup is not None:
            now = time.monotonic()
            anon = rollup[0]
            self._known[pid] = _Known(
                charged,
                anon,
                counters.file,
                now,
                charged,
                private,
                counters,
                now,
                anon,
                _shared_away(rollup, counters),
                self.readings,
                charged,
                rolled - started,
                done - started,
                _forks[0] if pid == os.getpid() else -1,
                self._given_up,
                jitter=_jitter(counters, after),
            )
        return charged, private


def _jitter(before: _Counters | None, after: _Counters | None) -> int:
    """What a rollup read between the counters ``before`` and ``after`` may be off by
    (proc_reading.counter_drift), a slack where it cannot be told."""
    drift = counter_drift(before, after)
    return _FAULT_SLACK if drift is None else drift


def _shared_away(rollup: tuple[int, int, int], counters: _Counters) -> int:
    """What the other sharers hold of this process's anonymous and shared-memory pages: resident
    size less PSS (a page mapped by k processes: k-1 of k parts elsewhere, at least its own 1/k).
    The anonymous part from the rollup itself; shared memory's resident size only from the
    counters (``RssAnon + RssShmem`` less the rollup's anonymous PSS and ``shared``, an upper
    bound of the shared-memory part)."""
    anon, _, shared = rollup
    return max(shared, counters.anon - anon)


def _drift(known: _Known, now: _Counters) -> int:
    """Bytes by which the counters' bound may exceed a rollup: faults that added no resident page
    (counted as copies on write) and pages freed (still charged) since the last rollup."""
    then = known.counters
    grown = now.anon - then.anon
    faults = max(0, now.faults - then.faults) * _PAGE
    return max(0, faults - max(0, grown)) + max(0, -grown)


def _lower(known: _Known, now: _Counters, pid: int) -> tuple[int, int]:
    """Bytes the process is charged at least, from the counters alone: the last rollup less what
    it may have freed since (a page freed takes at most its whole size off its charge; pages it
    gained, and shares that moved to it, only add). What it freed is at most its net loss plus
    every page a fault added since. Exact in anonymous memory for this reader's own process where
    nothing of it was shared at the rollup, it has not forked since and its shared memory did not
    change: every anonymous page it gained since is its own, and every one it lost was.

    Returns (the lower bound, how far below the charge it may be)."""
    then = known.counters
    files = max(0, then.file - now.file)
    if pid == os.getpid() and known.shared_away == 0 and known.forks == _forks[0] and now.shmem == then.shmem:
        # only the file pages are unknown: code paged in or out, or a data file's
        return max(0, known.charged + now.anon - then.anon - files), abs(now.file - then.file)
    freed = max(0, then.anon - now.anon) + max(0, now.faults - then.faults) * _PAGE
    lower = max(0, known.charged - freed - files)
    return lower, _bound(known, now)[0] - lower


def _bound(known: _Known, now: _Counters) -> tuple[int, int]:
    """(charged, private) bytes from the counters alone, never below a rollup's: the last rollup
    plus anonymous growth since, plus every fault that added no resident page (an upper bound on
    pages copied on write), plus file growth; pages freed still count (they may have been shared:
    their share moved to a sibling whose counters do not show it)."""
    then = known.counters
    grown = max(0, now.anon - then.anon)
    copied = max(0, (now.faults - then.faults) * _PAGE - grown)
    files = max(0, now.file - known.exact_file) - max(0, then.file - known.exact_file)
    return known.charged + grown + copied + files, known.private + grown + copied
