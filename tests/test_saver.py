"""parallel_dcp.Saver's own processes: its fork server started with it, shared by two Savers and
stopped with the last (nothing left at close, at the drop of an unclosed Saver, at a script's end),
importing the caller's packages; a fork of the caller refused. What its saves write and how they
fail is in tests/test_saver_saves.py, on a fork server kept for that module."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp

import parallel_dcp
from parallel_dcp.engine.remote_memory import RemoteBytes, refusal
from tests.conftest import assert_same


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    wide = torch.randn(64, 96)
    return {
        "model": {
            "w": torch.randn(128, 256),
            "bf16": torch.randn(300, 7).to(torch.bfloat16),
            "transposed": torch.randn(40, 24).t(),  # strided, storage exactly its bytes
            "strided": wide[:, ::3],  # a view with gaps: DCP copies it
            "rows": wide[10:20],  # a contiguous slice of a larger storage
            "scalar": torch.tensor(3.5),
            "empty": torch.empty(0, 4),
            "mask": torch.rand(33) > 0.5,
        },
        "step": 7,
        "name": "run",
        "lrs": [0.1, 0.01],
    }


def _stock_load(path: Path, like: dict[str, Any]) -> dict[str, Any]:
    out = {
        "model": {k: torch.empty_like(v, memory_format=torch.contiguous_format) for k, v in like["model"].items()},
        "step": 0,
        "name": "",
        "lrs": [0.0, 0.0],
    }
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


def _workers(saver: parallel_dcp.Saver) -> set[int]:
    pool = saver._live()._pool
    assert pool is not None
    return set(pool.pids)


def test_a_fork_of_the_caller_cannot_use_the_saver(tmp_path: Path) -> None:
    with parallel_dcp.Saver(workers=1) as saver:
        pid = os.fork()
        if pid == 0:  # the child: refused with a clear error; closing touches nothing of the parent's
            code = 1
            try:
                saver.save({"w": torch.ones(2)}, tmp_path / "child")
            except RuntimeError as exc:
                code = 0 if "belongs to process" in str(exc) else 2
            saver.close()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        saver.save({"w": torch.ones(2)}, tmp_path / "parent")  # the parent's workers are intact
    assert not (tmp_path / "child").exists()
    with pytest.raises(RuntimeError, match="closed"):
        saver.save({"w": torch.ones(2)}, tmp_path / "late")


def test_closing_leaves_no_process(tmp_path: Path) -> None:
    me = psutil.Process()
    with parallel_dcp.Saver(workers=2) as saver:
        assert len(me.children(recursive=True)) >= 3  # the fork server and two workers
        saver.save({"w": torch.ones(2)}, tmp_path / "ckpt")
    assert [c for c in me.children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE] == []


def test_a_saver_dropped_unclosed_stops_its_workers(tmp_path: Path) -> None:
    me = psutil.Process()
    saver = parallel_dcp.Saver(workers=2)
    saver.save({"w": torch.ones(2)}, tmp_path / "ckpt")
    workers = _workers(saver)
    del saver
    gc.collect()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in workers)
    assert [c for c in me.children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE] == []


def test_reading_another_process_is_refused_with_the_reason() -> None:
    held = bytearray(b"abc")
    assert refusal(RemoteBytes.of(held), b"abc") is None
    assert refusal(RemoteBytes.of(held), b"xyz") == "process_vm_readv copied other bytes than the coordinator holds"
    gone = psutil.Popen(["true"])
    gone.wait()
    why = refusal(RemoteBytes(gone.pid, RemoteBytes.of(held).address, 3), b"abc")
    assert why is not None and why.startswith("process_vm_readv is refused (No such process)")


def test_two_savers_share_the_fork_server_and_closing_one_leaves_the_other_working(tmp_path: Path) -> None:
    """The workers are the fork server's children and die with it: it stops with the last user."""
    sd = _state()
    first = parallel_dcp.Saver(workers=1)
    with parallel_dcp.Saver(workers=1) as second:
        first.close()
        result = second.save(sd, tmp_path / "ckpt")
        assert result.executor == "saver"
    assert_same(_stock_load(tmp_path / "ckpt", sd), sd)
    assert not psutil.Process().children()


class _IntervalToFile:
    """A value its worker pickles: writes the worker's switch interval to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __getstate__(self) -> dict[str, Any]:
        Path(self.path).write_text(repr(sys.getswitchinterval()))
        return {"path": self.path}


def test_a_save_forked_per_call_also_takes_the_gil_back_promptly_and_restores_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many small tensors go to workers forked for the save, coordinated from this thread: it
    runs the job under the lowered switch interval too (beside a busy thread it waited 5 ms at
    each wake-up); the workers forked meanwhile switch at the caller's interval, and the caller's
    interval is back after."""
    from parallel_dcp.engine.prompt_gil import COORDINATOR_SWITCH_S
    from parallel_dcp.jobs import save as save_job

    seen: list[float] = []
    run_job = save_job.run_job

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(sys.getswitchinterval())
        return run_job(*args, **kwargs)

    monkeypatch.setattr(save_job, "run_job", spy)
    before = sys.getswitchinterval()
    sd: dict[str, Any] = {f"w{i}": torch.full((4,), float(i)) for i in range(50)}
    sd["probe"] = _IntervalToFile(str(tmp_path / "worker-interval"))
    result = parallel_dcp.save(sd, tmp_path / "ckpt", workers=2)
    assert result.executor == "processes"
    assert seen == [COORDINATOR_SWITCH_S]
    assert float((tmp_path / "worker-interval").read_text()) == before
    assert sys.getswitchinterval() == before
    out = {k: torch.empty_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    dcp.load(out, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert_same(out, {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)})


def test_the_fork_server_imports_the_callers_packages_not_those_of_its_working_directory(tmp_path: Path) -> None:
    """A script run from a directory holding another ``parallel_dcp`` (another checkout, or one
    planted in /tmp): the Saver's fork server, a fresh interpreter, imports the caller's package
    from the caller's sys.path, never the one in its working directory."""
    import subprocess

    planted = tmp_path / "cwd" / "parallel_dcp"
    planted.mkdir(parents=True)
    marker = tmp_path / "imported"
    (planted / "__init__.py").write_text(f"open({str(marker)!r}, 'a').write('planted')\nraise ImportError('planted')\n")
    script = tmp_path / "save.py"
    script.write_text(
        "import sys, torch, parallel_dcp\n"
        "with parallel_dcp.Saver(workers=1) as saver:\n"
        "    result = saver.save({'a': torch.arange(4.0)}, sys.argv[1])\n"
        "print(parallel_dcp.__file__, result.tasks)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env["PYTHONPATH"] = str(Path(parallel_dcp.__file__).parent.parent)  # this checkout, as the suite imports it
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        cwd=planted.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert not marker.exists(), "the fork server imported the package in its working directory"
    assert_same(parallel_dcp.load(tmp_path / "ckpt"), {"a": torch.arange(4.0)})


def test_a_saver_left_open_at_the_programs_end_exits_quietly_and_leaves_no_process(tmp_path: Path) -> None:
    """A script that never closes its Saver: at the interpreter's exit, multiprocess may remove the
    fork server's socket before the Saver's finalizer stops the server; the exit stays quiet (no
    traceback), and no process of ours is left behind."""
    import subprocess

    script = tmp_path / "unclosed.py"
    script.write_text(
        "import sys, psutil, torch, parallel_dcp\n"
        "saver = parallel_dcp.Saver(workers=1)\n"
        "saver.save({'a': torch.arange(4.0)}, sys.argv[1])\n"
        "print(*[p.pid for p in psutil.Process().children(recursive=True)], flush=True)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(parallel_dcp.__file__).parent.parent))
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    started = [int(pid) for pid in done.stdout.split()]
    assert len(started) >= 2  # the fork server and the worker, at least
    left = [pid for pid in started if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert left == []  # each stopped at the exit, not re-parented to init
    assert_same(parallel_dcp.load(tmp_path / "ckpt"), {"a": torch.arange(4.0)})
