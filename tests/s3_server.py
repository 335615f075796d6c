"""A real S3-compatible server for the tests: moto's server mode, on 127.0.0.1, on a free port.

The server runs detached from the test process (started through a short-lived launcher, so it is
not a child): its objects live in its own memory, and neither the memory ceiling of a job nor the
tests' no-surviving-child check sees it. It stops when told to, or by itself once the test
process that started it is gone, so a crashed test run leaves nothing behind.

Run as a script (by :func:`moto_server` only): ``python s3_server.py PORT OWNER_PID``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress

# Dummy credentials: moto accepts any; s3fs and botocore read them from the environment.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}

_LAUNCHER = (
    "import subprocess, sys; "
    "p = subprocess.Popen(sys.argv[1:], start_new_session=True, "
    "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def moto_server() -> Iterator[str]:
    """Start moto's S3 server and yield its endpoint URL; stop it afterwards."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    command = [sys.executable, os.path.abspath(__file__), str(port), str(os.getpid())]
    launched = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, *command],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **CREDENTIALS},
    )
    pid = int(launched.stdout.strip())
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start on {endpoint}") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


@contextmanager
def moto_endpoint() -> Iterator[str]:
    """A moto server's URL, with its credentials in the environment (and no other endpoint or
    profile) while it runs; the environment as it was afterwards."""
    saved = {name: os.environ.get(name) for name in [*CREDENTIALS, "AWS_ENDPOINT_URL", "AWS_PROFILE"]}
    os.environ.update(CREDENTIALS)
    os.environ.pop("AWS_ENDPOINT_URL", None)  # the endpoint is given explicitly unless a test sets it
    os.environ.pop("AWS_PROFILE", None)
    try:
        with moto_server() as url:
            yield url
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _serve(port: int, owner: int) -> None:
    import psutil
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while psutil.pid_exists(owner):
            time.sleep(0.5)
    finally:
        server.stop()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
