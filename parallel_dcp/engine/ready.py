"""Which of a pool's pipes and process sentinels are ready: one ``poll`` call.

The coordinator's loop waits on every running worker's pipe and sentinel, and wakes at least
every tick (the memory watchdog's 50 ms) even while nothing happens. ``multiprocessing``'s
``connection.wait`` builds a selector and registers each object on every call; on a Saver's
save of 50,000 keys on one worker its ~80 wakes took ~8 ms of the coordinator's CPU, and the cost
grows with the number of workers waited on. Here each call registers the descriptors with one
``select.poll`` object and maps its events back: the same answer (an object is ready when its
descriptor is readable or closed: a reply, a worker's exit) for a fraction of the work.
"""

from __future__ import annotations

import math
import select
from collections.abc import Sequence
from typing import Any

__all__ = ["wait_ready"]

_READY = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR | select.POLLNVAL


def wait_ready(waitables: Sequence[Any], timeout: float | None) -> list[Any]:
    """The objects of ``waitables`` (connections, or descriptors such as a process's sentinel)
    that are ready, after at most ``timeout`` seconds (None: until one is); each object at most
    once, in the order the kernel reports them."""
    poller = select.poll()
    owners: dict[int, Any] = {}
    for waitable in waitables:
        fd = waitable if isinstance(waitable, int) else waitable.fileno()
        owners[fd] = waitable
        poller.register(fd, _READY)
    events = poller.poll(None if timeout is None else max(0, math.ceil(timeout * 1000)))
    return [owners[fd] for fd, _ in events]
