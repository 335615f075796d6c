"""A short measurement of cold direct reads against cold buffered ones, on a file a job reads.

``io="auto"`` for reads asks this once per file system and process (storage.read_choice.read_choice):
no rule tells which is faster (on one host O_DIRECT reads beat the page cache by 23%, on another
buffered reads with the kernel's read-ahead won by 28%), so it is measured, without root and
without writing anything:

    the largest files the job is about to read anyway (never another)
      │ the probed spans: written back if dirty, dropped from the page cache (cold pages)
      │ slots of S bytes (S <= PROBE_SLICE), each followed by a gap that nothing times,
      │ from the top of the largest file down, then the next file
      ▼
    round 1: direct    ── `streams` slices at once, each by its own thread (as the job reads)
    round 2: buffered  ── then a page at the end of each read-ahead window after its slices is
    round 3: buffered     read untimed, which waits out the kernel's read-ahead still in flight
    round 4: direct       (ABBA: a drift of the device during the probe cancels out)
      │ a block: each mode's rate = its bytes / its rounds' time
      │ direct at least as fast: done. Buffered ahead: up to PROBE_BLOCKS blocks in all (as the
      │   files hold), stopping once a block has direct ahead again; each mode's rate is the
      │   median over the blocks, so one noisy block (a busy machine: buffered 1.39x ahead in
      │   one block while whole loads read direct faster) does not decide alone
      ▼
    the spans dropped from the page cache again: the job finds the files cold, as they were

Fairness: each round reads below every earlier one, and read-ahead only runs forward, so no round
reads pages that an earlier buffered round had the kernel fetch; a gap is at least twice the
device's read-ahead window (``/sys/class/bdi/<dev>/read_ahead_kb``), so a buffered round's
read-ahead, in flight when it ends, lands in the gap and is waited out before the next round
starts instead of slowing it down. Both modes read through the job's own code
(storage.direct_read.ShardFile: aligned 4 MiB pieces, the next in flight, bounce buffers in place
before the clock starts, for direct; one preadv per slice for buffered) with as many streams as
the job's reading threads (at most PROBE_STREAMS). A block times at most
``4 * PROBE_STREAMS * PROBE_SLICE`` bytes (64 MiB; the probe at most PROBE_BLOCKS of them), and
the probe stops after its first direct and buffered rounds once it has taken PROBE_MAX_S. Each
stream holds one slice buffer and the direct reader's bounce buffers: no more than a reading
thread of the job reserves (jobs/load.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import mmap
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from parallel_dcp.storage.direct_read import ShardFile, direct_read_memory
from parallel_dcp.storage.io_mode import ALIGN

__all__ = [
    "MIN_SLICE",
    "PROBE_MAX_S",
    "PROBE_SLICE",
    "PROBE_STREAMS",
    "ReadRates",
    "measure_reads",
    "probe_memory",
    "slices",
]

PROBE_SLICE = 8 << 20
PROBE_STREAMS = 2
# Below this a slice measures the request's latency more than the device's rate.
MIN_SLICE = 1 << 20
PROBE_MAX_S = 2.0
# The read-ahead window assumed where sysfs does not tell it, and the most a gap is sized for.
_DEFAULT_READAHEAD = 8 << 20
_MAX_READAHEAD = 64 << 20
# The order of the rounds of a block: direct, buffered, buffered, direct.
_ROUNDS = (True, False, False, True)
# Blocks a probe may run: a second and third only where the first (or second) measured buffered
# ahead, and each mode's rate is then the median over the blocks (one noisy block decides nothing).
PROBE_BLOCKS = 3
_POPULATED = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
_SYNC_RANGE = 1 | 2 | 4  # SYNC_FILE_RANGE_WAIT_BEFORE | _WRITE | _WAIT_AFTER

# Test seams: the clock, and the read of one slice (a test fakes a device where one mode is faster).
_clock = time.perf_counter


def _read_slice(shard: ShardFile, offset: int, view: memoryview) -> None:
    shard.read(offset, [view])


def probe_memory(streams: int) -> int:
    """What a measurement with ``streams`` reading threads holds while it runs: a slice buffer and
    the direct reader's bounce buffers per stream (at most PROBE_STREAMS streams)."""
    return max(1, min(streams, PROBE_STREAMS)) * (PROBE_SLICE + direct_read_memory())


@dataclass(frozen=True, slots=True)
class ReadRates:
    """What :func:`measure_reads` found: bytes per second of each mode, over ``nbytes`` timed of
    each (both None, nothing read, when the file system refused O_DIRECT on the sample)."""

    direct: float | None
    buffered: float | None
    nbytes: int
    slice_bytes: int
    streams: int
    blocks: int = 1


@dataclass(frozen=True, slots=True)
class Plan:
    """Where the probe reads: ``rounds[r][s]`` is the (file, offset) that stream ``s`` reads in
    round ``r`` (a file by its index in the list given); every slice is ``length`` bytes and
    followed by ``gap`` bytes that no round times."""

    length: int
    gap: int
    rounds: list[list[tuple[int, int]]]

    def span(self, file: int) -> int:
        """The bytes of ``file``, from its start, that the probe touches (0: none)."""
        ends = [o + self.length + self.gap for r in self.rounds for f, o in r if f == file]
        return max(ends, default=0)


def slices(sizes: list[int], streams: int, readahead: int = _DEFAULT_READAHEAD) -> Plan | None:
    """Where to probe files of ``sizes`` bytes (the largest first) with up to ``streams``
    streams; None when they cannot hold four rounds of slices of at least :data:`MIN_SLICE` and
    their gaps. Larger slices are preferred to more streams. Within a file the rounds go from the
    top down (see the module docstring); a small file adds its few slots after a larger one."""
    for length in (PROBE_SLICE, PROBE_SLICE // 2, PROBE_SLICE // 4, MIN_SLICE):
        gap = max(length, 2 * readahead)
        step = length + gap
        slots = [(f, k * step) for f, size in enumerate(sizes) for k in range(size // step - 1, -1, -1)]
        for count in range(max(1, min(streams, PROBE_STREAMS)), 0, -1):
            if len(slots) >= len(_ROUNDS) * count:
                blocks = min(PROBE_BLOCKS, len(slots) // (len(_ROUNDS) * count))
                rounds = len(_ROUNDS) * blocks
                return Plan(length, gap, [slots[r * count : (r + 1) * count] for r in range(rounds)])
    return None


def readahead_bytes(device: int) -> int:
    """The read-ahead window of the file system on ``device`` (an ``st_dev``), from sysfs."""
    name = f"{os.major(device)}:{os.minor(device)}"
    for where in (f"/sys/class/bdi/{name}/read_ahead_kb", f"/sys/dev/block/{name}/../queue/read_ahead_kb"):
        with contextlib.suppress(OSError, ValueError), open(where, encoding="ascii") as f:
            return min(_MAX_READAHEAD, int(f.read().strip()) << 10)
    return _DEFAULT_READAHEAD


def measure_reads(paths: Sequence[str | os.PathLike[str]], streams: int = 1) -> ReadRates | None:
    """Cold direct against cold buffered reads of slices of ``paths`` (files of one file system,
    the largest first; see the module docstring); None when they are too small to measure.

    Raises:
        OSError, UnsafeCheckpointError, CorruptCheckpointError: as the job's own read of them
            would (each is opened by the same rule, storage.safe_files.open_regular).
    """
    files = [Path(p) for p in paths]
    held: list[ShardFile] = []  # one buffered descriptor per file, for the page-cache hints
    buffers: list[mmap.mmap] = []
    try:
        for path in files:
            held.append(ShardFile(path, io="buffered"))
        plan = slices([h.size for h in held], streams, readahead_bytes(os.fstat(held[0].fd).st_dev))
        if plan is None:
            return None
        count = len(plan.rounds[0])
        buffers = [mmap.mmap(-1, plan.length, flags=_POPULATED) for _ in range(count)]
        for index, shard in enumerate(held):
            _cold(shard.fd, plan.span(index))
        blocks: list[dict[bool, list[float]]] = []  # per ABBA block: each mode's seconds and bytes
        started = _clock()
        with cf.ThreadPoolExecutor(max_workers=count, thread_name_prefix="pdcp-read-probe") as pool:
            for number, slots in enumerate(plan.rounds):
                is_direct = _ROUNDS[number % len(_ROUNDS)]
                if number % len(_ROUNDS) == 0:
                    if blocks and _direct_holds(blocks[-1]):
                        break  # direct kept its lead: nothing to confirm
                    blocks.append({True: [0.0, 0.0], False: [0.0, 0.0]})
                shards = [ShardFile(files[f], io="direct" if is_direct else "buffered") for f, _ in slots]
                try:
                    if is_direct and not all(shard.direct for shard in shards):
                        # the file system refused O_DIRECT on this file: nothing to compare
                        return ReadRates(direct=None, buffered=None, nbytes=0, slice_bytes=plan.length, streams=count)
                    for shard in shards:
                        shard.prepare()  # the bounce buffers in place before the clock starts, as in a running job
                    blocks[-1][is_direct][0] += _round(pool, shards, [o for _, o in slots], buffers)
                finally:
                    for shard in shards:
                        shard.close()
                blocks[-1][is_direct][1] += plan.length * count
                if not is_direct:
                    for f, offset in slots:
                        _settle(files[f], offset, plan, buffers[0])
                if number >= 1 and _clock() - started > PROBE_MAX_S:
                    break
        for index, shard in enumerate(held):
            _cold(shard.fd, plan.span(index))
        measured = [b for b in blocks if b[True][1] and b[False][1]]
        return ReadRates(
            direct=statistics.median([_rate(b[True]) for b in measured]),
            buffered=statistics.median([_rate(b[False]) for b in measured]),
            nbytes=int(sum(b[True][1] for b in measured)),
            slice_bytes=plan.length,
            streams=count,
            blocks=len(measured),
        )
    finally:
        for shard in held:
            shard.close()
        for buffer in buffers:
            buffer.close()


def _rate(timed: list[float]) -> float:
    """Bytes per second of [seconds, bytes]."""
    return timed[1] / max(timed[0], 1e-9)


def _direct_holds(block: dict[bool, list[float]]) -> bool:
    """Whether a block measured direct at least as fast as buffered."""
    return bool(block[True][1] and block[False][1]) and _rate(block[True]) >= _rate(block[False])


def _round(pool: cf.ThreadPoolExecutor, shards: list[ShardFile], offsets: list[int], buffers: list[mmap.mmap]) -> float:
    """Seconds for ``len(offsets)`` slices read at once, one per stream."""
    start = _clock()
    futures = [
        pool.submit(_read_slice, shard, offset, memoryview(buffer))
        for shard, offset, buffer in zip(shards, offsets, buffers, strict=True)
    ]
    for future in futures:
        future.result()
    return _clock() - start


def _settle(path: Path, offset: int, plan: Plan, buffer: mmap.mmap) -> None:
    """Wait out the read-ahead a buffered slice left in flight: one page at the end of each of the
    two read-ahead windows after it, read untimed on a descriptor without read-ahead (a page being
    read ahead is waited for; a page that is not costs one small read, and starts no new
    read-ahead)."""
    shard = ShardFile(path, io="buffered")
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(shard.fd, 0, 0, os.POSIX_FADV_RANDOM)
        page = memoryview(buffer)[:ALIGN]
        end = offset + plan.length
        for at in (end + plan.gap // 2 - ALIGN, end + plan.gap - ALIGN):
            shard.read(at, [page])
    finally:
        shard.close()


def _cold(fd: int, span: int) -> None:
    """Write back the span's dirty pages (a file written a moment ago) and drop its pages from the
    page cache, so that buffered reads of it are cold."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sync_file_range(ctypes.c_int(fd), ctypes.c_int64(0), ctypes.c_int64(span), ctypes.c_uint(_SYNC_RANGE))
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, span, os.POSIX_FADV_DONTNEED)
