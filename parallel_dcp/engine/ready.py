"""Which of a pool's pipes and process sentinels are ready: one ``poll`` call.

The coordinator's loop waits on every running worker's pipe and sentinel, and wakes at least
every tick (the memory watchdog's 50 ms) even while nothing happens. ``multiprocessing``'s
``connection.wait`` builds a selector and registers each object on every call; on a Saver's
save of 50,000 keys on one worker its ~80 wakes took ~8 ms of the coordinator's CPU, and the cost
grows with the number of workers waited on. Here the descriptors are registered with a
``select.poll`` object and its events mapped back: the same answer (an object is ready when its
descriptor is readable or closed: a reply, a worker's exit) for a fraction of the work.

:func:`wait_ready` registers what it is given for one wait (a worker's own pipe, a drain).
:class:`ReadySet` is kept for a whole run: a worker's descriptors are registered when it gets a
task and unregistered when it stops running one, so a wake costs what happened since the last
one, not the number of workers (issue 30: ~95 us a wake at 64 workers, rebuilding it every time).
"""

from __future__ import annotations

import math
import select
from collections.abc import Hashable, Sequence
from typing import Any, Generic, TypeVar

__all__ = ["ReadySet", "wait_ready"]

K = TypeVar("K", bound=Hashable)

_READY = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR | select.POLLNVAL


def _fd(waitable: Any) -> int:
    return waitable if isinstance(waitable, int) else int(waitable.fileno())


def _millis(timeout: float | None) -> int | None:
    return None if timeout is None else max(0, math.ceil(timeout * 1000))


def wait_ready(waitables: Sequence[Any], timeout: float | None) -> list[Any]:
    """The objects of ``waitables`` (connections, or descriptors such as a process's sentinel)
    that are ready, after at most ``timeout`` seconds (None: until one is); each object at most
    once, in the order the kernel reports them."""
    poller = select.poll()
    owners: dict[int, Any] = {}
    for waitable in waitables:
        fd = _fd(waitable)
        owners[fd] = waitable
        poller.register(fd, _READY)
    return [owners[fd] for fd, _ in poller.poll(_millis(timeout))]


class ReadySet(Generic[K]):
    """Descriptors waited on together, each set under a key (a worker's number), kept from one
    wait to the next: adding and discarding a key costs its own descriptors, a wait the events.

    A key's descriptors are remembered as numbers: discard it before they are closed (a closed
    number may be reused by the next pipe opened, which must not inherit its registration).
    """

    def __init__(self) -> None:
        self._poller = select.poll()
        self._fds: dict[K, tuple[int, ...]] = {}
        self._owners: dict[int, K] = {}

    def add(self, key: K, waitables: Sequence[Any]) -> None:
        """Wait on ``waitables`` (connections or descriptors) for ``key``, which holds none yet."""
        fds = tuple(map(_fd, waitables))
        for fd in fds:
            self._poller.register(fd, _READY)
            self._owners[fd] = key
        self._fds[key] = fds

    def discard(self, key: K) -> None:
        """Stop waiting on ``key``'s descriptors (none: nothing to do)."""
        for fd in self._fds.pop(key, ()):
            self._poller.unregister(fd)
            del self._owners[fd]

    def __contains__(self, key: object) -> bool:
        return key in self._fds

    def __len__(self) -> int:
        return len(self._fds)

    def wait(self, timeout: float | None) -> list[K]:
        """The keys with a ready descriptor after at most ``timeout`` seconds (None: until one
        is), in the order the kernel reports them: a key once per ready descriptor."""
        return [self._owners[fd] for fd, _ in self._poller.poll(_millis(timeout))]
