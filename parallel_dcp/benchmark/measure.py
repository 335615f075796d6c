"""How one configuration is timed, and the interleaved runner that times them all.

    round 1 .. warmup            A B C ...   run, discarded (page cache, allocator, imports)
    round warmup+1 .. +reps      A B C ...   each run: collect garbage, trim malloc, then
                                             [baseline PSS, clocks] run [clocks] peak PSS,
                                             then remove the output (outside the clocks)

Interleaving puts every configuration under the same drift of a noisy machine, so ratios of
their medians compare like with like. Each run reports wall seconds, user+sys CPU seconds of this
process and its reaped children (``getrusage`` SELF + CHILDREN, less the memory sampler's own
thread), and the peak memory the process tree added (PSS without program code, as the memory
governor counts it, so pages shared after ``fork`` count once) above what it held when the run
started.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import random
import resource
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import psutil
from torch.distributed.checkpoint.api import CheckpointException

from parallel_dcp.engine.process_memory import charged_memory

__all__ = ["Case", "Measured", "PeakMemory", "cpu_seconds", "run_interleaved", "tree_pss"]

# The sampler reads PSS at most this often...
_MIN_INTERVAL_S = 0.005
# ...and otherwise waits this many times what its last reading cost, so that it takes at most
# 1/20 of one core (a PSS reading walks every page table of every process in the tree).
_SAMPLING_SHARE = 20
_ERROR_CHARS = 300


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One configuration of a scenario: something that writes the scenario's bytes to ``out``.

    Attributes:
        name: the row's name, unique within its scenario (``"parallel_dcp w=2"``).
        family: what is compared across process counts (``"parallel_dcp"``, ``"stock dcp"``).
        procs: worker processes or writer threads it uses (1 for a single-threaded writer).
        run: writes to ``out`` (a path that does not exist yet); may return details to report
            (such as the workers actually used). Anything it raises fails only this row.
        baseline: the row this one's speed ratio is taken against (stock at the same count).
        limit: the plain-write row with the same process count (the storage's limit).
        note: a caveat printed beside the row.
        core: whether a failure fails the whole benchmark (False for optional peers).
        unavailable: set when the case cannot run here at all; says why. ``run`` is not called.
        prepare: called before each run, outside the clocks (dropping the page cache for a cold read).
    """

    name: str
    family: str
    procs: int
    run: Callable[[str], dict[str, Any] | None]
    baseline: str | None = None
    limit: str | None = None
    note: str = ""
    core: bool = True
    unavailable: str | None = None
    prepare: Callable[[], Any] | None = None


@dataclass(kw_only=True, slots=True)
class Measured:
    """The samples of one case: one entry per timed repetition, or the error that stopped it."""

    case: Case
    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    # the row that ran just before each timed repetition (None: first in its round): what it left
    # behind (memory it released, pages it dropped) can set a cold read's time (reading.py)
    after: list[str | None] = field(default_factory=list)


def cpu_seconds() -> float:
    """User+sys seconds of this process (all threads) and of its children that were reaped."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _pids(me: psutil.Process) -> tuple[list[psutil.Process], set[int]]:
    try:
        children = me.children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    return children, {proc.pid for proc in children}


def tree_pss(me: psutil.Process | None = None) -> int | None:
    """PSS of this process plus all its descendants (without program code, as the memory
    governor counts it: ``engine.process_memory``), in bytes; None for a torn reading.

    A fork or an exit between two processes' readings moves shared pages from one share to
    another, so that the sum counts them twice (or not at all): a reading during which the set
    of processes changed is returned as None, never as a figure.
    """
    me = me or psutil.Process()
    children, before = _pids(me)
    total = sum(charged_memory(proc.pid)[0] for proc in (me, *children))
    return total if _pids(me)[1] == before else None


class PeakMemory:
    """Within ``with PeakMemory() as m:``, samples the tree's PSS on a background thread.

    After the block, ``m.added`` is the highest reading minus the reading at entry (bytes, >= 0)
    and ``m.cpu_seconds`` what the sampling thread itself spent, to subtract from CPU figures.
    Page cache and tmpfs files are not process memory and are not counted. Readings torn by a
    fork or an exit are dropped; a process that lives shorter than the sampling interval (up to
    20 times what one reading costs, so that sampling takes at most 1/20 of a core) can be missed:
    code that must be seen holds its memory until :meth:`wait_for_reading` returns.
    """

    def __init__(self) -> None:
        self.baseline = 0
        self.peak = 0
        self.cpu_seconds = 0.0
        self._me = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="bench-memory-sampler", daemon=True)
        # Readings started and readings completed (untorn), numbered from 1: wait_for_reading's clock.
        self._started = 0
        self._completed = 0
        self._progress = threading.Condition()

    @property
    def added(self) -> int:
        return max(0, self.peak - self.baseline)

    def __enter__(self) -> PeakMemory:
        baseline = tree_pss(self._me)
        while baseline is None:  # a child of an earlier run is still being reaped
            baseline = tree_pss(self._me)
        self.baseline = self.peak = baseline
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def wait_for_reading(self, timeout: float = 60.0) -> None:
        """Block until a reading that started after this call has completed untorn.

        Whatever the tree held from this call until then is in ``peak``. Raises TimeoutError if
        no such reading completes within ``timeout`` seconds (the sampler is not running).
        """
        with self._progress:
            wanted = self._started + 1
            if not self._progress.wait_for(lambda: self._completed >= wanted, timeout):
                raise TimeoutError(f"no memory reading completed within {timeout} s")

    def _sample(self) -> None:
        start = time.thread_time()
        while True:
            before = time.thread_time()
            with self._progress:
                self._started += 1
                number = self._started
            reading = tree_pss(self._me)
            if reading is not None:
                self.peak = max(self.peak, reading)
                with self._progress:
                    self._completed = number
                    self._progress.notify_all()
            cost = time.thread_time() - before
            if self._stop.wait(max(_MIN_INTERVAL_S, cost * _SAMPLING_SHARE)):
                break
        self.cpu_seconds = time.thread_time() - start


@cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def release_free_memory() -> None:
    """Collect garbage and hand freed heap pages back to the kernel (glibc ``malloc_trim``).

    Without it, heap that an earlier run grew and freed stays mapped, a later run reuses it
    without adding PSS, and its peak would read lower than what it really needs.
    """
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException):  # DCP wraps the real error per rank, with its traceback
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                exc = inner
                break
    text = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    return text[:_ERROR_CHARS]


def _run_once(measured: Measured, out: str, keep: bool, after: str | None = None) -> None:
    release_free_memory()
    if measured.case.prepare is not None:
        measured.case.prepare()
    try:
        with PeakMemory() as memory:
            cpu0, wall0 = cpu_seconds(), time.perf_counter()
            details = measured.case.run(out)
            wall, cpu = time.perf_counter() - wall0, cpu_seconds() - cpu0
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        measured.error = _describe(exc)
        return
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if keep:
        measured.after.append(after)
        measured.walls.append(wall)
        measured.cpus.append(max(0.0, cpu - memory.cpu_seconds))
        measured.peaks.append(memory.added)
        measured.details.update(details or {})


def run_order(cases: Sequence[Case]) -> list[Case]:
    """Cases by process count, so that the configurations compared at one count run side by side."""
    return sorted(cases, key=lambda case: case.procs)


def round_order(cases: Sequence[Case], round_index: int, shuffled: bool) -> list[Case]:
    """The order of one round: :func:`run_order`, or (``shuffled``) an order of its own for each
    round, the same in every run of the benchmark (seeded by the round): no row always runs right
    after the same one, whose leftovers (the memory it just released) would favour it every time."""
    ordered = run_order(cases)
    if shuffled:
        random.Random(round_index).shuffle(ordered)
    return ordered


def run_interleaved(
    cases: Sequence[Case],
    reps: int,
    warmup: int,
    root: str,
    progress: Callable[[str], None] | None = None,
    *,
    shuffled: bool = False,
) -> list[Measured]:
    """Run every case ``warmup + reps`` times, interleaved, each into a fresh ``root/out``
    (``shuffled``: each round in its own order, :func:`round_order`).

    Returns:
        One :class:`Measured` per case, in the order of ``cases``. A case that raised has its
        ``error`` set and is not run again; an unavailable case carries its reason as the error.
    """
    results = {case.name: Measured(case=case, error=case.unavailable) for case in cases}
    out = os.path.join(root, "out")
    for round_index in range(warmup + reps):
        previous: str | None = None
        for case in round_order(cases, round_index, shuffled):
            measured = results[case.name]
            if measured.error is None:
                if progress is not None:
                    progress(f"round {round_index + 1}/{warmup + reps}: {case.name}")
                _run_once(measured, out, keep=round_index >= warmup, after=previous)
                previous = case.name
    return [results[case.name] for case in cases]
