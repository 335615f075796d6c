"""Resume: a conversion killed (SIGKILL) or failed after some tasks finished is continued by
``convert(..., resume=True)``; it keeps what re-hashes as recorded and redoes the rest; other
arguments or a changed source are refused; records are hostile input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader

import parallel_dcp
from parallel_dcp import ResumeError, WorkerError
from parallel_dcp.cli import main
from parallel_dcp.jobs import targets
from parallel_dcp.storage.resume import read_sealed, write_sealed
from tests.conftest import assert_same, empty_like_state, finished_task_records

ROOT = Path(__file__).resolve().parent.parent
SHARD = 600_000  # two 256 KiB tensors a shard: four shards
FINISHED = 2  # tasks 0 and 1 finish; the others never do

# A real process converting with 4 workers; tasks from FINISHED on sleep, so that the test can
# SIGKILL it once the first tasks' done records are on disk.
CHILD = textwrap.dedent(
    """
    import sys, time
    import parallel_dcp
    from parallel_dcp.jobs import targets

    def hold(cls):
        original = cls.write
        def write(self, job, task, data, staging, options):
            if task.index >= int(sys.argv[3]):
                time.sleep(600)
            return original(self, job, task, data, staging, options)
        cls.write = write

    hold(targets.DcpTarget)
    hold(targets.ShardedTarget)
    to = None if sys.argv[4] == "dcp" else sys.argv[4]
    parallel_dcp.convert(sys.argv[1], sys.argv[2], to=to, workers=4, shard_size=int(sys.argv[5]))
    """
)


def _source(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = {f"w{i}": torch.randn(64, 1024) for i in range(8)}
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path))
    return path, sd


def _kill_midway(src: Path, out: Path, to: str) -> None:
    """Run the conversion in a child process and SIGKILL it once FINISHED tasks have recorded."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(src), str(out), str(FINISHED), to, str(SHARD)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not out.is_dir() or len(finished_task_records(out)) < FINISHED):
            assert proc.poll() is None, "the conversion ended before it was killed"
            time.sleep(0.05)
        assert len(finished_task_records(out)) == FINISHED
        workers = psutil.Process(proc.pid).children()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _gone, alive = psutil.wait_procs(workers, timeout=30)  # they die with their coordinator
        assert not alive
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not (out / ".metadata").exists() and not (out / "model.safetensors.index.json").exists()


def _fail_midway(monkeypatch: pytest.MonkeyPatch, src: Path, out: Path, to: str, **kwargs: Any) -> None:
    """The same, in this process, as an error in a worker (as ENOSPC would be): tasks from
    FINISHED on wait for the first ones' records, then raise."""
    for cls in (targets.DcpTarget, targets.ShardedTarget):
        original = cls.write

        def write(self: Any, job: Any, task: Any, data: Any, staging: Any, options: Any, _o: Any = original) -> Any:
            if task.index >= FINISHED:
                deadline = time.monotonic() + 60
                while len(finished_task_records(out)) < FINISHED and time.monotonic() < deadline:
                    time.sleep(0.02)
                raise OSError(28, "No space left on device (injected)")
            return _o(self, job, task, data, staging, options)

        monkeypatch.setattr(cls, "write", write)
    with pytest.raises(WorkerError, match="No space left") as caught:
        parallel_dcp.convert(src, out, to=None if to == "dcp" else to, workers=4, shard_size=SHARD, **kwargs)
    monkeypatch.undo()
    assert len(finished_task_records(out)) == FINISHED, "the finished tasks are left for resume"
    # The error says what was kept and how to continue.
    notes = getattr(caught.value, "__notes__", [])
    assert any(f"{FINISHED} of " in note and "--resume" in note for note in notes), notes


def _read_output(out: Path, to: str, sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    if to == "dcp":
        state = empty_like_state(sd)
        dcp.load(state, checkpoint_id=str(out))  # the stock reader
        return state
    index = json.loads((out / "model.safetensors.index.json").read_text())
    loaded: dict[str, Any] = {}
    for shard in sorted(set(index["weight_map"].values())):
        loaded |= load_file(str(out / shard))
    return loaded


@pytest.mark.parametrize("to", ["dcp", "safetensors"])
def test_sigkilled_conversion_resumes_rewriting_less_and_equals_a_fresh_run(tmp_path: Path, to: str) -> None:
    src, sd = _source(tmp_path)
    out = tmp_path / "out"
    _kill_midway(src, out, to)

    fmt = None if to == "dcp" else to
    # Fewer workers than the killed run: the recorded plan is reused, not the worker count.
    resumed = parallel_dcp.convert(src, out, to=fmt, workers=2, shard_size=SHARD, resume=True)
    fresh = parallel_dcp.convert(src, tmp_path / "fresh", to=fmt, workers=4, shard_size=SHARD)

    assert resumed.resumed and not fresh.resumed
    assert resumed.bytes == fresh.bytes == sum(t.nbytes for t in sd.values())
    assert resumed.bytes_kept > 0 and resumed.bytes_rewritten < fresh.bytes_rewritten == fresh.bytes
    assert resumed.bytes_kept + resumed.bytes_rewritten == resumed.bytes
    assert_same(_read_output(out, to, sd), _read_output(tmp_path / "fresh", to, sd))
    assert_same(_read_output(out, to, sd), sd)
    names = os.listdir(out)
    assert not [n for n in names if n.startswith((".parallel_dcp.done.", ".parallel_dcp.job.", ".parallel_dcp.owner."))]
    assert parallel_dcp.verify(out).ok


CHANGES: dict[str, tuple[dict[str, Any], str]] = {
    "dtype": ({"dtype": "bfloat16"}, r"dtype was None, now 'bfloat16'"),
    "rename": ({"rename": [(r"w(\d+)", r"layer.\1")]}, r"the selected keys or their names \(keys, rename\) differ"),
    "keys": ({"keys": "w[0-5]"}, r"the selected keys or their names"),
    "format": ({"to": "torch"}, r"the output format was 'dcp', now 'torch'"),
    "compress": ({"compress": "zstd"}, r"compress was None, now 'zstd:3'"),
}


@pytest.mark.parametrize("change", [*CHANGES, "source modified"])
def test_resume_with_other_arguments_is_refused_and_removes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    src, sd = _source(tmp_path)
    out = tmp_path / "out"
    _fail_midway(monkeypatch, src, out, "dcp")
    before = sorted(os.listdir(out))
    kwargs: dict[str, Any] = {}
    if change == "source modified":
        save_file(sd | {"w0": sd["w0"] + 1}, str(src))  # same names and sizes, other bytes, newer mtime
        reason = r"the source changed since \(size or modification time of model.safetensors\)"
    else:
        kwargs, reason = CHANGES[change]
    with pytest.raises(ResumeError, match=reason) as caught:
        parallel_dcp.convert(src, out, workers=2, resume=True, **kwargs)
    assert caught.value.reasons
    assert sorted(os.listdir(out)) == before, "a refused resume leaves the dead conversion as it was"


def test_failed_conversion_resumes_with_the_same_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, sd = _source(tmp_path)
    out = tmp_path / "out"
    args = {"dtype": "bfloat16", "rename": [(r"w(\d+)", r"layer.\1")], "keys": "w[0-6]"}
    _fail_midway(monkeypatch, src, out, "dcp", **args)
    result = parallel_dcp.convert(src, out, workers=3, resume=True, **args)  # type: ignore[arg-type]
    assert result.resumed and 0 < result.bytes_kept < result.bytes
    expected = {f"layer.{i}": sd[f"w{i}"].to(torch.bfloat16) for i in range(7)}
    assert_same(_read_output(out, "dcp", expected), expected)


def test_a_compressed_conversion_resumes_with_its_records_still_compressed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("zstandard")
    src, sd = _source(tmp_path)
    out = tmp_path / "out"
    _fail_midway(monkeypatch, src, out, "dcp", compress="zstd:1")
    result = parallel_dcp.convert(src, out, workers=2, resume=True, compress="zstd:1")
    assert result.resumed and 0 < result.bytes_kept < result.bytes
    infos = FileSystemReader(str(out)).read_metadata().storage_data.values()
    assert all(info.transform_descriptors == ["stream.zstd/1"] for info in infos)  # kept tasks' too
    assert_same(_read_output(out, "dcp", sd), sd)


def _tamper_record(out: Path, edit: Any) -> None:
    """Rewrite task 0's done record through ``edit``, sealed again (an attacker can compute seals)."""
    name = next(n for n in finished_task_records(out) if n.endswith(".0"))
    record = read_sealed(out, name)
    assert record is not None
    edit(record)
    write_sealed(out, name, record)


def _rename_file(record: dict[str, Any], new: str) -> None:
    (entry,) = record["files"].values()
    record["files"] = {new: entry}


TAMPERING = {
    "record bytes edited": lambda out: _edit_bytes(out),
    "kept file truncated": lambda out: _shard_of_task0(out).write_bytes(_shard_of_task0(out).read_bytes()[:-10]),
    "kept file altered": lambda out: _flip(_shard_of_task0(out)),
    "record names ../x": lambda out: _tamper_record(out, lambda r: _rename_file(r, "../x")),
    "record names /etc/passwd": lambda out: _tamper_record(out, lambda r: _rename_file(r, "/etc/passwd")),
    "record offset outside the file": lambda out: _tamper_record(out, lambda r: r["part"][0].__setitem__(1, 10**9)),
    "record of another task": lambda out: _tamper_record(out, lambda r: r.__setitem__("task", 1)),
}


def _shard_of_task0(out: Path) -> Path:
    return next(out.glob("__0_*_0.distcp"))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_bytes(out: Path) -> None:
    path = out / next(n for n in finished_task_records(out) if n.endswith(".0"))
    text = path.read_text()
    path.write_text(text.replace('"task":0', '"task":0 ', 1).replace('"size":', '"size":1', 1))


@pytest.mark.parametrize("tampering", list(TAMPERING))
def test_records_and_files_that_do_not_check_out_are_redone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tampering: str
) -> None:
    src, sd = _source(tmp_path)
    out = tmp_path / "out"
    _fail_midway(monkeypatch, src, out, "dcp")
    outside = tmp_path / "x"
    outside.write_bytes(b"not the job's")
    TAMPERING[tampering](out)

    result = parallel_dcp.convert(src, out, workers=2, resume=True)
    assert result.resumed
    untouched = parallel_dcp.convert(src, tmp_path / "fresh", workers=4)
    assert 0 < result.bytes_kept < untouched.bytes / 2, "only task 1 is kept; task 0 is redone"
    assert_same(_read_output(out, "dcp", sd), sd)
    assert outside.read_bytes() == b"not the job's"
    assert parallel_dcp.verify(out).ok


def test_resume_with_nothing_to_resume_is_a_fresh_run(tmp_path: Path) -> None:
    src, sd = _source(tmp_path)
    result = parallel_dcp.convert(src, tmp_path / "out", workers=2, resume=True)
    assert not result.resumed and result.bytes_kept == 0 and result.bytes_rewritten == result.bytes
    assert_same(_read_output(tmp_path / "out", "dcp", sd), sd)


def test_a_run_without_resume_removes_the_dead_conversion_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, sd = _source(tmp_path)
    out = tmp_path / "out"
    _fail_midway(monkeypatch, src, out, "dcp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = parallel_dcp.convert(src, out, workers=2)
    assert any("resume=True" in str(w.message) and "2 finished tasks" in str(w.message) for w in caught)
    assert not result.resumed and result.bytes_kept == 0
    assert not finished_task_records(out)
    assert_same(_read_output(out, "dcp", sd), sd)


def test_cli_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    src, _ = _source(tmp_path)
    out = tmp_path / "out"
    _fail_midway(monkeypatch, src, out, "dcp")
    assert main(["convert", str(src), str(out), "--resume", "--dtype", "fp16", "-q"]) == 1
    assert "cannot resume" in capsys.readouterr().err
    assert main(["convert", str(src), str(out), "--resume", "--workers", "2", "--json"]) == 0
    (summary,) = json.loads(capsys.readouterr().out)
    assert summary["resumed"] is True and summary["bytes_kept"] > 0
    assert summary["bytes_kept"] + summary["bytes_rewritten"] == summary["bytes"]
    assert main(["convert", str(src), str(tmp_path / "new"), "--resume", "--workers", "2"]) == 0
    assert "nothing to resume" in capsys.readouterr().err


def test_resume_where_it_cannot_work_is_refused_before_writing(tmp_path: Path) -> None:
    src, _ = _source(tmp_path)
    with pytest.raises(ResumeError, match="local destinations only"):
        parallel_dcp.convert(src, "s3://no-such-bucket/out", resume=True, storage_options={"anon": True})
    with pytest.raises(ResumeError, match="not for saving a state dict"):
        parallel_dcp.save({"w": torch.ones(2)}, tmp_path / "ckpt", options=parallel_dcp.Options(resume=True))
    assert not (tmp_path / "ckpt").exists()


HELD_COMMIT = textwrap.dedent(
    """
    import sys, time
    import parallel_dcp
    from parallel_dcp.jobs import targets

    def commit(self, *args, **kwargs):
        time.sleep(600)

    targets.FileTarget.commit = commit
    parallel_dcp.convert(sys.argv[1], sys.argv[2], workers=1)
    """
)


def test_single_file_output_killed_before_its_commit_keeps_everything(tmp_path: Path) -> None:
    src, sd = _source(tmp_path)
    out = tmp_path / "model.pt"
    proc = subprocess.Popen([sys.executable, "-c", HELD_COMMIT, str(src), str(out)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not finished_task_records(tmp_path):
            assert proc.poll() is None, "the conversion ended before it was killed"
            time.sleep(0.05)
        workers = psutil.Process(proc.pid).children()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        psutil.wait_procs(workers, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not out.exists()
    result = parallel_dcp.convert(src, out, workers=1, resume=True)
    assert result.resumed and result.bytes_kept == result.bytes and result.bytes_rewritten == 0
    assert_same(torch.load(out, weights_only=True), sd)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [
        "model.pt",
        "model.pt.manifest.json",  # its checksums, from the kept task's record
        "model.safetensors",
    ]
    assert parallel_dcp.verify(out, workers=1).ok


def test_a_resume_that_fails_leaves_the_finished_tasks_for_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from parallel_dcp import InsufficientSpaceError
    from parallel_dcp.storage import local_staging

    src, sd = _source(tmp_path)
    out = tmp_path / "out"
    _fail_midway(monkeypatch, src, out, "dcp")
    before = set(os.listdir(out))
    monkeypatch.setattr(local_staging, "free_bytes", lambda path: 0)  # the disk filled up meanwhile
    with pytest.raises(InsufficientSpaceError):
        parallel_dcp.convert(src, out, workers=2, resume=True)
    monkeypatch.undo()
    assert len(finished_task_records(out)) == FINISHED and {n for n in before if n.endswith(".distcp")} <= set(
        os.listdir(out)
    )
    result = parallel_dcp.convert(src, out, workers=2, resume=True)
    assert result.resumed and result.bytes_kept > 0
    assert_same(_read_output(out, "dcp", sd), sd)


def _job_record(out: Path) -> str:
    return next(n for n in os.listdir(out) if n.startswith(".parallel_dcp.job.") and not n.endswith(".tmp"))


def test_a_damaged_job_record_is_refused_and_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, _ = _source(tmp_path)
    out = tmp_path / "out"
    _fail_midway(monkeypatch, src, out, "dcp")
    path = out / _job_record(out)
    path.write_bytes(path.read_bytes().replace(b'"threshold":', b'"threshold":1', 1))
    before = sorted(os.listdir(out))
    with pytest.raises(ResumeError, match="job record is damaged"):
        parallel_dcp.convert(src, out, workers=2, resume=True)
    assert sorted(os.listdir(out)) == before


def test_a_resealed_plan_that_does_not_cover_the_job_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, sd = _source(tmp_path)
    out = tmp_path / "out"
    _fail_midway(monkeypatch, src, out, "dcp")
    name = _job_record(out)
    record = read_sealed(out, name)
    assert record is not None
    record["plan"]["tasks"][0] = ["../../etc/passwd"]
    write_sealed(out, name, record)
    before = sorted(os.listdir(out))
    with pytest.raises(ResumeError, match="recorded plan does not match"):
        parallel_dcp.convert(src, out, workers=2, resume=True)
    assert sorted(os.listdir(out)) == before
    with pytest.warns(UserWarning, match="removed .* leftover files"):  # without resume: starts over
        parallel_dcp.convert(src, out, workers=2)
    assert_same(_read_output(out, "dcp", sd), sd)
