"""One copy into tmpfs pages against a scratch and ``write()`` (issue 30 item 1; tried and dropped).

python bench/bench_tmpfs_one_copy.py [rounds]

This process holds 1 GiB (64 tensors of 16 MiB) and copies each with ``process_vm_readv`` (from
itself, as a kept worker does from the caller) into a ``/dev/shm`` file: into a reused 1 MiB
scratch then ``os.write`` (what a kept worker does on tmpfs), or straight into ``MAP_SHARED``
windows of the file (extended first), with the pages made by ``MADV_POPULATE_WRITE``,
``MAP_POPULATE``, or ``posix_fallocate`` and ``MAP_POPULATE``. Wall and CPU seconds, medians of
interleaved rounds; hashing is the same in every row and left out. Results: docs/performance.md.
"""

from __future__ import annotations

import ctypes
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable

import torch

from parallel_dcp.engine.remote_memory import read_into

MiB = 2**20
COUNT, SIZE = 64, 16 * MiB
MADV_POPULATE_WRITE = 23  # Linux 5.14
PROT_READ_WRITE, MAP_SHARED, MAP_POPULATE = 3, 1, 0x8000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _map(fd: int, offset: int, n: int, flags: int) -> int:
    at = _libc.mmap(None, n, PROT_READ_WRITE, flags, fd, offset)
    if at in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    return int(at)


def through_scratch(path: str, addresses: list[int]) -> None:
    buffer = bytearray(MiB)
    view, at = memoryview(buffer), ctypes.addressof((ctypes.c_char * MiB).from_buffer(buffer))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for address in addresses:
            for offset in range(0, SIZE, MiB):
                read_into(os.getpid(), address + offset, MiB, at)
                os.write(fd, view)
    finally:
        os.close(fd)


def mapped(path: str, addresses: list[int], window: int, how: str) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for index, address in enumerate(addresses):
            start = index * SIZE
            if how == "fallocate":
                os.posix_fallocate(fd, start, SIZE)
            else:
                os.ftruncate(fd, start + SIZE)
            flags = MAP_SHARED if how == "madvise" else MAP_SHARED | MAP_POPULATE
            for offset in range(0, SIZE, window):
                at = _map(fd, start + offset, window, flags)
                if how == "madvise" and _libc.madvise(at, window, MADV_POPULATE_WRITE) != 0:
                    raise OSError(ctypes.get_errno(), "madvise")
                read_into(os.getpid(), address + offset, window, at)
                _libc.munmap(at, window)
    finally:
        os.close(fd)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    tensors = [torch.full((SIZE,), i, dtype=torch.uint8) for i in range(COUNT)]
    addresses = [t.data_ptr() for t in tensors]
    rows: dict[str, Callable[[str], None]] = {
        "scratch + write": lambda path: through_scratch(path, addresses),
        "mmap 1 MiB, POPULATE_WRITE": lambda path: mapped(path, addresses, MiB, "madvise"),
        "mmap 4 MiB, POPULATE_WRITE": lambda path: mapped(path, addresses, 4 * MiB, "madvise"),
        "mmap 16 MiB, POPULATE_WRITE": lambda path: mapped(path, addresses, 16 * MiB, "madvise"),
        "mmap 4 MiB, MAP_POPULATE": lambda path: mapped(path, addresses, 4 * MiB, "populate"),
        "fallocate, 4 MiB MAP_POPULATE": lambda path: mapped(path, addresses, 4 * MiB, "fallocate"),
    }
    wall: dict[str, list[float]] = {name: [] for name in rows}
    cpu: dict[str, list[float]] = {name: [] for name in rows}
    path = f"/dev/shm/bench-tmpfs-one-copy-{os.getpid()}.bin"
    for _ in range(rounds):
        for name, run in rows.items():
            started, used = time.perf_counter(), _cpu()
            try:
                run(path)
            finally:
                os.unlink(path)
            cpu[name].append(_cpu() - used)
            wall[name].append(time.perf_counter() - started)
    base = statistics.median(wall["scratch + write"])
    for name in rows:
        median = statistics.median(wall[name])
        print(f"{name:30s} wall {median:.3f} s ({median / base:.2f}x), cpu {statistics.median(cpu[name]):.3f} s")


if __name__ == "__main__":
    main()
