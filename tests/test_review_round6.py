"""What the sixth review round found, each pinned by a test: a loop of symbolic links named as the
source was reported as "no such file or directory"; a DCP directory whose ``.metadata`` is a FIFO
or a dangling link was "cannot tell the format" (not the refusal naming it); a safetensors file
changed after the job opened it failed in the worker with the library's bare message, naming
neither the file nor the change."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

import parallel_dcp
from parallel_dcp.errors import CorruptCheckpointError, UnsafeCheckpointError
from parallel_dcp.formats import open_source


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "parallel_dcp", *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_a_loop_of_links_is_named_as_one(tmp_path: Path) -> None:
    (tmp_path / "a.pt").symlink_to("b.pt")
    (tmp_path / "b.pt").symlink_to("a.pt")
    with pytest.raises(OSError, match="too many levels of symbolic links") as caught:
        parallel_dcp.load(tmp_path / "a.pt")
    assert not isinstance(caught.value, FileNotFoundError)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(OSError, match="is a file, not a directory"):
        parallel_dcp.load(tmp_path / "file" / "x.pt")
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        open_source(tmp_path / "absent.pt")
    run = _cli("inspect", str(tmp_path / "a.pt"))
    assert run.returncode == 1
    assert "too many levels of symbolic links" in run.stderr and "[Errno" not in run.stderr


def test_a_dcp_metadata_that_is_a_fifo_or_a_dangling_link_is_refused_by_name(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / ".metadata")
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata is not a regular file"):
        open_source(fifo)
    dangling = tmp_path / "dangling"
    dangling.mkdir()
    (dangling / ".metadata").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata is a symlink"):
        open_source(dangling)
    run = _cli("convert", str(fifo), str(tmp_path / "out"))
    assert run.returncode == 1 and "not a regular file" in run.stderr
    assert not (tmp_path / "out").exists()


def test_a_safetensors_file_changed_after_it_was_opened_is_named(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    st.save_file({"w": torch.ones(1024, 16)}, file)
    source = open_source(file)
    with open(file, "r+b") as f:  # cut while the job runs (as a copy still arriving, or another writer)
        f.truncate(100)
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors can no longer be read.*changed or went away"):
        source.read(["w"])
