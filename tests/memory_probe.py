"""An independent sampler of the process tree's memory, to check the governor from outside."""

from __future__ import annotations

import contextlib
import threading
import time

import psutil


def tree_pss() -> int:
    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_full_info().pss
    return total


class PeakSampler:
    """``with PeakSampler() as s: ...``; ``s.peak`` is the most the tree added over its start."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_pss() - self.baseline)
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        self.baseline = tree_pss()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
