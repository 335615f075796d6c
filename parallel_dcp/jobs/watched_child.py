"""A child process that imports transformers for a job, run under the job's memory limit.

The child is in the job's process tree, so what it holds counts against ``--memory-limit``
(docs/guarantees.md#the-memory-ceiling): it is read as it runs, and the job refused the moment it
passes the limit, before anything is written.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Callable

from parallel_dcp.engine.breach import anonymous_bytes
from parallel_dcp.errors import MemoryLimitExceeded

__all__ = ["run_within"]

# Long enough for a cold import of transformers and torch on a loaded node.
_READ_TIMEOUT = 300.0
# How often the child's memory is read against the limit (a read of /proc/<pid>/status: ~30 us).
_WATCH_EVERY = 0.02


def run_within(
    argv: list[str],
    given: bytes,
    env: dict[str, str],
    limit: int | None,
    over_limit: Callable[[int, int], MemoryLimitExceeded],
) -> subprocess.CompletedProcess[bytes]:
    """``argv`` run with ``given`` on its stdin, its memory (RssAnon + RssShmem: an exec'd process
    shares none of it) read every 20 ms; killed, and the job refused before anything is written
    (``over_limit(measured, limit)`` says why), once it passes ``limit``
    (docs/guarantees.md#the-memory-ceiling). Every child that imports transformers for a job runs so."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=err, env=env)
        peak = 0
        try:
            assert child.stdin is not None
            child.stdin.write(given)
            child.stdin.close()
            deadline = time.monotonic() + _READ_TIMEOUT
            while child.poll() is None:
                peak = max(peak, anonymous_bytes(child.pid))
                if limit is not None and peak > limit:
                    raise over_limit(peak, limit)
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(argv, _READ_TIMEOUT)
                time.sleep(_WATCH_EVERY)
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, child.returncode, out.read(), err.read())
