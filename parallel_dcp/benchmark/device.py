"""The device's own limits, measured with the same bytes as a benchmark row: O_DIRECT writes (fio
when it is on PATH, else a built-in probe) and plain parallel reads (direct or buffered)."""

from __future__ import annotations

import concurrent.futures as cf
import mmap
import os
import subprocess
from collections.abc import Callable
from typing import Any

__all__ = ["direct_write_probe", "fio_write", "plain_read"]

_BLOCK = 8 << 20


def direct_write_probe(nbytes: int, writers: int, out: str) -> dict[str, Any]:
    """``writers`` threads of aligned 8 MiB O_DIRECT pwrites, ``nbytes`` in all, fsynced."""
    os.makedirs(out)
    share = -(-nbytes // writers // _BLOCK) * _BLOCK

    def write(index: int) -> None:
        block = mmap.mmap(-1, _BLOCK)
        block.write(os.urandom(4096) * (_BLOCK // 4096))
        fd = os.open(os.path.join(out, f"probe{index}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT)
        try:
            for offset in range(0, share, _BLOCK):
                os.pwrite(fd, block, offset)
            os.fsync(fd)
        finally:
            os.close(fd)
            block.close()

    with cf.ThreadPoolExecutor(writers) as pool:
        list(pool.map(write, range(writers)))
    return {"tool": "built-in O_DIRECT probe"}


def fio_write(nbytes: int, writers: int, out: str) -> dict[str, Any]:
    os.makedirs(out)
    size = max(1, nbytes // writers >> 20)
    subprocess.run(
        [
            "fio",
            "--name=limit",
            f"--directory={out}",
            "--rw=write",
            f"--bs={min(8, size)}m",  # fio refuses a block larger than the file
            "--direct=1",
            "--ioengine=libaio",
            "--iodepth=8",
            f"--numjobs={writers}",
            f"--size={size}m",
            "--end_fsync=1",
            "--group_reporting",
        ],
        check=True,
        capture_output=True,
    )
    return {"tool": "fio (direct, libaio, iodepth 8)"}


def plain_read(paths: list[str], readers: int, direct: bool) -> Callable[[str], None]:
    """``readers`` threads read the shard files whole into aligned buffers (8 MiB pieces)."""

    def read(path: str) -> None:
        buffer = mmap.mmap(-1, _BLOCK)
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            offset = 0
            while (got := os.preadv(fd, [buffer], offset)) > 0:
                offset += got
        finally:
            os.close(fd)
            buffer.close()

    def run(out: str) -> None:
        with cf.ThreadPoolExecutor(readers) as pool:
            list(pool.map(read, paths))

    return run
