"""An independent sampler of the process tree's memory, to check the governor from outside."""

from __future__ import annotations

import contextlib
import importlib
import threading
import time

import psutil


def _charged(proc: psutil.Process) -> int:
    """PSS without the file pages of program code (what the memory governor charges, computed
    here independently through psutil): a shared library's pages are shared with every torch
    process on the machine, so their share moves whenever another test's process starts or exits."""
    maps = proc.memory_maps(grouped=False)
    code = {m.path for m in maps if m.path.startswith("/") and "x" in m.perms}
    return sum(m.private_dirty if m.path in code else m.pss for m in maps)


def tree_pss() -> int | None:
    """The charged PSS of this process and its children, or None when a process started or ended
    while they were being read: a fork or an exit between two readings moves shared pages from one
    process's share to another's, and the sum would count them twice or not at all."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += _charged(proc)
    after = {p.pid for p in me.children(recursive=True)}
    return total if before == after else None


class PeakSampler:
    """``with PeakSampler() as s: ...``; ``s.peak`` is the most the tree added over its start."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.peak = 0
        self.readings = 0  # (of the whole tree, consistent: a job shorter than a reading under load gets none)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = tree_pss()
            if total is not None:
                self.peak = max(self.peak, total - self.baseline)
                self.readings += 1
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        # parallel_dcp imports its jobs (and torch's checkpoint modules) on first use, ~50 MiB
        # once per process: not what a job's memory limit is about, so loaded before the baseline.
        for job in ("convert", "load", "save", "verify", "inspect", "diff", "runner", "quantization"):
            importlib.import_module(f"parallel_dcp.jobs.{job}")
        baseline = tree_pss()
        while baseline is None:
            baseline = tree_pss()
        self.baseline = baseline
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
