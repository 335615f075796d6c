"""Workers forked from multiprocessing's fork server, without re-running the caller's script.

A fork server is a fresh process (here with torch imported) that forks each worker on request:
a worker holds none of the caller's memory, and starting one costs a few milliseconds whatever
the caller holds. multiprocessing's spawn machinery also re-imports the caller's ``__main__``
script in every worker (to find functions defined there); a training script without an
``if __name__ == "__main__":`` guard would then run again in each worker. Our workers run only
parallel_dcp's own functions, so :class:`ForkServerProcess` leaves ``__main__`` out.

This module touches multiprocess's private names (``popen_forkserver``, ``spawn``,
``forkserver._forkserver``), and is the only one that does.
"""

from __future__ import annotations

import threading
from typing import Any

import multiprocess.context
import multiprocess.forkserver
import multiprocess.popen_forkserver
import multiprocess.resource_tracker
import multiprocess.spawn

__all__ = ["ForkServerProcess", "fork_server_pid", "running_servers", "stop_fork_server"]

_MAIN_KEYS = ("init_main_from_path", "init_main_from_name")
_patch_lock = threading.Lock()


class _Popen(multiprocess.popen_forkserver.Popen):  # type: ignore[misc]
    def _launch(self, process_obj: Any) -> None:
        stock = multiprocess.spawn.get_preparation_data

        def without_main(name: str) -> dict[str, Any]:
            data: dict[str, Any] = stock(name)
            for key in _MAIN_KEYS:
                data.pop(key, None)
            return data

        with _patch_lock:
            multiprocess.spawn.get_preparation_data = without_main
            try:
                super()._launch(process_obj)
            finally:
                multiprocess.spawn.get_preparation_data = stock


class ForkServerProcess(multiprocess.context.ForkServerProcess):  # type: ignore[misc]
    """A ``Process`` forked from the fork server, that does not import the caller's ``__main__``."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _Popen(process_obj)


def fork_server_pid() -> int | None:
    """The fork server's process id while it runs."""
    pid = getattr(getattr(multiprocess.forkserver, "_forkserver", None), "_forkserver_pid", None)
    return pid if isinstance(pid, int) else None


def running_servers() -> tuple[bool, bool]:
    """Whether the fork server and the resource tracker (which the fork server starts) run now."""
    server = getattr(multiprocess.forkserver, "_forkserver", None)
    tracker = getattr(multiprocess.resource_tracker, "_resource_tracker", None)
    return getattr(server, "_forkserver_pid", None) is not None, getattr(tracker, "_pid", None) is not None


def stop_fork_server(running_before: tuple[bool, bool]) -> None:
    """Stop the fork server and the resource tracker, each unless it ran before we used it (it
    may serve the caller's own processes, shared memory or semaphores), so no process is left.
    Each starts again on its next use."""
    server_before, tracker_before = running_before
    if not server_before:
        stop = getattr(getattr(multiprocess.forkserver, "_forkserver", None), "_stop", None)
        if stop is not None:
            stop()
    if not tracker_before:
        stop = getattr(getattr(multiprocess.resource_tracker, "_resource_tracker", None), "_stop", None)
        if stop is not None:
            stop()
