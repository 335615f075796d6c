"""A write that fails in the middle of a safetensors or torch.save output is said as the file system
said it, naming the file: torch's zip writer turned ENOSPC into "RuntimeError: [enforce fail at
inline_container.cc:672] . unexpected pos ..." (review s17 rev2 F3)."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import parallel_dcp
from parallel_dcp.jobs import file_writes


class _FillsUp:
    """A stream that takes ``room`` bytes, then fails as a full file system does."""

    def __init__(self, stream: Any, room: int) -> None:
        self._stream, self._room = stream, room

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if size > self._room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._room -= size
        return int(self._stream.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@pytest.mark.parametrize("name", ["out.pt", "out.safetensors"])
def test_a_full_disk_mid_file_is_said_as_enospc_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    real = file_writes.new_file

    @contextlib.contextmanager
    def filling(where: Path, *, direct: bool) -> Iterator[Any]:
        with real(where, direct=direct) as stream:
            yield _FillsUp(stream, 1 << 20)

    monkeypatch.setattr(file_writes, "new_file", filling)  # (the workers are forked: they inherit it)
    src = tmp_path / "src"
    parallel_dcp.save({f"w{i}": torch.randn(512, 512) for i in range(8)}, src, workers=1)  # 8 MiB
    with pytest.raises(parallel_dcp.ParallelDCPError) as failed:
        parallel_dcp.convert(src, tmp_path / name, workers=1)
    said = str(failed.value)  # ("... No space left on device: '.../.out.pt.<save id>.tmp'", the file being written)
    assert "raised OSError: [Errno 28] No space left on device: " in said and f"/.{name}." in said, said
    assert "unexpected pos" not in said
    assert not (tmp_path / name).exists()
