"""Each I/O transient admission counts, run for real and measured: ``python -m tests.memory_io_cases
CASE DIR`` prints ``{"measured": bytes, "counted": bytes}``.

Run in a fresh process (no other thread, no child: the process's own high-water mark is the
measurement) with glibc told to map every allocation over 128 KiB on its own and to
return freed memory at once (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``): otherwise
memory an earlier step freed (the test data's temporaries) is reused without a new page and the
measured object looks free. Measured this way every allocation it makes shows, an upper bound.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from parallel_dcp.engine.memory import ZSTD_DECOMPRESS_BYTES, ZSTD_SMALL_RECORD_BYTES
from parallel_dcp.storage.compression import BoundedDecompressor, Compression, RecordCompressor, decompress_small
from parallel_dcp.storage.direct_write import DirectFile, direct_write_memory

MiB = 1024 * 1024
ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "MALLOC_TRIM_THRESHOLD_": "0"}


def payload(nbytes: int) -> memoryview:
    """Float32 noise and a run of zeros: zstd finds matches (its tables fill) but gains little."""
    out = bytearray(nbytes)
    noise = torch.randn(nbytes // 8, generator=torch.Generator().manual_seed(0))
    out[: noise.numel() * 4] = noise.numpy().tobytes()
    return memoryview(out)


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _measure(run: Callable[[], None]) -> int:
    """The most ``run`` made this process hold at once: the kernel's resident high-water mark
    (VmHWM, reset to the present by ``clear_refs``) over the resident size before it. Exact where
    a sampler can miss a peak of a few milliseconds; resident pages include code first faulted in
    (not charged by the governor), so this errs high, never low."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = _status("VmRSS")
    run()
    return _status("VmHWM") - before


# Files smaller than the four aligned buffers: the count is the buffers they fill (a shard of a
# few MiB, one just under two buffers, one just over).
DIRECT_SMALL_SIZES = (100 * 1024, 8 * MiB - 4096, 13 * MiB + 5)


def direct(where: Path, size: int = 64 * MiB) -> tuple[int, int]:
    data = payload(size)
    fd = os.open(where / "shard", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT)

    def run() -> None:
        stream = DirectFile(fd)
        for start in range(0, len(data), 3 * MiB + 5):  # pieces that straddle the buffers
            stream.write(data[start : start + 3 * MiB + 5])
        stream.flush()
        stream.close()

    try:
        measured = _measure(run)
    finally:
        os.close(fd)
    assert (where / "shard").read_bytes() == data
    return measured, direct_write_memory(size)


def compress(where: Path, level: int) -> tuple[int, int]:
    data = payload(24 * MiB)
    compression = Compression(level=level)

    def run() -> None:
        with open(where / "shard", "wb") as shard:
            writer = RecordCompressor(shard, compression)
            for size in (len(data), None):  # a record of known size, then a streamed one
                with writer.record(size) as record:
                    record.write(data)

    return _measure(run), compression.memory()


def _compressed(path: Path, data: memoryview, level: int) -> int:
    with open(path, "wb") as shard:
        with RecordCompressor(shard, Compression(level=level)).record(None) as record:
            record.write(data)
        return shard.tell()


def stream(where: Path, level: int) -> tuple[int, int]:
    size = 24 * MiB if level < 10 else 12 * MiB  # level 19 compresses slowly
    data = payload(size)
    length = _compressed(where / "shard", data, level)
    target = memoryview(bytearray(size))  # the tensor it fills: the item's own bytes, counted apart

    def run() -> None:
        with BoundedDecompressor(where / "shard", 0, length, "k", size) as reader:
            for start in range(0, size, MiB):
                reader.readinto(target[start : start + MiB])

    measured = _measure(run)
    assert target == data
    return measured, ZSTD_DECOMPRESS_BYTES


def small(where: Path) -> tuple[int, int]:
    data = payload(ZSTD_SMALL_RECORD_BYTES)
    length = _compressed(where / "shard", data, 3)
    out: list[bytes] = []
    measured = _measure(lambda: out.append(decompress_small(where / "shard", 0, length, "k", len(data))))
    assert out[0] == data
    return measured, ZSTD_DECOMPRESS_BYTES


if __name__ == "__main__":
    case, where = sys.argv[1], Path(sys.argv[2])
    cases: dict[str, Callable[[], tuple[int, int]]] = {
        "direct": lambda: direct(where),
        **{f"direct:{size}": (lambda size=size: direct(where, size)) for size in DIRECT_SMALL_SIZES},
        "small": lambda: small(where),
        **{f"compress:{level}": (lambda level=level: compress(where, level)) for level in (1, 3, 9)},
        **{f"stream:{level}": (lambda level=level: stream(where, level)) for level in (3, 19)},
    }
    measured, counted = cases[case]()
    print(json.dumps({"measured": measured, "counted": counted}))
