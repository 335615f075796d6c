"""A second process forked from the test's own interpreter, for tests whose subject is another
process acting at the same time, not a fresh interpreter: a fresh one imports torch again (3-6 s
on this VM, 15 s under load) before it does anything.

The child runs ``target(*args)`` with its stdout kept; its exit code is 0, the code of a
``SystemExit`` it raised, or 1 (its traceback kept with the output) for any other exception.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["ForkedProcess"]


def _run(conn: Connection, target: Callable[..., object], args: tuple[Any, ...]) -> None:
    import torch

    torch.set_num_threads(1)  # as the library's forked workers: the parent's OpenMP pool is not the child's
    out = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out):
        try:
            target(*args)
        except SystemExit as exited:
            code = exited.code if isinstance(exited.code, int) else 1
        except BaseException:
            traceback.print_exc(file=out)
            code = 1
    conn.send(out.getvalue())
    conn.close()
    sys.exit(code)


class ForkedProcess:
    """``target(*args)`` in a forked child, started at once; ``communicate`` as Popen's."""

    def __init__(self, target: Callable[..., object], *args: Any) -> None:
        self._conn, child_end = multiprocessing.get_context("fork").Pipe(duplex=False)
        self._process = multiprocessing.get_context("fork").Process(target=_run, args=(child_end, target, args))
        self._process.start()
        child_end.close()
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        pid = self._process.pid
        assert pid is not None
        return pid

    def poll(self) -> int | None:
        """The exit code once the child ended, else None."""
        if self._process.exitcode is not None:
            self.returncode = self._process.exitcode
        return self.returncode

    def communicate(self, timeout: float) -> str:
        """Wait for the child's output and its end (at most ``timeout`` s each); its stdout ("" for
        a child killed before it could send it)."""
        try:
            out = self._conn.recv() if self._conn.poll(timeout) else ""
        except EOFError:  # killed
            out = ""
        self._process.join(timeout)
        self.poll()
        return out

    def kill(self) -> None:
        """End the child (SIGKILL) and reap it."""
        self._process.kill()
        self._process.join()
        self.poll()
