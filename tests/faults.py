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
        import faulthandler

        faulthandler.disable()  # pytest's handler would dump this expected crash into the test log
        ctypes.string_at(0)
        raise AssertionError("unreachable")


class AllocateInWorker:
    """Grows the worker's private memory by ``nbytes`` (pages touched), then holds it."""

    def __init__(self, nbytes: int, hold_s: float = 30.0) -> None:
        self.nbytes = nbytes
        self.hold_s = hold_s

    def __reduce__(self) -> Any:
        import time

        chunks = []
        step = 16 * 1024 * 1024
        for _ in range(0, self.nbytes, step):
            chunks.append(bytearray(b"x" * step))
            time.sleep(0.01)
        time.sleep(self.hold_s)
        raise AssertionError(f"the memory governor let {len(chunks)} chunks live")


class MarkThenHold:
    """Creates the file ``marker`` once a worker pickles it (its task has started), then holds the
    task ``hold_s`` seconds and fails it."""

    def __init__(self, marker: str, hold_s: float = 60.0) -> None:
        self.marker = marker
        self.hold_s = hold_s

    def __reduce__(self) -> Any:
        import time

        with open(self.marker, "w"):
            pass
        time.sleep(self.hold_s)
        raise AssertionError("the memory governor let the job run past its limit")


class SleepInWorker:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self) -> Any:
        import time

        time.sleep(self.seconds)
        return (str, ("slept",))


class KillOnce:
    """SIGKILLs the first worker that pickles it; later attempts succeed and save the string 'ok'."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        if not os.path.exists(self.marker):
            with open(self.marker, "w"):
                pass
            os.kill(os.getpid(), signal.SIGKILL)
        return (str, ("ok",))


class FillDisk:
    """Fills the file system holding ``path`` (by writing ``path``) from inside a worker."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        with open(self.path, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        return (str, ("filled",))


class CreateInWorker:
    """Creates files (bytes) and directories (None) while a worker writes: another writer acting
    behind the save's back. Saved as the string 'created' once it has run."""

    def __init__(self, paths: dict[str, bytes | None]) -> None:
        self.paths = paths

    def __reduce__(self) -> Any:
        for path, data in self.paths.items():
            if data is None:
                os.makedirs(path, exist_ok=True)
            else:
                with open(path, "wb") as f:
                    f.write(data)
        return (str, ("created",))


class PutObjectInWorker:
    """Uploads an object to S3 from a worker (another writer under the same prefix), then raises."""

    def __init__(self, url: str, endpoint: str) -> None:
        self.url = url
        self.endpoint = endpoint

    def __reduce__(self) -> Any:
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=self.endpoint).pipe(self.url, b"another writer")
        raise RuntimeError("injected failure after another writer's upload")


class RunsCode:
    """A hostile value: unpickling it creates ``marker`` (it would run any code the same way)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (exec, (f"open({self.marker!r}, 'w').close()",))


class WaitForFile:
    """Holds its worker until ``path`` exists (at most ``limit_s``), then saves the string 'released'."""

    def __init__(self, path: str, limit_s: float = 60.0) -> None:
        self.path = path
        self.limit_s = limit_s

    def __reduce__(self) -> Any:
        import time

        deadline = time.monotonic() + self.limit_s
        while not os.path.exists(self.path) and time.monotonic() < deadline:
            time.sleep(0.02)
        return (str, ("released",))
