"""What a review of a Saver's and save()'s lifetime broke (round four), each pinned by a test:
two threads saving on one Saver took each other's replies (a checkpoint committed without the
other's shards, reported as a success); a worker killed while a stale plan's tasks were drained
surfaced as a bare EOFError; a fork of the caller that exited normally killed the parent's
workers; a Ctrl-C while an overwrite published left the old shards behind for good; a Saver under a tight
memory limit stopped a save that ``save()`` completes; a nested tensor, or a value a Saver cannot
pickle, failed without naming it; a sharded folder whose index disagreed with its shards converted
without the keys they disagreed on; a damaged later source of several failed after the earlier
outputs were committed; a resume failed under the memory limit its fresh run fits under."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader

import parallel_dcp
from parallel_dcp.engine import pool as pool_module
from parallel_dcp.engine.memory import COORDINATOR_RUN_BYTES
from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.pool import WorkerPool
from parallel_dcp.engine.remote_memory import read_into
from parallel_dcp.errors import CorruptCheckpointError, InvalidStateDictError, WorkerCrashed
from parallel_dcp.jobs import saver as saver_module
from parallel_dcp.storage.local_staging import LocalDirStaging
from tests.conftest import assert_same
from tests.fresh_interpreter import run_fresh

# Savers in seven tests: their workers are forked from one fork server kept for the module. None
# checks the server's own start or stop; the fork of the caller runs in a fresh interpreter, with a
# server of its own.
pytestmark = pytest.mark.usefixtures("kept_fork_server")


def _state(seed: int, keys: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, 1024, generator=g) for i in range(keys)}


def _stock_load(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(out, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return out


def test_saves_from_two_threads_on_one_saver_run_one_at_a_time(tmp_path: Path) -> None:
    states = [_state(0), _state(1), {f"other{i}": torch.randn(300, 100) for i in range(5)}]
    errors: list[BaseException] = []
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(states[0], tmp_path / "warm")  # its layout kept: the next saves dispatch ahead
        for round_ in range(4):
            barrier = threading.Barrier(len(states))

            def run(i: int, r: int = round_, b: threading.Barrier = barrier) -> None:
                b.wait()
                try:
                    saver.save(states[i], tmp_path / f"{r}-{i}")
                except BaseException as exc:  # reported below
                    errors.append(exc)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(states))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            assert not any(t.is_alive() for t in threads)
    assert errors == []
    for round_ in range(4):
        for i, state in enumerate(states):
            assert_same(_stock_load(tmp_path / f"{round_}-{i}", state), state)


def test_a_save_from_inside_a_save_of_the_same_saver_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inner: list[BaseException] = []
    with parallel_dcp.Saver(workers=1) as saver:
        original = saver_module.SaverWorkers._save_here

        def reentrant(self: Any, *args: Any) -> Any:
            try:
                saver.save(_state(2, 2), tmp_path / "inner")
            except RuntimeError as exc:
                inner.append(exc)
            return original(self, *args)

        monkeypatch.setattr(saver_module.SaverWorkers, "_save_here", reentrant)
        saver.save(_state(3, 2), tmp_path / "outer")
    assert len(inner) == 1 and "inside a save" in str(inner[0])
    assert not (tmp_path / "inner").exists()
    assert_same(_stock_load(tmp_path / "outer", _state(3, 2)), _state(3, 2))


class _StaleThenSlow:
    """Task 0 reads unmapped memory at once (a stale plan); task 1 sleeps, long enough to be killed."""

    def __call__(self, task: Task) -> int:
        if task.index == 0:
            out = ctypes.create_string_buffer(16)
            read_into(os.getpid(), 8, 16, ctypes.addressof(out))
        time.sleep(30)
        return task.index


def test_a_worker_killed_while_a_stale_plan_is_drained_is_a_worker_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    """The drain found the dead worker's pipe readable (at its end) and read it: a bare EOFError.
    (The kernel may report the process's end before its pipe's: the drain's look at the pipe is
    made to come late enough to see it, as it did in the review's runs.)"""
    real = pool_module.wait_ready

    def late(waitables: Any, timeout: float | None) -> list[Any]:
        if timeout == 0:
            time.sleep(0.2)
        return real(waitables, timeout)

    monkeypatch.setattr(pool_module, "wait_ready", late)
    with WorkerPool(2, _StaleThenSlow()) as workers:
        victim = workers.pids[1]
        timer = threading.Timer(1.0, os.kill, (victim, signal.SIGKILL))
        timer.start()
        try:
            with pytest.raises(WorkerCrashed, match=f"pid {victim}"):
                list(workers.run([Task(0, ("a",), 1), Task(1, ("b",), 1)]))
        finally:
            timer.cancel()
            timer.join()


def fork_exits_then_save(root: str) -> dict[str, Any]:
    """(Run in a fresh interpreter.) A Saver's save; a fork of the caller that exits normally
    (its atexit hooks run); the Saver's next save. What happened to the workers and that save."""
    import psutil

    sd = _state(4, 4)
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(sd, f"{root}/a")
        before = sorted(p.pid for p in psutil.Process().children(recursive=True))
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a child that does nothing with the Saver and exits normally
        os.waitpid(pid, 0)
        after = sorted(p.pid for p in psutil.Process().children(recursive=True))
        try:
            saver.save(sd, f"{root}/b")
            error = None
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    return {"before": before, "after": after, "error": error}


def test_a_fork_of_the_caller_that_exits_leaves_the_parents_workers_alone(tmp_path: Path) -> None:
    """multiprocess's atexit hook in the fork SIGTERMed every worker it had inherited as a child."""
    outcome = run_fresh("tests.test_review_round4", "fork_exits_then_save", str(tmp_path))
    assert outcome["error"] is None
    assert outcome["after"] == outcome["before"]
    assert_same(_stock_load(tmp_path / "b", _state(4, 4)), _state(4, 4))


def _referenced(path: Path) -> set[str]:
    """The shard files ``path``'s ``.metadata`` names."""
    metadata = FileSystemReader(str(path)).read_metadata()
    return {info.relative_path for info in metadata.storage_data.values()}


@pytest.mark.parametrize("saver", [False, True], ids=["save", "Saver"])
def test_ctrl_c_while_an_overwrite_publishes_is_held_until_it_is_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saver: bool
) -> None:
    """A Ctrl-C after the commit, while the old shards were being deleted, left them (and the
    owner record) behind for good, and the save raised as if nothing had been committed."""
    old, new = _state(5), _state(6)
    path = tmp_path / "ck"
    parallel_dcp.save(old, path, workers=2)
    old_shards = _referenced(path)
    publish = LocalDirStaging.publish

    def interrupted(self: Any) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as the deleting begins
        time.sleep(0.05)
        publish(self)

    monkeypatch.setattr(LocalDirStaging, "publish", interrupted)
    with pytest.raises(KeyboardInterrupt) as raised:
        if saver:
            with parallel_dcp.Saver(workers=2) as s:
                s.save(new, path, overwrite=True)
        else:
            parallel_dcp.save(new, path, workers=2, overwrite=True)
    assert "holds the new checkpoint" in "".join(getattr(raised.value, "__notes__", []))
    assert_same(_stock_load(path, new), new)
    shards = {p.name for p in path.iterdir() if p.name.endswith(".distcp")}
    assert shards == _referenced(path) and not shards & old_shards
    assert not [p.name for p in path.iterdir() if "owner" in p.name]


def test_a_saver_under_a_tight_limit_completes_what_save_completes(disk: Path) -> None:
    """Its workers kept their direct-write buffers (32 MiB each) between files, counted nowhere:
    under 50 MB the watchdog stopped, in its middle, a save that ``save()`` completes."""
    tmp_path = disk
    big = {"one": torch.randn(50 * 2**20)}  # 200 MiB
    limit = 50 * 10**6 + COORDINATOR_RUN_BYTES  # (the coordinator's own growth, planned since)
    plain = parallel_dcp.save(big, tmp_path / "plain", workers=2, memory_limit=limit, executor="processes")
    assert plain.peak_memory <= limit
    with parallel_dcp.Saver(workers=2, memory_limit=limit) as saver:
        for name in ("first", "later"):
            result = saver.save(big, tmp_path / name, io="direct")  # (auto may measure buffered faster)
            assert result.peak_memory <= limit
            assert_same(_stock_load(tmp_path / name, big), big)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
@pytest.mark.parametrize("saver", [False, True], ids=["save", "Saver"])
def test_a_nested_tensor_is_refused_by_name_before_anything_is_written(
    tmp_path: Path, saver: bool, layout: torch.layout
) -> None:
    """It reached torch's own "Internal error ... please file an issue" (its shape cannot be read)."""
    nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=layout)
    sd = {"nt": nested, "x": torch.randn(3)}
    with pytest.raises(InvalidStateDictError, match="'nt' is a nested tensor"):
        if saver:
            with parallel_dcp.Saver(workers=1) as s:
                s.save(sd, tmp_path / "out")
        else:
            parallel_dcp.save(sd, tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()


def test_an_unpicklable_value_in_a_saver_is_named(tmp_path: Path) -> None:
    """A Saver pickles each task's values itself: a bare TypeError naming nothing."""
    sd: dict[str, Any] = {"w": torch.randn(10), "lock": threading.Lock()}
    with parallel_dcp.Saver(workers=1) as saver:
        with pytest.raises(InvalidStateDictError, match="value 'lock' cannot be pickled"):
            saver.save(sd, tmp_path / "out")
        assert not (tmp_path / "out").exists()
        sd["lock"] = 5
        saver.save(sd, tmp_path / "out")  # the Saver saves on
    assert_same(parallel_dcp.load(tmp_path / "out"), sd)


def interrupted_in_a_fork_callback(root: str) -> dict[str, Any]:
    """(Run in a fresh interpreter: its fork callback stays registered.) A save that forks its
    workers, Ctrl-C landing while a fork callback runs, taken by another thread (which does not
    block SIGINT): what the save did."""
    sent: list[bool] = []

    def ctrl_c_once() -> None:
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs here, inside the callback

    os.register_at_fork(after_in_parent=ctrl_c_once)
    idle = threading.Event()
    other = threading.Thread(target=idle.wait, daemon=True)  # a thread that takes the signal
    other.start()
    try:
        parallel_dcp.save(_state(7, 4), f"{root}/ck", workers=2, executor="processes")
        raised = None
    except KeyboardInterrupt:
        raised = "KeyboardInterrupt"
    finally:
        idle.set()
    return {"sent": bool(sent), "raised": raised, "committed": os.path.exists(f"{root}/ck/.metadata")}


def test_ctrl_c_during_a_workers_fork_stops_the_save(tmp_path: Path) -> None:
    """Raised inside a fork callback, the KeyboardInterrupt was printed and dropped: the save committed."""
    outcome = run_fresh("tests.test_review_round4", "interrupted_in_a_fork_callback", str(tmp_path))
    assert outcome == {"sent": True, "raised": "KeyboardInterrupt", "committed": False}


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
@pytest.mark.parametrize("case", ["empty", "ghost", "wrong-shard"])
def test_an_index_that_disagrees_with_its_shards_is_refused(tmp_path: Path, kind: str, case: str) -> None:
    """An empty weight_map converted to a checkpoint of no key; a key the index names that no
    shard holds was left out; keys in other shards than the index says were taken anyway."""
    from safetensors.torch import save_file

    first, second = f"model-00001-of-00002.{kind}", f"model-00002-of-00002.{kind}"
    source = tmp_path / "model"
    source.mkdir()
    for name, key in ((first, "a"), (second, "b")):
        if kind == "safetensors":
            save_file({key: torch.ones(4)}, str(source / name))
        else:
            torch.save({key: torch.ones(4)}, source / name)
    weight_map = {
        "empty": {},
        "ghost": {"a": first, "b": second, "lm_head.weight": second},
        "wrong-shard": {"a": second, "b": first},
    }[case]
    index = "model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json"
    (source / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(
        CorruptCheckpointError, match="names no tensor" if case == "empty" else "disagrees with its shards"
    ):
        parallel_dcp.convert(source, tmp_path / "out", workers=2)
    assert not (tmp_path / "out").exists()
    (source / index).write_text(json.dumps({"metadata": {}, "weight_map": {"a": first, "b": second}}))
    parallel_dcp.convert(source, tmp_path / "out", workers=2)  # the index mended: converted
    assert sorted(parallel_dcp.load(tmp_path / "out")) == ["a", "b"]


@pytest.mark.parametrize("writer", ["stock", "ours"])
def test_verify_finds_records_of_another_dtype_than_their_metadata_says(tmp_path: Path, writer: str) -> None:
    """Another checkpoint's ``.metadata`` (same key and bytes, another dtype): load refused it,
    verify said OK (it reads back through stock's reader, which casts)."""
    import shutil

    record, claimed = tmp_path / "record", tmp_path / "claimed"
    for path, dtype in ((record, torch.bfloat16), (claimed, torch.float16)):
        sd = {"x": torch.arange(64).to(dtype)}
        if writer == "stock":
            dcp.save(sd, checkpoint_id=str(path), no_dist=True)
        else:
            parallel_dcp.save(sd, path, workers=1, checksums=False)
    shutil.copy(claimed / ".metadata", record / ".metadata")
    if writer == "ours":  # (its shard named as the other's: as if two saves had mixed)
        (shard,) = record.glob("*.distcp")
        (theirs,) = claimed.glob("*.distcp")
        shard.rename(record / theirs.name)
        for side in record.glob(".parallel_dcp.*"):
            side.unlink()
    with pytest.raises(CorruptCheckpointError, match="holds bfloat16"):
        parallel_dcp.load(record)
    report = parallel_dcp.verify(record)
    assert not report.ok
    assert any("holds bfloat16 [64] but .metadata says float16 [64]" in p for p in report.problems)


def test_a_damaged_later_source_fails_a_conversion_of_several_before_anything_is_written(tmp_path: Path) -> None:
    """The earlier sources were converted and committed first; the error did not say so, and the
    command run again (the bad source mended) refused their outputs as existing checkpoints."""
    torch.save({"w": torch.ones(2)}, tmp_path / "good.pt")
    (tmp_path / "bad.pt").write_bytes(b"garbage")
    with pytest.raises(CorruptCheckpointError, match=r"bad\.pt"):
        parallel_dcp.convert([tmp_path / "good.pt", tmp_path / "bad.pt"], tmp_path / "out")
    assert not (tmp_path / "out" / "good").exists()
    (tmp_path / "bad.pt").write_bytes((tmp_path / "good.pt").read_bytes())
    results = parallel_dcp.convert([tmp_path / "good.pt", tmp_path / "bad.pt"], tmp_path / "out")
    assert [r.keys for r in results] == [1, 1]


# (40 MiB when written; + the coordinator's own 3 MiB, engine.memory.COORDINATOR_RUN_BYTES, planned
# since: the same plan of 48 tasks on 2 workers.)
_TIGHT: dict[str, Any] = {"workers": 2, "chunk_size": "256KiB", "io": "buffered", "memory_limit": "43MiB"}


def fail_under_a_tight_limit(root: str) -> int:
    """(Run in a fresh interpreter.) A conversion under 40 MiB that fails at its task 20 (as
    ENOSPC would): how many of its files it left for a resume."""
    from safetensors.torch import save_file

    from parallel_dcp.jobs import targets

    g = torch.Generator().manual_seed(0)
    save_file({f"layer{i}.w": torch.randn(512, 1024, generator=g) for i in range(18)}, f"{root}/m.safetensors")
    original = targets.DcpTarget.write

    def write(self: Any, job: Any, task: Any, *rest: Any) -> Any:
        if task.index >= 20:
            raise OSError(28, "No space left on device (injected)")
        return original(self, job, task, *rest)

    targets.DcpTarget.write = write  # type: ignore[method-assign,assignment]
    with contextlib.suppress(Exception):
        parallel_dcp.convert(f"{root}/m.safetensors", f"{root}/out", **_TIGHT)
    return len(os.listdir(f"{root}/out"))


def resume_under_a_tight_limit(root: str) -> dict[str, Any]:
    """(Run in a fresh interpreter: its heap is the job's.) That conversion resumed under the
    same limit: what the resume did."""
    try:
        result = parallel_dcp.convert(f"{root}/m.safetensors", f"{root}/out", resume=True, **_TIGHT)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None, "kept": result.bytes_kept, "peak": result.peak_memory, "limit": result.memory_limit}


def test_a_resume_fits_under_the_limit_its_fresh_run_fits_under(tmp_path: Path) -> None:
    """Re-hashing the kept files left 8 MiB read buffers in 4 threads' malloc arenas, charged to
    the resumed job: it refused a task its fresh run had fitted."""
    assert run_fresh("tests.test_review_round4", "fail_under_a_tight_limit", str(tmp_path)) > 0
    outcome = run_fresh("tests.test_review_round4", "resume_under_a_tight_limit", str(tmp_path))
    assert outcome["error"] is None
    assert outcome["kept"] > 0 and outcome["peak"] <= outcome["limit"]


@pytest.mark.parametrize(("change", "said"), [(-100, "truncated?"), (100, "bytes appended?")])
def test_verify_says_whether_a_shard_shrank_or_grew(tmp_path: Path, change: int, said: str) -> None:
    """A shard with bytes appended was called "(truncated?)"."""
    parallel_dcp.save(_state(8, 2), tmp_path / "ck", workers=1)
    (shard,) = (tmp_path / "ck").glob("*.distcp")
    data = shard.read_bytes()
    shard.write_bytes(data[:change] if change < 0 else data + b"\0" * change)
    report = parallel_dcp.verify(tmp_path / "ck")
    assert any(f"({said})" in problem for problem in report.problems), report.problems


def handlers_in_a_fork_while_held() -> dict[str, bool]:
    """(Run in a fresh interpreter: it sets signal handlers.) What a fork made while interrupts
    are held (a pool's worker forked in a job) inherits."""
    from parallel_dcp.engine.held_interrupts import HeldInterrupts

    def terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    read, write = os.pipe()
    with HeldInterrupts():
        pid = os.fork()
        if pid == 0:
            same = signal.getsignal(signal.SIGTERM) is terminate
            os.write(write, b"1" if same else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
        held_here = signal.getsignal(signal.SIGTERM) is not terminate
    return {
        "child": os.read(read, 1) == b"1",
        "held": held_here,
        "after": signal.getsignal(signal.SIGTERM) is terminate,
    }


def test_a_fork_made_while_interrupts_are_held_gets_the_handlers_back() -> None:
    """A worker forked while its pool held Ctrl-C inherited the holding handler: it ignored SIGTERM."""
    assert run_fresh("tests.test_review_round4", "handlers_in_a_fork_while_held") == {
        "child": True,
        "held": True,
        "after": True,
    }


def test_the_command_line_never_says_nothing_was_committed_of_a_commit_it_held_a_ctrl_c_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Ctrl-C held through a conversion's commit: the command said "interrupted; nothing was
    committed", then the note that the destination holds the new checkpoint (review s17 rev2 F4)."""
    from parallel_dcp.cli import main

    parallel_dcp.save(_state(5), tmp_path / "src", workers=1)
    publish = LocalDirStaging.publish

    def interrupted(self: Any) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as the publishing begins
        time.sleep(0.05)
        publish(self)

    monkeypatch.setattr(LocalDirStaging, "publish", interrupted)
    code = main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "-q"])
    err = capsys.readouterr().err
    assert code == 130, err
    assert "nothing was committed" not in err and "holds the new checkpoint" in err, err
    assert_same(parallel_dcp.load(tmp_path / "dst"), _state(5))
