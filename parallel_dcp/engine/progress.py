"""Progress: workers add the bytes they finish to a shared counter; the coordinator draws a bar.

The bar (tqdm, on stderr) is labelled with the job (``save``, ``convert``, ``load``, ``verify``)
and shows bytes done and total, the rate and the time left, all with binary prefixes (``MiB``,
``GiB``, ``MiB/s``). It advances while a task runs, not only when it ends, because workers report
as they write. It stays silent when off.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import multiprocess as mp

__all__ = ["Progress", "advance", "describe_progress", "report"]

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


def advance(nbytes: int) -> None:
    """In the coordinator: count a finished task's bytes for workers that cannot report (started
    before the bar's counter existed: a ``Saver``'s), so the bar moves task by task."""
    if _counter is not None:
        with _counter.get_lock():
            _counter.value += nbytes


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

            class Bar(tqdm):  # type: ignore[misc,type-arg]
                """tqdm with our figures in its line (its own byte rates use SI prefixes)."""

                figures = describe_progress(0, total, 0.0)

                @property
                def format_dict(self) -> dict[str, Any]:
                    return {**super().format_dict, "figures": self.figures}

            self._bar = Bar(total=total, desc=desc, file=sys.stderr, bar_format=_FORMAT)
            self._start = time.monotonic()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        global _counter
        if self._bar is not None:
            if exc_info[0] is None:
                total = int(self._bar.total)
                self._bar.figures = describe_progress(total, total, time.monotonic() - self._start)
                self._bar.update(total - self._shown)
            self._bar.close()
            _counter = None

    def refresh(self) -> None:
        """Move the bar to what workers have reported so far."""
        if self._bar is not None and _counter is not None:
            done = min(int(_counter.value), int(self._bar.total))
            if done > self._shown:
                elapsed = time.monotonic() - self._start
                self._bar.figures = describe_progress(done, int(self._bar.total), elapsed)
                self._bar.update(done - self._shown)
                self._shown = done


_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {figures}"


def describe_progress(done: int, total: int, elapsed: float) -> str:
    """``1.5 GiB / 8.0 GiB, 750.0 MiB/s, 9 s left`` (binary prefixes)."""
    from parallel_dcp.engine.memory import format_bytes

    text = f"{format_bytes(done)} / {format_bytes(total)}"
    if elapsed > 0 and done > 0:
        rate = done / elapsed
        text += f", {format_bytes(rate)}/s, {max(0.0, (total - done) / rate):.0f} s left"
    return text
