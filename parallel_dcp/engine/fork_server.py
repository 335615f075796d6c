"""Workers forked from multiprocessing's fork server, without re-running the caller's script.

A fork server is a fresh process (here with torch imported) that forks each worker on request:
a worker holds none of the caller's memory, and starting one costs a few milliseconds whatever
the caller holds. multiprocessing's spawn machinery also re-imports the caller's ``__main__``
script in every worker (to find functions defined there); a training script without an
``if __name__ == "__main__":`` guard would then run again in each worker. Our workers run only
parallel_dcp's own functions, so :class:`ForkServerProcess` leaves ``__main__`` out.

The fork server is a fresh interpreter started as ``python -c ...``: its ``sys.path`` begins
with its working directory, and Python 3.11's fork server never applies the caller's
``sys.path`` it is handed. Started plainly from a directory holding a ``parallel_dcp`` or a
``torch`` (another checkout, or a file planted in /tmp), it would import that one in place of the
caller's and run it in every worker. :func:`start_fork_server` starts it with the caller's own
``sys.path`` first (``PYTHONPATH``) and without the working directory (``PYTHONSAFEPATH``,
Python >= 3.11; 3.10 still puts it first).

This module touches multiprocess's private ``popen_forkserver``, ``forkserver`` and ``spawn``;
stopping the fork server is in ``parallel_dcp._compat`` (with the other private names).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import multiprocess.context
import multiprocess.forkserver
import multiprocess.popen_forkserver
import multiprocess.spawn

__all__ = ["ForkServerProcess", "start_fork_server"]

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


def start_fork_server() -> None:
    """Start multiprocessing's fork server (once per process; a running one is kept) importing
    from this process's ``sys.path``, not from its working directory (see the module doc)."""
    path = os.pathsep.join(os.path.abspath(p) if p else os.getcwd() for p in sys.path)
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", "PYTHONSAFEPATH")}
    # (putenv, not os.environ: the server inherits the C environment, and replacing os.environ's
    # entries would free objects a caller may have frozen with gc.freeze())
    with _patch_lock:
        os.putenv("PYTHONPATH", path)
        os.putenv("PYTHONSAFEPATH", "1")
        try:
            multiprocess.forkserver.ensure_running()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.unsetenv(name)
                else:
                    os.putenv(name, value)
