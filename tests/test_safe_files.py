"""storage.safe_files: no write through a planted name, no read of anything but a regular file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from parallel_dcp.errors import UnsafeCheckpointError
from parallel_dcp.storage.safe_files import create_new, open_directory, open_regular, plain_name


def test_create_new_refuses_a_planted_symlink_and_leaves_its_target(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "shard").symlink_to(victim)
    dfd = open_directory(tmp_path / "dest")
    try:
        with pytest.raises(FileExistsError):
            create_new(dfd, "shard")
        fd = create_new(dfd, "other")
        os.write(fd, b"x")
        os.close(fd)
    finally:
        os.close(dfd)
    assert victim.read_bytes() == b"keep me"
    assert (tmp_path / "dest" / "other").read_bytes() == b"x"


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_open_regular_refuses_what_is_not_a_regular_file(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "real"
    target.write_bytes(b"data")
    name = tmp_path / "shard"
    if kind == "symlink":
        name.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(name)
    else:
        name.mkdir()
    dfd = open_directory(tmp_path)
    try:
        with pytest.raises(UnsafeCheckpointError):
            open_regular(dfd, "shard")
        with pytest.raises(UnsafeCheckpointError):
            open_regular(None, name)
        os.close(open_regular(dfd, "real"))
    finally:
        os.close(dfd)


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../x", "a\0b"])
def test_plain_name_refuses_anything_but_a_file_name(name: str) -> None:
    with pytest.raises(UnsafeCheckpointError):
        plain_name(name)
