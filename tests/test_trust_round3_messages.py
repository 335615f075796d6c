"""Issue 31, item 6: a name read from disk never forges a line of output.

Every ParallelDCPError builds its message in one place, escaping control characters, so a line
break in a shard name or in a planted lock record shows as ``\\n`` inside the one error line.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from parallel_dcp import DestinationBusyError, ParallelDCPError, cli
from parallel_dcp.errors import CorruptCheckpointError, InsufficientSpaceError, RenameError

pytestmark = pytest.mark.timeout(120)

FORGED = "\nparallel-dcp: OK, nothing wrong here\x1b[2K"


def _ckpt_naming(tmp_path: Path, shard: str) -> Path:
    """A stock checkpoint whose .metadata names its shard ``shard`` (absent on disk)."""
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.zeros(4)}, checkpoint_id=str(ckpt), no_dist=True)
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = shard
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    return ckpt


@pytest.mark.parametrize("command", [["convert", "{ckpt}", "{out}"], ["verify", "{ckpt}"]])
def test_a_line_break_in_a_shard_name_stays_inside_the_error_line(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _ckpt_naming(tmp_path, f"__0_0{FORGED}.distcp")
    code = cli.main([part.format(ckpt=ckpt, out=tmp_path / "out") for part in command])
    captured = capsys.readouterr()
    assert code == 1
    output = captured.out + captured.err
    assert not any(line.startswith("parallel-dcp: OK") for line in output.splitlines()), output
    assert "\x1b" not in output
    assert "\\nparallel-dcp: OK" in output


LIBRARY_ERRORS = [
    pytest.param(lambda m: CorruptCheckpointError(m), id="corrupt"),
    pytest.param(lambda m: DestinationBusyError(f"held by pid 7 on {m}"), id="busy-lock-record"),
    pytest.param(lambda m: RenameError(f"rename {m}", lines=[f"  {m}"]), id="rename-lines"),
    pytest.param(lambda m: InsufficientSpaceError(28, f"no space for {m}"), id="oserror-form"),
]


@pytest.mark.parametrize("make", LIBRARY_ERRORS)
def test_every_library_error_escapes_what_it_names(make: object) -> None:
    error: ParallelDCPError = make(f"name{FORGED}")  # type: ignore[operator]
    for shown in (str(error), str(pickle.loads(pickle.dumps(error)))):
        assert "\x1b" not in shown and "\\x1b" in shown
        assert not any(line.startswith("parallel-dcp") for line in shown.splitlines()), shown


def test_listed_lines_stay_lines() -> None:
    error = RenameError("2 names collide (nothing was written):", lines=["  'a' <- 'x'", "  'b' <- 'y'"])
    assert str(error).splitlines() == ["2 names collide (nothing was written):", "  'a' <- 'x'", "  'b' <- 'y'"]
    assert isinstance(InsufficientSpaceError(28, "full"), OSError) and InsufficientSpaceError(28, "full").errno == 28


def test_a_line_break_in_a_planted_lock_record_stays_inside_the_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A lock held (here by this test) whose record someone rewrote with a forged line."""
    import fcntl
    import json
    import os

    src = tmp_path / "src"
    dcp.save({"w": torch.zeros(4)}, checkpoint_id=str(src), no_dist=True)
    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out / ".parallel_dcp.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        record = {"pid": 1, "host": f"vm{FORGED}", "save_id": "0123456789ab", "since": "now"}
        os.write(fd, json.dumps(record).encode())
        code = cli.main(["convert", str(src), str(out)])
    finally:
        os.close(fd)
    captured = capsys.readouterr()
    assert code == 1
    output = captured.out + captured.err
    assert "pid 1 on host vm\\nparallel-dcp: OK" in output, output
    assert not any(line.startswith("parallel-dcp: OK") for line in output.splitlines()), output
    assert "\x1b" not in output
