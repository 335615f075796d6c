"""Progress: workers add the bytes they finish to a shared counter; the coordinator draws a bar.

The bar (tqdm, on stderr: bytes done, GiB/s, ETA) advances while a task runs, not only when it
ends, because workers report as they write. It stays silent when off.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import multiprocess as mp

__all__ = ["Progress", "report"]

# Set in each worker (inherited by fork) while a job with a bar runs.
_counter: Any = None
# Bytes not yet added to the counter, per writer thread (workers have one; writer threads several).
_local = threading.local()
_FLUSH_BYTES = 4 * 1024 * 1024


def report(nbytes: int) -> None:
    """Called in workers as bytes are done; cheap, and a no-op when no bar is shown."""
    if _counter is None:
        return
    _local.pending = getattr(_local, "pending", 0) + nbytes
    if _local.pending >= _FLUSH_BYTES:
        flush()


def flush() -> None:
    pending = getattr(_local, "pending", 0)
    if _counter is not None and pending:
        with _counter.get_lock():
            _counter.value += pending
    _local.pending = 0


class Progress:
    """``with Progress(total, enabled=...) as bar: ...; bar.refresh()``; tqdm when shown, else nothing.

    Create it before the workers are forked: they inherit the shared counter.
    """

    def __init__(self, *, total: int, enabled: bool, desc: str) -> None:
        global _counter
        self._bar: Any = None
        self._shown = 0
        if enabled:
            from tqdm import tqdm

            _counter = mp.Value("q", 0)
            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        global _counter
        if self._bar is not None:
            if exc_info[0] is None:
                self._bar.update(self._bar.total - self._shown)
            self._bar.close()
            _counter = None

    def refresh(self) -> None:
        """Move the bar to what workers have reported so far."""
        if self._bar is not None and _counter is not None:
            done = min(int(_counter.value), int(self._bar.total))
            if done > self._shown:
                self._bar.update(done - self._shown)
                self._shown = done
