"""parallel_dcp.Saver: workers started once, reused by every save, same files as parallel_dcp.save."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp

import parallel_dcp
from parallel_dcp import MemoryLimitExceeded, WorkerCrashed
from parallel_dcp._compat import fork_server_pid
from parallel_dcp.engine.ready import wait_ready
from parallel_dcp.engine.remote_memory import RemoteBytes, refusal
from tests.conftest import assert_same, shards_by_task

MiB = 2**20


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


def test_saves_reuse_the_workers_and_write_what_save_writes(tmp_path: Path) -> None:
    sd = _state()
    with parallel_dcp.Saver(workers=2) as saver:
        started = _workers(saver)
        first = saver.save(sd, tmp_path / "first")
        with torch.no_grad():  # a training step between checkpoints: updated in place
            for tensor in sd["model"].values():
                if tensor.is_floating_point():
                    tensor.mul_(2)
        second = saver.save(sd, tmp_path / "second")
        assert _workers(saver) == started  # no worker was started for either save
    assert first.executor == second.executor == "saver"
    assert second.phases["fork"] < second.seconds
    reference = parallel_dcp.save(sd, tmp_path / "reference", workers=2, executor="processes")
    assert second.tasks == reference.tasks and second.bytes == reference.bytes
    assert shards_by_task(tmp_path / "second") == shards_by_task(
        tmp_path / "reference"
    )  # the fresh bytes, not stale ones
    assert_same(_stock_load(tmp_path / "second", sd), sd)
    assert parallel_dcp.verify(tmp_path / "second").ok
    assert shards_by_task(tmp_path / "first") != shards_by_task(tmp_path / "second")


def test_split_tensors_are_read_chunk_by_chunk(tmp_path: Path) -> None:
    sd = {"big": torch.randn(512, 1024), "cols": torch.randn(256, 2048)[:, :1024], "small": torch.ones(3)}
    with parallel_dcp.Saver(workers=3) as saver:
        result = saver.save(sd, tmp_path / "ckpt", chunk_size="256KiB")
    assert result.tasks >= 3
    assert_same(parallel_dcp.load(tmp_path / "ckpt"), sd)


def test_a_crashed_worker_fails_the_save_and_the_next_save_starts_new_workers(tmp_path: Path) -> None:
    sd = {"w": torch.ones(8), "bomb": ExitOnArrival(3)}
    with parallel_dcp.Saver(workers=2) as saver:
        before = _workers(saver)
        with pytest.raises(WorkerCrashed, match="exit code 3"):
            saver.save(sd, tmp_path / "broken")
        assert not (tmp_path / "broken").exists() or not any((tmp_path / "broken").iterdir())
        result = saver.save({"w": torch.ones(8)}, tmp_path / "ok")
        after = _workers(saver)
        assert not before & after
        assert result.phases["fork"] > 0
    assert_same(parallel_dcp.load(tmp_path / "ok"), {"w": torch.ones(8)})


def test_a_worker_that_allocates_past_the_limit_is_stopped(tmp_path: Path) -> None:
    sd = {"w": torch.ones(8), "hog": HogOnArrival(400 * MiB, hold_s=600)}
    with parallel_dcp.Saver(workers=2, memory_limit="128MiB") as saver:
        stopped = r"worker \d \(pid \d+\) pushed the job to .* over the memory limit"
        with pytest.raises(MemoryLimitExceeded, match=stopped):
            saver.save(sd, tmp_path / "ckpt")
        assert list(tmp_path.iterdir()) == []
        saver.save({"w": torch.ones(8)}, tmp_path / "ckpt")  # new workers, under the same limit
    assert_same(parallel_dcp.load(tmp_path / "ckpt"), {"w": torch.ones(8)})


def test_ctrl_c_during_a_save_stops_it_and_the_next_save_starts_new_workers(tmp_path: Path) -> None:
    sd = {"w": torch.ones(8), "slow": SleepOnArrival(600)}
    with parallel_dcp.Saver(workers=2) as saver:
        before = _workers(saver)
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                saver.save(sd, tmp_path / "ckpt")
        finally:
            timer.cancel()
        assert list(tmp_path.iterdir()) == []
        assert not any(
            psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in before
        )
        saver.save({"w": torch.ones(8)}, tmp_path / "ckpt")
        assert not before & _workers(saver)
    assert_same(parallel_dcp.load(tmp_path / "ckpt"), {"w": torch.ones(8)})


def test_an_item_over_the_limit_fails_before_any_write(tmp_path: Path) -> None:
    # The limit leaves room for the two workers' planned resting cost (WORKER_MEMORY_BYTES each).
    with parallel_dcp.Saver(workers=2, memory_limit="48MiB") as saver:
        with pytest.raises(MemoryLimitExceeded, match=r"'big' needs .* more than the memory limit 48\.0 MiB"):
            # a view with gaps: its 128 MiB span copied by a worker, then DCP's 64 MiB copy; never split
            saver.save({"big": torch.zeros(32 * MiB)[::2]}, tmp_path / "ckpt", chunk_size="1GiB")
        assert list(tmp_path.iterdir()) == []
        saver.save({"w": torch.ones(4)}, tmp_path / "ckpt")  # the workers are still there to use


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


class ExitOnArrival:
    """Pickles fine in the caller; a worker that unpickles it exits with ``code``."""

    def __init__(self, code: int) -> None:
        self.code = code

    def __reduce__(self) -> Any:
        return (os._exit, (self.code,))


def _hog(nbytes: int, hold_s: float) -> bytearray:
    held = bytearray(nbytes)
    for offset in range(0, nbytes, 4096):  # touched: resident
        held[offset] = 1
    time.sleep(hold_s)
    return held


class HogOnArrival:
    """Pickles fine in the caller; a worker that unpickles it allocates ``nbytes`` and holds them."""

    def __init__(self, nbytes: int, hold_s: float) -> None:
        self.nbytes, self.hold_s = nbytes, hold_s

    def __reduce__(self) -> Any:
        return (_hog, (self.nbytes, self.hold_s))


class SleepOnArrival:
    """Pickles fine in the caller; a worker that unpickles it sleeps ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self) -> Any:
        return (time.sleep, (self.seconds,))


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


class _SwitchProbe:
    """A value pickled by the coordinator: notes the switch interval while the save runs."""

    seen: ClassVar[list[float]] = []

    def __getstate__(self) -> dict[str, Any]:
        _SwitchProbe.seen.append(sys.getswitchinterval())
        return {}


def test_the_coordinator_takes_the_gil_back_promptly_during_a_save_and_restores_it(tmp_path: Path) -> None:
    from parallel_dcp.engine.prompt_gil import COORDINATOR_SWITCH_S

    before = sys.getswitchinterval()
    assert before > COORDINATOR_SWITCH_S
    _SwitchProbe.seen.clear()
    with parallel_dcp.Saver(workers=1) as saver:
        saver.save({"w": torch.ones(4), "probe": _SwitchProbe()}, tmp_path / "ckpt")
    assert _SwitchProbe.seen and set(_SwitchProbe.seen) == {COORDINATOR_SWITCH_S}
    assert sys.getswitchinterval() == before


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


def test_a_later_saves_baseline_is_never_above_what_the_tree_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each save's governor subtracts its baseline from every reading. Read from the counters'
    upper bound, it charged each idle worker the buffers it had freed after its last task (and the
    code its first tasks paged in): here 30-32 MiB over the truth (about 8 MiB a worker), an under-count of the
    whole save once they were read again. Now each idle process (the fork server and the workers)
    is charged within a slack of the truth (above it only by file pages paged in since its last
    full reading, under the slack: code or a data file's, only a full listing tells), and from a
    later save on from what the workers read of themselves as they went idle: their counters."""
    from parallel_dcp.engine import process_memory

    baselines: list[dict[int, tuple[int, int]]] = []  # per save: pid -> (how, charged)
    expecting: dict[int, int] = {}
    plan, charge = process_memory.ChargeReader.plan, process_memory.ChargeReader.charge

    def spy_plan(self: Any, pids: Any, **kw: Any) -> list[int]:
        how = plan(self, pids, **kw)
        expecting.clear()
        if kw.get("baseline"):
            expecting.update(zip(pids, how, strict=True))
            baselines.append({})
        return how

    def spy_charge(self: Any, pid: int, how: int) -> tuple[int, int]:
        got = charge(self, pid, how)
        if expecting.pop(pid, None) is not None:
            baselines[-1][pid] = (how, got[0])
        return got

    monkeypatch.setattr(process_memory.ChargeReader, "plan", spy_plan)
    monkeypatch.setattr(process_memory.ChargeReader, "charge", spy_charge)
    sd = {f"t{i}": torch.randn(2 * MiB) for i in range(8)}  # 8 MiB each, two a worker
    slack = process_memory._FAULT_SLACK
    idle: dict[int, int] = {}  # the fork server's and each worker's charge after a save
    with parallel_dcp.Saver(workers=4) as saver:
        for n in range(4):
            saver.save(sd, tmp_path / f"ckpt{n}")
            server = fork_server_pid()
            # this save's baseline against what the same processes held, idle, after the last one
            for pid, (_, charged) in baselines[-1].items():
                if pid in idle:
                    # the fork server gains the shares of pages its workers copy, its counters still:
                    # it may lag by what they gave up, up to a slack a process of the reading (6)
                    under = slack * len(baselines[-1]) if pid == server else slack
                    assert idle[pid] - under <= charged <= idle[pid] + slack, (n, pid, charged, idle[pid])
            pool = saver._workers._pool  # type: ignore[union-attr]
            for worker in pool._owed_charges:  # each has read itself (asked as the save ended): idle now
                assert wait_ready([pool._conns[worker]], 30)
            idle = {pid: process_memory.charged_memory(pid)[0] for pid in [server, *_workers(saver)] if pid}
    assert len(baselines) == 4 and sum(pid in idle for pid in baselines[-1]) == 5
    workers = [how for pid, (how, _) in baselines[-1].items() if pid in idle and pid != server]
    assert workers == [process_memory.LOWER] * 4
