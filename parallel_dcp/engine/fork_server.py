"""Workers forked from multiprocessing's fork server, without re-running the caller's script.

A fork server is a fresh process (here with torch imported) that forks each worker on request:
a worker holds none of the caller's memory, and starting one costs a few milliseconds whatever
the caller holds. multiprocessing's spawn machinery also re-imports the caller's ``__main__``
script in every worker (to find functions defined there); a training script without an
``if __name__ == "__main__":`` guard would then run again in each worker. Our workers run only
parallel_dcp's own functions, so :class:`ForkServerProcess` leaves ``__main__`` out.

This module touches multiprocess's private ``popen_forkserver`` and ``spawn``; stopping the fork
server is in ``parallel_dcp._compat`` (with the other private names).
"""

from __future__ import annotations

import threading
from typing import Any

import multiprocess.context
import multiprocess.popen_forkserver
import multiprocess.spawn

__all__ = ["ForkServerProcess"]

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
