"""Ctrl-C (and SIGTERM, which a job turns into one) held where raising it at once would lose it:
while a job commits and publishes, and while a pool forks a worker.

A fork runs Python's fork callbacks (logging's among them), and an exception raised in one is
printed and dropped: a Ctrl-C that landed there was lost, and the save it meant to stop committed.

A commit renames ``.metadata`` into place; publishing then deletes what the checkpoint replaced
(an overwrite's old shards) and the job's owner record. An interrupt raised in between left both
behind for good (a later overwrite does not know them: they are not the new checkpoint's) and
made the save raise KeyboardInterrupt after it had committed, which its contract says never
happens. So the interrupt waits: the signal is recorded, the commit and the publishing finish,
and the job delivers it then, as a KeyboardInterrupt that says whether the save had committed.
Only in the main thread, where Python delivers signals; a signal whose handler is not Python's
(its default action, ignored) is left alone.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

__all__ = ["HeldInterrupts"]

_HELD = (signal.SIGINT, signal.SIGTERM)
# The holders in force now (in the main thread): a fork made meanwhile (a pool's worker) gets the
# handlers they replaced back, as it would have without them (else a worker ignored SIGTERM).
_ACTIVE: list[HeldInterrupts] = []


def _restore_in_child() -> None:
    for held in _ACTIVE:
        for signum, handler in held._previous.items():
            signal.signal(signum, handler)
        held._previous.clear()
    _ACTIVE.clear()


os.register_at_fork(after_in_child=_restore_in_child)


class HeldInterrupts:
    """``with held:`` records SIGINT and SIGTERM instead of raising; :meth:`deliver` raises the
    KeyboardInterrupt held, if any (after the ``with``)."""

    def __init__(self) -> None:
        self.caught: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> HeldInterrupts:
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in _HELD:
            handler = signal.getsignal(signum)
            if callable(handler):  # Python's (a KeyboardInterrupt), not SIG_DFL or SIG_IGN
                self._previous[signum] = signal.signal(signum, self._hold)
        if self._previous:
            _ACTIVE.append(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        self.caught.append(signum)

    def deliver(self, *, committed: str | None = None) -> None:
        """Raise the KeyboardInterrupt held (nothing if none came): ``committed``, the path the
        job had committed when it came (None: it had not, or failed)."""
        if not self.caught:
            return
        name = signal.Signals(self.caught[0]).name
        interrupt = KeyboardInterrupt(f"signal {name}")
        interrupt.committed = committed  # type: ignore[attr-defined]  # (what the command line says)
        if committed is not None:
            interrupt.add_note(
                f"{name} came while the job committed; it was held until the commit was whole: "
                f"{committed} holds the new checkpoint"
            )
        self.caught.clear()
        raise interrupt
