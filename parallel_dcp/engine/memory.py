"""The memory governor: a hard ceiling on what a job adds to its process tree's physical memory.

What is counted: the proportional set size (PSS) of the coordinator plus every worker, minus the
coordinator's when the job started, without program code (``process_memory``: shared libraries
are shared with every other torch process on the node, so their share moves when a neighbour
starts or exits). PSS splits each shared page among the processes that map it, so the pages
workers inherit from the coordinator by ``fork`` (an in-memory state dict) are counted once, as
they occupy RAM once, and what a worker copies, buffers or maps in on its own is counted in full.
Page cache and files written to tmpfs are not process memory and are not counted: they are the
output, and the kernel accounts for them separately.

Two mechanisms enforce the ceiling:

- admission (before any write): every task has an estimated peak (``Task.memory``); a task runs
  only when its estimate fits beside those in flight under the ceiling, less what the workers
  keep between tasks (planned from each fork on, ``WORKER_MEMORY_BYTES``); an item that can
  never fit fails at once, naming the key.
- a watchdog (while workers run): every 50 ms the resident sizes (cheap) are summed; while that
  upper bound is under the ceiling, the tree's charges are read only about once a second, for the
  reported peak. Otherwise they are read every 50 ms, or less often where reading a large tree
  costs more than 5% of a core. A reading costs ~0.01-0.05 ms of CPU a process whose counters did
  not move; where they did, their upper bound, and a ``smaps_rollup`` for at most one process in
  16 within a CPU credit of 0.5 ms a process a reading (0.25 ms a process at 64 workers that all
  allocated), on top of each process's exact charge read in full once
  (process_memory.ChargeReader); a reading over
  the ceiling is measured again, exactly (every full smaps), before acting, and then the job
  fails with :class:`MemoryLimitExceeded` naming the process that grew the most (a worker and its
  keys, or the caller's own process: engine/breach.py) and the figures; its workers are killed.

Longer than 300 lines because the whole memory model sits together on purpose: cost constants,
worker arithmetic, admission and the watchdog.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import psutil

from parallel_dcp.engine.breach import JobStart, breach_error, growth
from parallel_dcp.engine.proc_reading import read_counters
from parallel_dcp.engine.process_memory import FULL, ROLLUP, ChargeReader
from parallel_dcp.engine.resident import ResidentSizes
from parallel_dcp.engine.sizes import format_at_least, format_bytes, parse_size
from parallel_dcp.errors import MemoryLimitExceeded, describe_keys, describe_unit

__all__ = [
    "COORDINATOR_RUN_BYTES",
    "DEFAULT_FRACTION",
    "ITEM_MEMORY_BYTES",
    "LEAN_TASK_MEMORY_BYTES",
    "PLAN_UNIT_BYTES",
    "TASK_MEMORY_BYTES",
    "WORKER_MEMORY_BYTES",
    "ZSTD_DECOMPRESS_BYTES",
    "ZSTD_MAX_WINDOW_BYTES",
    "ZSTD_SMALL_RECORD_BYTES",
    "ZSTD_VALUE_MAX_BYTES",
    "MemoryGovernor",
    "affordable_workers",
    "default_limit",
    "format_bytes",
    "parse_size",
    "task_budget",
    "warn_over_machine",
    "zstd_compress_bytes",
]

# What a worker's memory grows by while it runs a task, beyond the items' own buffers: the DCP
# planner, writer and zip buffers, and ~9-13 KiB per item for its plan, metadata and write result.
# Measured as the governor counts (process_memory: without program code; torch 2.13): a worker
# running a task of small tensors at 7-8 MiB with its resting cost below (2 and 4 workers). With
# workers planned at their resting cost (WORKER_MEMORY_BYTES, 10 MiB), the dry-run prediction is
# an upper bound of the measured peak: a two-worker save 154 MiB against 109-146 measured (+6%), a
# safetensors -> DCP conversion under 160 MiB 149 against 115-129 (+16%), a one-worker DCP ->
# torch.save conversion 113 against 73-105 (+8%). These figures are both admission's and a
# dry run's prediction (tests/test_dryrun.py compares the latter with the measured peak):
# rounding them far up would make the prediction a fiction, rounding them down would let
# admission overcommit; the watchdog measures twice before it acts on a breach.
TASK_MEMORY_BYTES = 8 * 1024 * 1024
# The same for a DCP task on the lean path (formats/lean.py: no DCP planner, records written from
# templates): a 1-worker save of small contiguous tensors peaked at 4-6 MiB, its worker included.
LEAN_TASK_MEMORY_BYTES = 3 * 1024 * 1024
# What a worker adds for the whole job, planned from its fork on: its resting cost once it has run
# a task (the pages its start-up and first task copy from the coordinator or allocate and keep: the
# interpreter's and torch's heaps, the DCP modules' state; page tables are not counted). Right after
# the fork a worker adds ~0.1 MiB, so a figure measured then (see MemoryGovernor.settle) would
# under-count every later task by what the worker keeps. Measured as the governor counts, at rest
# after a job on two workers, the tree's growth per worker (the coordinator's own included): save
# 4.8-6.0 MiB, lean save 4.0-5.5, safetensors -> DCP 4.7-5.8, DCP -> DCP 6.3-8.3, DCP ->
# safetensors 5.5-5.8 (one worker), FP8 dequantize 4.7-5.2, verify 1.9-2.3
# (tests/test_worker_resting_memory.py measures every kind against this figure).
WORKER_MEMORY_BYTES = 10 * 1024 * 1024
ITEM_MEMORY_BYTES = 16 * 1024
# What the coordinator itself grows by while a job's workers run under the limit, set aside once a
# job (MemoryGovernor.hold_coordinator) before planning, so admission, the advised minimum and the
# dry run count it alike: the pool's pipes and threads, the watchdog, the workers' results and the
# plan. Every job that runs workers holds it: save, convert, verify, diff, load with workers.
# Measured as RssAnon of the coordinator from the fork to the commit: +1.7 MiB (a save),
# +2.0-2.9 (MXFP4 dequantize), +1.7 (FP8). WORKER_MEMORY_BYTES holds it at two workers and more
# (the tree's growth per worker counts it), not at one: there an MXFP4 dequantize at its advised
# minimum was read by 1 ms counters up to 2.9 MiB over its prediction (s11 review, F6). The
# watchdog's full readings of smaps are summed as they are read (proc_reading.exact_charge): read
# whole, they grew a coordinator of many mappings (a test process late in a suite) past this figure.
COORDINATOR_RUN_BYTES = 3 * 1024 * 1024
# What the coordinator holds per planned unit (a chunk, its name, its item, its place in a task and
# in the results): ~300 B measured for the plan alone, rounded up for what follows it.
PLAN_UNIT_BYTES = 1024

# Compressed records (storage/compression.py). Compressing: zstd's context at the level (zstd's
# own estimate: 0.6 MiB at level 1, 1.3 MiB at 3, 11 MiB at 9, 85 MiB at 19) and its streaming
# input buffer (one window: 0.5, 2, 4, 8 MiB), plus its output block and the piece being fed
# (1 MiB each), per task writing a shard. Measured (tests/test_memory_io_transients.py, 24 MiB
# records): 1.6 MiB at level 1, 3.9 at 3, 15.1 at 9, against 3.1, 5.2, 16.5 counted.
_ZSTD_PIECE_BYTES = 2 * 1024 * 1024
# Decompressing one record at a time, the larger of: a streamed record's window (the largest a
# frame may ask for; larger ones are refused as corrupt; stock writes 2-8 MiB windows up to level
# 19), context, input read and output piece; a small record (decompressing to at most
# ZSTD_SMALL_RECORD_BYTES) read whole: its stored bytes, its output and a staging copy.
ZSTD_MAX_WINDOW_BYTES = 1 << 23
ZSTD_SMALL_RECORD_BYTES = 4 * 1024 * 1024
ZSTD_DECOMPRESS_BYTES = max(ZSTD_MAX_WINDOW_BYTES + 3 * 1024 * 1024, 3 * ZSTD_SMALL_RECORD_BYTES + 256 * 1024)
# A compressed pickled value has no size in .metadata: it may decompress to at most this much.
ZSTD_VALUE_MAX_BYTES = 64 * 1024 * 1024

# The watchdog spends at most about 1/_SAMPLING_SHARE of one core reading the tree.
_SAMPLING_SHARE = 20
# While the tree's resident size alone proves it under the ceiling, smaps are read only this often
# (for the reported peak), since reading it walks every page table.
_RELAXED_INTERVAL = 1.0
# The default ceiling: this fraction of the memory available when the job starts.
DEFAULT_FRACTION = 0.5


def zstd_compress_bytes(level: int) -> int:
    """What one zstd record writer at ``level`` holds (see :data:`ZSTD_DECOMPRESS_BYTES` above):
    its context, plus the input buffer a streaming compressor keeps, one window (zstd's own
    ZSTD_estimateCStreamSize counts it; the context estimate alone under-counted by 0.6 MiB at
    level 3 and 2.7 MiB at level 9, measured by tests/test_memory_io_transients.py)."""
    try:
        import zstandard

        params = zstandard.ZstdCompressionParameters.from_level(level)
        context = int(params.estimated_compression_context_size()) + (1 << int(params.window_log))
    except ImportError:  # the caller reports the missing package; this figure is then never used
        context = 96 * 1024 * 1024
    return context + _ZSTD_PIECE_BYTES


_WARNED_OVER_MACHINE: set[int] = set()


def warn_over_machine(limit: int) -> None:
    """Warn (once per limit in a process) when ``limit`` is more than this machine's memory: such
    a ceiling admits tasks the machine cannot hold, so it protects nothing."""
    total = int(psutil.virtual_memory().total)
    if limit > total and limit not in _WARNED_OVER_MACHINE:
        _WARNED_OVER_MACHINE.add(limit)
        warnings.warn(
            f"the memory limit {format_bytes(limit)} is more than this machine's memory ({format_bytes(total)}): "
            "it cannot keep the job from exhausting the machine; give a lower --memory-limit",
            UserWarning,
            stacklevel=3,
        )


def default_limit() -> int:
    """The default ceiling: ``DEFAULT_FRACTION`` of the memory available now."""
    return int(psutil.virtual_memory().available * DEFAULT_FRACTION)


_READ_THREADS = 16


@dataclass(frozen=True, slots=True)
class Reading:
    """One sample of the tree: bytes added over the baseline, each worker's private bytes, and each
    process's charge (for a breach's culprit: engine/breach.py)."""

    added: int
    private: dict[int, int]
    charged: dict[int, int]


class MemoryGovernor:
    """Admission and watchdog for one job; created before the workers are forked.

    Args:
        limit: the ceiling in bytes on memory the job adds to its process tree.
        interval: seconds between watchdog samples.
    """

    def __init__(
        self,
        limit: int,
        *,
        interval: float = 0.05,
        held: Sequence[int] = (),
        charges: ChargeReader | None = None,
        measure: bool = True,
        parent: int | None = None,
    ) -> None:
        """``held``: processes that exist before the job and stay after it (a ``Saver``'s fork
        server and workers): their memory now is part of the baseline, and every reading counts
        them (the workers' and the fork server's shared pages are split among all of them).
        ``charges``: a reader that outlives the job (it knows those processes' code shares).
        ``parent``: the held process the others were forked from (a Saver's fork server), whose
        pages they share: its charge grows as they copy them, its counters unmoved, so the
        baseline rolls it up once they gave up enough of them (ChargeReader._baseline_plan).
        ``measure=False``: a budget kept by reservation alone (:meth:`reserve`, :meth:`check_item`),
        never sampled: the tree's memory now is not read (a read of this process's pages costs
        tens of milliseconds when it holds a large state dict)."""
        self.limit = limit
        self.interval = interval
        # When the baseline was read (time.monotonic()): what this process opened since is the job's.
        self.started = time.monotonic()
        self._me = psutil.Process()
        self._charges = charges or ChargeReader()
        self._held = list(held)
        pids = [self._me.pid, *self._held]
        self.measured = measure
        # Never above the truth (ChargeReader._baseline_plan), and without the carried shares:
        # they are the most that moved, part of every later reading until they are settled.
        # Each process's charge then, and this one's counters: a breach names the process that grew
        # the most since (engine/breach.py).
        self._start = JobStart.read(self._me.pid) if measure else JobStart(self._me.pid)
        self._started: dict[int, int] = (
            {
                pid: charged
                for pid, (charged, _) in zip(
                    pids,
                    self._charge_all(
                        pids, self._charges.plan(pids, baseline=True, shared=() if parent is None else (parent,))
                    ),
                    strict=True,
                )
            }
            if measure
            else {}
        )
        self.baseline = sum(self._started.values())
        # This process's and the workers' statm, kept open from one watch to the next.
        self._resident = ResidentSizes()
        self._rss_baseline = self._resident.of(self._me.pid) if measure else 0
        self.peak = 0
        # What each worker keeps for the whole job beside its idle cost, such as its connection
        # to object storage (opened at its first task, after the idle workers were measured).
        self.worker_extra = 0
        self.overhead = 0
        self.reserved = 0
        self.coordinator = 0  # COORDINATOR_RUN_BYTES once held (in reserved too)
        self.clients = 0  # ... of which the coordinator's own connections (hold_coordinator)
        self.planned_units = 0  # admitted by admit_units
        # What the tasks are doing and what their units are, for messages (see :meth:`during`).
        self.phase = "writing"
        self.units = "keys"
        self._in_flight = 0
        self._next_sample = 0.0
        # The baseline was read just now: the next reading the resident sizes do not call for (for
        # the peak) is due a relaxed interval after it, not at the first watch. Read then, it found
        # next to nothing added, and it cost a Saver's later save of 50,000 keys up to two smaps
        # rollups of this process (8.5 ms each while it holds the state dict) every save.
        self._next_relaxed = time.monotonic() + _RELAXED_INTERVAL if measure else 0.0
        self._read_cost = 0.0
        self.settle_seconds = 0.0
        # A reading for the peak taken on a thread of its own (watch(aside=True)), until acted on.
        self._aside: Future[Reading] | None = None
        self._aside_reader: ThreadPoolExecutor | None = None

    def reserve(self, nbytes: int, what: str) -> None:
        """Set aside memory the whole job holds (a load's output); fail now if it cannot fit."""
        if self.reserved + nbytes > self.limit:
            beside = f" beside the {format_bytes(self.reserved)} set aside before it" if self.reserved else ""
            raise MemoryLimitExceeded(
                f"{what} needs {format_bytes(nbytes)} in memory{beside}, more than the memory limit "
                f"{format_bytes(self.limit)}: raise --memory-limit to at least "
                f"{format_at_least(self.reserved + nbytes)} or select fewer keys",
                limit=self.limit,
                measured=self.reserved + nbytes,
                keys=[],
            )
        self.reserved += nbytes

    def hold_coordinator(self, clients: int = 0) -> None:
        """Set aside, once a job, what the coordinator grows by while its workers run
        (``COORDINATOR_RUN_BYTES``), and ``clients``: what its own connections to object storage
        hold where the job opens them (after the baseline); every later plan, admission and dry
        run counts it. Never refused here: a limit it leaves no room under is refused by
        planning, with its advice."""
        if not self.coordinator:
            self.clients = clients
            self.coordinator = COORDINATOR_RUN_BYTES + clients
            self.reserved += self.coordinator

    @contextlib.contextmanager
    def during(self, phase: str, units: str = "keys") -> Iterator[None]:
        """Tasks run while this holds are doing ``phase`` ("checking the shard files' checksums")
        on ``units`` ("files"): what a memory error says they were doing."""
        previous = self.phase, self.units
        self.phase, self.units = phase, units
        try:
            yield
        finally:
            self.phase, self.units = previous

    def admit_units(self, key: str, count: int, nbytes: int, *, keep: bool = True) -> None:
        """Admit ``count`` more planned units for ``key`` (``nbytes`` claimed) before they are built:
        every size a source claims is admitted before planning, so a claimed shape far beyond what
        is stored fails here instead of filling the coordinator with chunks. ``keep=False`` only
        checks (a planner trying thresholds keeps the units of the one it picks).

        Raises:
            MemoryLimitExceeded: the plan alone would not fit under the ceiling.
        """
        need = (self.planned_units + count) * PLAN_UNIT_BYTES
        if self.reserved + need > self.limit:
            raise MemoryLimitExceeded(
                f"{describe_unit(key)} claims {format_bytes(nbytes)}: split into pieces that fit, the plan alone "
                f"({self.planned_units + count} pieces) needs {format_bytes(need)} in this process, more than the "
                f"memory limit {format_bytes(self.limit)} beside the {format_bytes(self.reserved)} set aside; nothing "
                f"was read or written. Raise --memory-limit to more than {format_bytes(self.reserved + need)} (or, "
                "where a source file claims more than it stores, it is damaged)",
                limit=self.limit,
                measured=self.reserved + need,
                keys=[key],
            )
        if keep:
            self.planned_units += count

    def check_item(self, key: str, need: int) -> None:
        """Fail before anything is written if one item can never fit under the ceiling."""
        if self.reserved + need > self.limit:
            beside = f" beside the {format_bytes(self.reserved)} set aside" if self.reserved else ""
            raise MemoryLimitExceeded(
                f"{describe_unit(key)} needs {format_bytes(need)} in memory at once{beside}, more than the "
                f"memory limit {format_bytes(self.limit)}: raise --memory-limit to at least "
                f"{format_at_least(self.reserved + need)}",
                limit=self.limit,
                measured=self.reserved + need,
                keys=[key],
            )

    def workers_for(self, needs: Iterable[tuple[str, int]], wanted: int) -> int:
        """How many of ``wanted`` workers the limit affords, after checking that every item fits.

        Args:
            needs: (key, memory its worker allocates for it) for every item of the job.

        Raises:
            MemoryLimitExceeded: an item can never fit (before anything is written).
        """
        largest = TASK_MEMORY_BYTES + ITEM_MEMORY_BYTES
        biggest = max(needs, key=lambda need: need[1], default=None)  # if the largest fits, all do
        if biggest is not None:
            largest += biggest[1]
            self.check_item(biggest[0], largest + WORKER_MEMORY_BYTES + self.worker_extra)
        return affordable_workers(wanted, self.limit - self.reserved, largest, WORKER_MEMORY_BYTES + self.worker_extra)

    def task_budget(self, workers: int) -> int:
        """The memory each of ``workers`` tasks in flight may use beside what is set aside."""
        return task_budget(self.limit - self.reserved, workers, WORKER_MEMORY_BYTES + self.worker_extra)

    def unit_room(self, workers: int) -> int:
        """What one unit's reads may use in a plan that cuts units until each fits (verify, diff):
        the task's budget less a task's and an item's fixed cost."""
        return self.task_budget(workers) - TASK_MEMORY_BYTES - ITEM_MEMORY_BYTES

    def settle(self, worker_pids: Iterable[int], planned: int = 0) -> None:
        """Measure what the tree holds once the first workers started, and plan each worker's
        resting cost (``WORKER_MEMORY_BYTES``) beside it; tasks are admitted into what is left.

        ``planned`` is the memory of every task of the job. When the tree's resident size (an
        upper bound, read cheaply) leaves room for all of it at once, that bound is used as is;
        otherwise the tree is read (~1 ms a process; in full before refusing). Workers ``held``
        (a Saver's) are idle in the baseline: nothing to add.
        """
        if not self.measured:
            raise RuntimeError("a budget kept by reservation alone (measure=False) cannot sample the tree")
        started = time.perf_counter()
        pids = list(worker_pids)
        self._start.forked(pid for pid in pids if pid not in self._held)  # what each inherited
        try:
            self._settle(pids, planned)
        finally:
            # Serial, and it grows with the worker count (one smaps read per worker when the
            # resident sizes do not prove the tree far under the limit): SaveResult.phases
            # counts it with the fork.
            self.settle_seconds = time.perf_counter() - started

    def _settle(self, pids: list[int], planned: int) -> None:
        if pids and set(pids) <= set(self._held):  # idle since the baseline was measured
            self.overhead = 0
            return
        extra = self.worker_extra * len(pids)
        # Each worker is charged from now on what it will keep once it has run a task (the tree's
        # growth it brings, the ~0.1 MiB a fresh fork adds at first included): measured now, a
        # worker looks nearly free, and every later admission would under-count what it keeps.
        resting = WORKER_MEMORY_BYTES * len(pids) + extra
        bound = self._rss_bound(pids) + resting
        if bound + self.reserved + planned <= self.limit:
            self.overhead = bound
            return
        # Exactly (every full smaps, once a job): the cheap reading is an upper bound (a page
        # written since the fork counts as copied), and this figure decides whether each task is
        # admitted: an over-count here refused plans that fit (a diff under 24 MiB read 2.9 MiB
        # added where 1.2 were).
        reading = self.read(pids, exact=True)
        self.peak = max(self.peak, reading.added)
        # The resting cost is the tree's growth per worker, the coordinator's own included
        # (WORKER_MEMORY_BYTES): what the tree grew by already is part of it, not beside it.
        # Added on top, a worker that had copied 6 MiB of a large caller's heap by now was counted
        # twice, and a diff planned to fit was refused at its first task (test_diff_values, 1 CI
        # run in 4). Where the workers alone leave no room, the first task's admission refuses
        # the job, naming the phase, the task and the figures (admit_task).
        # The coordinator's connections opened by the job are in the reading and set aside in
        # ``reserved`` (hold_coordinator): counted once.
        self.overhead = max(max(0, reading.added - self.clients), WORKER_MEMORY_BYTES * len(pids)) + extra

    def room_for_worker(self, need: int) -> bool:
        """Whether a worker started now (its planned resting cost) and a task needing ``need`` on
        it fit beside what is in flight."""
        worker = WORKER_MEMORY_BYTES + self.worker_extra
        return self.overhead + self.reserved + self._in_flight + worker + need <= self.limit

    def add_worker(self, pid: int | None = None) -> None:
        """A worker started after :meth:`settle` (``pid``: read now for what it inherited, see
        engine/breach.py): its resting cost, as planned, joins the overhead (the watchdog still
        measures what it really adds)."""
        if pid is not None:
            self._start.forked([pid])
        self.overhead += WORKER_MEMORY_BYTES + self.worker_extra

    def admit(self, need: int) -> bool:
        """True (and the bytes are reserved) when a task needing ``need`` fits beside those in flight."""
        if self.overhead + self.reserved + self._in_flight + need > self.limit:
            return False
        self._in_flight += need
        return True

    def admit_task(self, index: int, keys: Sequence[str], need: int, *, others_running: bool) -> bool:
        """The one admission path of both pools: True (bytes reserved) when task ``index`` fits now;
        False when it must wait for a running task to finish.

        Raises:
            MemoryLimitExceeded: it does not fit although nothing else is running (it never will).
        """
        if self.admit(need):
            return True
        if others_running:
            return False
        held = self.overhead + self.reserved
        raise MemoryLimitExceeded(
            f"{self.phase}: task {index} with {self.units} {describe_keys(keys)} needs {format_bytes(need)} beside the "
            f"{format_bytes(held)} the job already holds, over the memory limit {format_bytes(self.limit)}: "
            f"raise --memory-limit to more than {format_bytes(need + held)} (this task beside that), or lower "
            "--workers",
            limit=self.limit,
            measured=need + held,
            keys=keys,
        )

    def release(self, need: int) -> None:
        self._in_flight -= need

    def _bounded_under_limit(self, worker_pids: Iterable[int]) -> bool:
        """True when resident sizes (cheap: /proc/<pid>/statm) prove the tree under the ceiling.

        What a process is charged never exceeds its RSS, so the coordinator's growth in RSS plus every
        worker's whole RSS bounds what the job added from above.
        """
        return self._rss_bound(worker_pids) <= self.limit

    def _rss_bound(self, worker_pids: Iterable[int]) -> int:
        mine, *workers = self._resident.read([self._me.pid, *worker_pids])
        return max(0, mine - self._rss_baseline) + sum(workers)

    def read(self, worker_pids: Iterable[int], *, exact: bool = False) -> Reading:
        """One sample of the tree. Cheap (O(1) counters, or ``smaps_rollup`` where they moved:
        process_memory.ChargeReader) unless ``exact``: then every process's full smaps is read
        (~4-9 ms a process that has imported torch)."""
        self._wait_aside()  # (one reading at a time: the charge reader is not shared between threads)
        return self._read(worker_pids, exact=exact)

    def _read(self, worker_pids: Iterable[int], *, exact: bool = False) -> Reading:
        if not self.measured:
            raise RuntimeError("a budget kept by reservation alone (measure=False) cannot sample the tree")
        started = time.monotonic()
        workers = list(worker_pids)
        pids = [self._me.pid, *workers, *(pid for pid in self._held if pid not in workers)]
        how = self._charges.plan(pids, exact=exact)
        # Each read walks a process's page tables in the kernel (the GIL is released meanwhile):
        # several threads, so reading 64 workers on a big node costs a few reads' time, not 64.
        found = self._charge_all(pids, how)
        # Plus the shares that may have moved to processes not rolled up since (ChargeReader.carried).
        total = self._charges.carried + sum(charged for charged, _ in found)
        private = {pid: uss for pid, (charged, uss) in zip(workers, found[1:], strict=False) if charged or uss}
        charged = {pid: charged for pid, (charged, _) in zip(pids, found, strict=True)}
        # Keep the watchdog's share of one core near 1/_SAMPLING_SHARE however large the tree.
        self._read_cost = time.monotonic() - started
        return Reading(added=total - self.baseline, private=private, charged=charged)

    def _charge_all(self, pids: list[int], how: list[int]) -> list[tuple[int, int]]:
        # Counters are too short a read to pay for a thread; rollups and full reads are not.
        threads = min(_READ_THREADS, sum(1 for read in how if read in (ROLLUP, FULL)))
        if threads <= 1:
            return list(map(self._charges.charge, pids, how))
        with ThreadPoolExecutor(max_workers=threads) as pool:
            return list(pool.map(self._charges.charge, pids, how))

    def due(self) -> bool:
        """Whether :meth:`watch` would read anything now (a reading taken aside is done, or the
        next one is due): a caller whose ``workers`` map costs a walk over every worker makes it
        only then (most of a pool's wakes come between two samples)."""
        if not self.measured or (self._aside is not None and self._aside.done()):
            return True
        return time.monotonic() >= self._next_sample

    def watch(self, workers: dict[int, tuple[int, tuple[str, ...]]], *, aside: bool = False) -> None:
        """Sample the tree if it is time; raise if it is over the ceiling twice in a row.

        Args:
            workers: pid -> (worker number, keys of its running task) for every live worker;
                empty when the job runs on writer threads in this process.
            aside: take the readings for the reported peak (about once a second, while the
                resident sizes prove the tree under the ceiling) on a thread of their own, so this
                one goes on while the kernel walks page tables (a rollup of a busy worker held a
                Saver's coordinator 6-80 ms, 1-2 a save); the same reading, acted on at the first
                watch after it ends, or by :meth:`finish`. Only where this process forks no worker
                meanwhile (a Saver's pool: the fork server forks them).

        Raises:
            MemoryLimitExceeded: naming the process that grew the most since the baseline, a
                worker or this one (engine/breach.py); the caller then kills every worker.
        """
        if not self.measured:
            raise RuntimeError("a budget kept by reservation alone (measure=False) cannot sample the tree")
        if self._aside is not None and self._aside.done():
            self._act(self._take_aside(), workers)
        now = time.monotonic()
        if now < self._next_sample:
            return
        bounded = self._bounded_under_limit(workers)
        if bounded and (now < self._next_relaxed or self._aside is not None):
            self._next_sample = now + self.interval
            return
        if bounded and aside:
            self._next_sample = now + self.interval
            if self._aside_reader is None:
                self._aside_reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parallel_dcp-governor")
            self._aside = self._aside_reader.submit(self._read, list(workers))
            return
        first = self.read(workers)
        self._scheduled()
        self._act(first, workers)

    def finish(self, workers: dict[int, tuple[int, tuple[str, ...]]] | None = None) -> None:
        """A job's watch is over: a reading still taken aside is waited for and acted on as
        :meth:`watch` would (``workers``: as it takes them), or, with none (the job failed), only
        counted in the peak where under the ceiling; its thread ends."""
        if workers is None:
            self._wait_aside()
        elif self._aside is not None:
            self._act(self._take_aside(), workers)
        if self._aside_reader is not None:
            self._aside_reader.shutdown()
            self._aside_reader = None

    def _take_aside(self) -> Reading:
        """The reading taken aside (waited for; its error raised here), scheduled as if taken now."""
        assert self._aside is not None
        try:
            return self._aside.result()
        finally:
            self._aside = None
            self._scheduled()

    def _wait_aside(self) -> None:
        """Wait for a reading taken aside; kept in the peak where under the ceiling (else the next decides)."""
        if self._aside is None:
            return
        with contextlib.suppress(Exception):
            reading = self._take_aside()
            if reading.added <= self.limit:
                self.peak = max(self.peak, reading.added)

    def _scheduled(self) -> None:
        """The next readings' times after one that took ``_read_cost`` seconds."""
        self._next_sample = time.monotonic() + max(self.interval, self._read_cost * _SAMPLING_SHARE)
        self._next_relaxed = time.monotonic() + max(_RELAXED_INTERVAL, self._read_cost * _SAMPLING_SHARE * 5)

    def _act(self, first: Reading, workers: dict[int, tuple[int, tuple[str, ...]]]) -> None:
        """A reading taken: the peak, or a breach measured again, exactly, and raised where confirmed."""
        if first.added <= self.limit:
            self.peak = max(self.peak, first.added)
            return
        time.sleep(0.01)  # measure again, exactly: a transient spike, or a stale code share, is not a breach
        now = read_counters(self._me.pid)  # (with the reading: what it counts of this process)
        second = self.read(workers, exact=True)
        # Nor is it the job's peak. The processes are read one after another while mappings
        # change (a worker maps a source shard another has mapped: PSS shares move between two
        # reads), so one reading can count a shared page more than once: a single reading was seen
        # 5-15 MiB over the limit while an independent 2 ms sampler read the tree far under it. A
        # reading over the ceiling counts, as a breach and as the peak, only as far as the next
        # one confirms it.
        self.peak = max(self.peak, min(first.added, second.added))
        if second.added <= self.limit:
            return
        if not workers:  # writer threads in this process: they cannot be killed, only stopped
            raise MemoryLimitExceeded(
                f"the writer threads pushed the job to {format_bytes(second.added)}, over the memory limit "
                f"{format_bytes(self.limit)}; no further task was started and nothing was committed. "
                "Raise --memory-limit or lower --workers",
                limit=self.limit,
                measured=second.added,
                keys=[],
            )
        if not second.private:
            return
        raise breach_error(
            added=second.added,
            limit=self.limit,
            grown=growth(second.charged, self._started, second.private, self._start, now, self._charges.anonymous),
            coordinator=self._me.pid,
            workers=workers,
            private=second.private,
            phase=self.phase,
            units=self.units,
        )


def affordable_workers(wanted: int, limit: int, largest_need: int, worker_memory: int = WORKER_MEMORY_BYTES) -> int:
    """How many of ``wanted`` workers the limit affords, so that each still fits the largest task.

    Each worker costs ``WORKER_MEMORY_BYTES`` idle and gets an equal share of the rest; never
    fewer than one (the governor then decides whether that one fits at all).
    """
    for workers in range(wanted, 0, -1):
        if (limit - workers * worker_memory) // workers >= largest_need:
            return workers
    return 1


def task_budget(limit: int, workers: int, worker_memory: int = WORKER_MEMORY_BYTES) -> int:
    """The memory each of ``workers`` tasks in flight may use under ``limit``."""
    return max(1, (limit - workers * worker_memory) // workers)
