"""Values that misbehave only when a worker serializes them: faults injected inside workers.

DCP pickles non-tensor values in the worker that writes them, so ``__reduce__`` runs there and
never in the coordinator (which only flattens and partitions).
"""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Any


class RaiseInWorker:
    def __reduce__(self) -> Any:
        raise RuntimeError("injected failure while pickling in the worker")


class KillWorker:
    def __init__(self, sig: int = signal.SIGKILL) -> None:
        self.sig = sig

    def __reduce__(self) -> Any:
        os.kill(os.getpid(), self.sig)
        raise AssertionError("unreachable")


class ExitWorker:
    def __init__(self, code: int) -> None:
        self.code = code

    def __reduce__(self) -> Any:
        os._exit(self.code)


class SegfaultWorker:
    def __reduce__(self) -> Any:
        ctypes.string_at(0)
        raise AssertionError("unreachable")
