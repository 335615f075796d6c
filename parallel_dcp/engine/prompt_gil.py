"""A coordinator that gets the GIL back promptly while it waits on workers (:func:`prompt_gil`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["COORDINATOR_SWITCH_S", "prompt_gil"]

# During a save on workers the caller's thread mostly waits on them. Each time it wakes (a
# result, the watchdog's sample) or comes back from a system call while a busy Python thread of the
# caller holds the GIL, it waits out the switch interval (5 ms by default) before it runs again:
# planning, dispatching and committing then take several times longer. During the save it asks for
# the GIL back after this long instead (restored after; the busy thread runs while it sleeps).
COORDINATOR_SWITCH_S = 0.0005


# The caller's switch interval while prompt_gil has it lowered (None otherwise): a process forked
# meanwhile (a save's workers) gets it back, so that its own threads switch as they would have.
_caller_switch: float | None = None


@contextmanager
def prompt_gil() -> Iterator[None]:
    """Lower the interpreter's switch interval to :data:`COORDINATOR_SWITCH_S` for the block
    (unless it is lower already), then restore it (unless someone changed it meanwhile); a fork
    inside the block restores it in the child."""
    global _caller_switch
    before = sys.getswitchinterval()
    if before <= COORDINATOR_SWITCH_S:
        yield
        return
    sys.setswitchinterval(COORDINATOR_SWITCH_S)
    _caller_switch = before
    try:
        yield
    finally:
        _caller_switch = None
        if sys.getswitchinterval() == COORDINATOR_SWITCH_S:
            sys.setswitchinterval(before)


def _switch_back_in_child() -> None:
    global _caller_switch
    if _caller_switch is not None and sys.getswitchinterval() == COORDINATOR_SWITCH_S:
        sys.setswitchinterval(_caller_switch)
    _caller_switch = None


os.register_at_fork(after_in_child=_switch_back_in_child)
