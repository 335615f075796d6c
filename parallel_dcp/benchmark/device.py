"""The device's own limits, measured with the same bytes as a benchmark row: O_DIRECT writes (fio
when it is on PATH, else a built-in probe) and plain parallel reads (direct or buffered)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import mmap
import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["direct_write_probe", "fio_read_write", "fio_write", "plain_read", "queued_read", "read_write_probe"]

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
    """fio's O_DIRECT write of ``nbytes`` by ``writers`` jobs, fsynced. ``device_s`` in the result:
    the slowest job's run time as fio measured it; the wall time adds fio's own start (creating
    its files and threads: 0.3-0.5 s here), which is not the device's."""
    os.makedirs(out)
    size = max(1, nbytes // writers >> 20)
    done = subprocess.run(
        [
            "fio",
            "--output-format=json",
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
        ],
        check=True,
        capture_output=True,
    )
    jobs = json.loads(done.stdout)["jobs"]
    return {"tool": "fio (direct, libaio, iodepth 8)", "device_s": max(j["job_runtime"] for j in jobs) / 1000}


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


def queued_read(
    paths: list[str], readers: int, request: int, direct: bool, *, fresh: bool = False
) -> Callable[[str], None]:
    """``readers`` threads read the files as the loader does (formats/span_read.py): one file at a
    time, each thread taking the next ``request`` bytes of it from one queue, through a descriptor
    of its own, into a ready aligned buffer of its own. Beside :func:`plain_read` (a file per
    thread, 8 MiB at a time) it is the other plain way to read them: the best plain read is the
    faster of the two, whichever mode wins. ``fresh``: each request lands in its own place of one
    fresh private mapping of all the files' bytes, as a load's new tensors (its pages faulted in
    inside the reads): what a reader that hands out new memory can reach."""

    def run(out: str) -> None:
        places, at = [], 0
        for path in paths:
            places.append(at)
            at += -(-os.path.getsize(path) // request) * request  # request-aligned: O_DIRECT takes it
        queue = iter(
            [(path, at, place) for path, place in zip(paths, places) for at in range(0, os.path.getsize(path), request)]
        )
        lock = threading.Lock()
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        memory = mmap.mmap(-1, max(at, 1), flags=flags) if fresh else None

        def read() -> None:
            own = None if memory is not None else mmap.mmap(-1, request, flags=flags)
            target = memory if memory is not None else own
            assert target is not None
            buffer = memoryview(target)
            fds: dict[str, int] = {}
            try:
                while True:
                    with lock:
                        item = next(queue, None)
                    if item is None:
                        return
                    path, offset, place = item
                    if path not in fds:
                        fds[path] = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
                    where = place + offset if memory is not None else 0
                    os.preadv(fds[path], [buffer[where : where + request]], offset)
            finally:
                for fd in fds.values():
                    os.close(fd)
                buffer.release()
                if own is not None:
                    own.close()

        try:
            with cf.ThreadPoolExecutor(readers) as pool:
                for future in [pool.submit(read) for _ in range(readers)]:
                    future.result()
        finally:
            if memory is not None:
                memory.close()

    return run


def fio_read_write(source: str, writers: int, out: str) -> dict[str, Any]:
    """The combined limit of a conversion of ``source``: fio reads all of it and writes as many bytes
    at the same time (``writers`` jobs each way, direct, libaio, iodepth 8, 8 MiB blocks, the
    output fsynced). Where the device serves reads and writes independently this takes as long as
    the slower of the two alone; where they share it, as long as both one after the other.
    ``device_s`` in the result: the slowest job's run time as fio measured it (without fio's start)."""
    os.makedirs(out)
    total = os.path.getsize(source) >> 20
    share = max(1, total // writers)
    block = f"--bs={min(8, share)}m"
    common = ["--direct=1", "--ioengine=libaio", "--iodepth=8", f"--numjobs={writers}", f"--size={share}m", block]
    done = subprocess.run(
        [
            "fio",
            "--output-format=json",
            "--name=read",
            f"--filename={source}",
            "--rw=read",
            f"--offset_increment={share}m",
            *common,
            "--name=write",
            f"--directory={out}",
            "--rw=write",
            "--end_fsync=1",
            *common,
        ],
        check=True,
        capture_output=True,
    )
    jobs = json.loads(done.stdout)["jobs"]
    # fio's own start (creating the files, its threads) takes a few tenths of a second that are
    # not the device's: the limit is the slowest job's run time, as fio measured it.
    return {
        "tool": "fio (direct, libaio, iodepth 8; reads and writes at once)",
        "device_s": max(j["job_runtime"] for j in jobs) / 1000,
    }


def read_write_probe(source: str, writers: int, out: str) -> dict[str, Any]:
    """As :func:`fio_read_write` without fio: ``writers`` threads read a share of ``source`` each with
    8 MiB O_DIRECT preads while the built-in probe writes as many bytes."""
    size = os.path.getsize(source)
    share = -(-size // writers // _BLOCK) * _BLOCK

    def read(index: int) -> None:
        buffer = mmap.mmap(-1, _BLOCK)
        fd = os.open(source, os.O_RDONLY | os.O_DIRECT)
        try:
            for offset in range(index * share, min(size, (index + 1) * share), _BLOCK):
                os.preadv(fd, [buffer], offset)
        finally:
            os.close(fd)
            buffer.close()

    began = time.perf_counter()
    with cf.ThreadPoolExecutor(writers + 1) as pool:
        writing = pool.submit(direct_write_probe, size, writers, out)
        list(pool.map(read, range(writers)))
        writing.result()
    return {"tool": "built-in O_DIRECT probe (reads and writes at once)", "device_s": time.perf_counter() - began}
