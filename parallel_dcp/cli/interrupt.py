"""Ctrl-C on the command line: one line and exit code 130 at any instant, never a traceback.

``install`` runs first thing in :func:`parallel_dcp.cli.main`, before the command imports torch
(a second or more): a Ctrl-C then raises KeyboardInterrupt, which main turns into one line. Once
the command has finished (``finished``), a late Ctrl-C has nothing left to stop and is ignored
(it used to die with SIGINT or an atexit traceback after the job had succeeded). Workers ignore
SIGINT (parallel_dcp.engine.pool): the coordinator owns it and stops them.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["finished", "install", "restore"]

_state = {"finished": False, "program": False}


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if _state["finished"]:
        return  # the command is done: nothing to interrupt, exit with its own code
    raise KeyboardInterrupt


def install(*, program: bool = False) -> Any:
    """Take SIGINT for this command (``program``: the process is the command, not a caller of
    main); the handler it replaced (None off the main thread)."""
    _state["finished"] = False
    _state["program"] = program
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, _on_sigint)


def finished() -> None:
    """The command's work is over: a Ctrl-C from now on is ignored. As the program, SIGINT is then
    ignored by the kernel: the interpreter's exit puts a Python handler back to the default action
    before it tears down its modules (torch's: up to a second), and a Ctrl-C there killed the
    process by SIGINT after the job had committed (exit -2, nothing said: review s17 rev2 F4)."""
    _state["finished"] = True
    if _state["program"] and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def restore(previous: Any) -> None:
    """Give SIGINT back to ``previous`` (main called in-process, from a test or a script)."""
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, previous)
