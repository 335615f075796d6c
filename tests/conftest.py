from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@pytest.fixture(scope="session", autouse=True)
def private_tmpdir() -> Iterator[Path]:
    """TMPDIR for the session (and every subprocess it starts), removed at its end.

    Tests write under tmp_path, which pytest cleans (pyproject: retention "failed"); this catches
    what library code or a subprocess writes to the temporary directory on its own
    (``tempfile.mkdtemp`` for a torch.save source read from object storage, a stock save in a
    CLI run), so a green run leaves nothing in /tmp.
    """
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    path = Path(tempfile.mkdtemp(prefix="parallel_dcp-tests-"))
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = None  # re-read TMPDIR
    try:
        yield path
    finally:
        if saved[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved[0]
        tempfile.tempdir = saved[1]
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def sigint_delivered() -> None:
    """The Ctrl-C tests need SIGINT to arrive, as it does from a terminal. A suite started in the
    background by a shell without job control (``tools/test &``, ``nohup``) inherits SIGINT
    ignored, and every process it starts would too: the test process takes Python's own handler
    back (its children, started by exec, then begin with SIGINT's default action)."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# The fork server and resource tracker a module's kept_fork_server started: they outlive each
# test by design (every worker forked from the server must still be gone).
_kept_servers: set[int] = set()


@pytest.fixture(autouse=True)
def no_child_survives() -> Iterator[None]:
    """Every worker a test starts must be gone (joined) when the test ends (the workers
    ``save`` keeps between calls are stopped first: a test's save may have started them)."""
    yield
    from parallel_dcp.jobs import shared_workers

    shared_workers.stop()
    me = psutil.Process(os.getpid())
    deadline = time.monotonic() + 2.0

    def survivors() -> list[psutil.Process]:
        return [
            c
            for c in me.children(recursive=True)
            if c.pid not in _kept_servers and c.is_running() and c.status() != psutil.STATUS_ZOMBIE
        ]

    children = survivors()
    while children and time.monotonic() < deadline:
        time.sleep(0.05)
        children = survivors()
    assert not children, f"child processes survived the test: {[c.pid for c in children]}"


@pytest.fixture(scope="module")
def kept_fork_server() -> Iterator[None]:
    """multiprocess's fork server (and its resource tracker) started once for a module whose tests
    open Savers, with the modules a Saver preloads. A Saver that finds them running uses them and
    leaves them running at close, as it does a caller's own (jobs/saver.py, ``_ServerUsers``): its
    workers are forked in milliseconds, where starting a server of its own imports torch and the
    writers (3-6 s on this VM) and stopping it takes another second. Only for modules that do not
    check the server's own start and stop; every worker forked from it must still be gone at the
    end of each test (no_child_survives)."""
    import multiprocess

    from parallel_dcp._compat import fork_server_pid, running_servers, stop_fork_server
    from parallel_dcp.engine.fork_server import start_fork_server
    from parallel_dcp.jobs import saver

    assert running_servers() == (False, False), "a fork server already runs: another module's was kept"
    assert not psutil.Process().children(), "no other child may be taken for the server or its tracker"
    preload = ["torch", "parallel_dcp.engine.pool", *saver._PRELOAD]  # what a Saver's own server imports
    multiprocess.get_context("forkserver").set_forkserver_preload(preload)
    start_fork_server()
    assert running_servers() == (True, True)
    _kept_servers.update(c.pid for c in psutil.Process().children())  # the server and the tracker
    assert fork_server_pid() in _kept_servers and len(_kept_servers) == 2
    try:
        yield
    finally:
        stop_fork_server((False, False))
        _kept_servers.clear()


def assert_same(actual: Any, expected: Any, path: str = "") -> None:
    """Bit-for-bit equality of nested state dicts (tensors compared byte by byte, dtype and shape too)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: {type(actual).__name__} is not a tensor"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        a = actual.contiguous().reshape(-1).view(torch.uint8) if actual.numel() else actual
        e = expected.contiguous().reshape(-1).view(torch.uint8) if expected.numel() else expected
        assert torch.equal(a, e), f"{path}: bytes differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), f"{path}: keys differ"
        for k in expected:
            assert_same(actual[k], expected[k], f"{path}.{k}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), f"{path}: lists differ"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{path}.{i}")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def empty_like_state(sd: Any) -> Any:
    """A preallocated target for stock dcp.load: same structure, fresh tensors, placeholder values."""
    if isinstance(sd, torch.Tensor):
        return torch.empty_like(sd, memory_format=torch.contiguous_format)
    if isinstance(sd, dict):
        return {k: empty_like_state(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [empty_like_state(v) for v in sd]
    return None


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    """A directory where O_DIRECT works (tmp_path on a block file system), else skip."""
    from parallel_dcp.storage import io_mode

    refusal = io_mode.direct_refusal(tmp_path)
    if refusal is not None:
        pytest.skip(f"no O_DIRECT here: {refusal}")
    return tmp_path


def shards_by_task(path: Path) -> dict[int, bytes]:
    """A DCP checkpoint's shard bytes by task index (names carry the save id, which differs
    between saves, so two saves compare by task)."""
    import re

    found = {}
    for shard in path.glob("*.distcp"):
        match = re.fullmatch(r"__(\d+)_\w+_0\.distcp", shard.name)
        assert match, shard.name
        found[int(match.group(1))] = shard.read_bytes()
    return found


def finished_task_records(out: Path) -> list[str]:
    """The done records of a conversion's finished tasks in ``out``: sealed ones only (a ``.tmp``
    record is still being written, and a kill then leaves its task unfinished)."""
    return sorted(n for n in os.listdir(out) if n.startswith(".parallel_dcp.done.") and not n.endswith(".tmp"))


def save_with_a_stale_manifest(src: Path) -> None:
    """At ``src``, a save of ``w`` = ones whose record is the save before's (zeros): what a save
    stopped between its commit's two renames leaves (the new ``.metadata``, the old manifest)."""
    import parallel_dcp

    parallel_dcp.save({"w": torch.zeros(64)}, src, workers=1)
    old_manifest = (src / ".parallel_dcp.json").read_bytes()
    parallel_dcp.save({"w": torch.ones(64)}, src, workers=1, overwrite=True)
    (src / ".parallel_dcp.json").write_bytes(old_manifest)
