"""A Ctrl-C while the ``parallel-dcp`` command is still importing the package: one line, exit 130.

:func:`parallel_dcp.cli.main` takes SIGINT first thing (:mod:`parallel_dcp.cli.interrupt`), but
Python imports this package (about 0.1 s) before ``main`` runs, and a Ctrl-C in that window used to
print a KeyboardInterrupt traceback. This module is the package's first import: only when the
process is the command (``parallel-dcp ...`` or ``python -m parallel_dcp``) and SIGINT still has
Python's default handler, it answers a Ctrl-C with the command's one line and exit code 130. Nothing
has been written or started by then, so leaving at once loses nothing; ``main`` replaces the handler.
A program that imports parallel_dcp as a library keeps its own SIGINT handling untouched.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import threading
from types import FrameType

__all__: list[str] = []

_COMMAND = "parallel-dcp"
_MODULES = ("parallel_dcp", "parallel_dcp.cli")


def _launched_as_command() -> bool:
    """True when this process runs the command: its script, or ``python -m parallel_dcp``."""
    if sys.argv and os.path.basename(sys.argv[0]) == _COMMAND:
        return True
    given = getattr(sys, "orig_argv", [])
    return any(flag == "-m" and module in _MODULES for flag, module in itertools.pairwise(given))


def _interrupted(signum: int, frame: FrameType | None) -> None:
    with contextlib.suppress(OSError):  # stderr closed: the exit code still says it
        os.write(2, f"{_COMMAND}: interrupted\n".encode())
    os._exit(130)


if (
    _launched_as_command()
    and threading.current_thread() is threading.main_thread()
    and signal.getsignal(signal.SIGINT) is signal.default_int_handler
):
    signal.signal(signal.SIGINT, _interrupted)
