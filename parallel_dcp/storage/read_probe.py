"""A short measurement of cold direct reads against cold buffered ones, on a file a job reads.

``io="auto"`` for reads asks this once per file system and process (storage.read_choice.read_choice):
no rule tells which is faster (on one host O_DIRECT reads beat the page cache by 23%, on another
buffered reads with the kernel's read-ahead won by 28%), so it is measured, without root and
without writing anything:

    the largest files the job is about to read anyway (never another)
      │ the probed spans: written back if dirty, dropped from the page cache (cold pages)
      │ slots of one run of L bytes each (L: PROBE_SLICE, 32 MiB, or less: at most 1/PROBE_FRACTION
      │ of the files' bytes), each followed by a gap that nothing times, from the top of the
      │ largest file down, then the next file
      ▼
    round 1: direct    ── one run, read as the job reads a file (formats/span_read.py): requests
    round 2: buffered     of REQUEST_BYTES (1 MiB) taken in order by READERS_PER_STREAM readers
    round 3: buffered     per reading thread of the job (8 for 2), each through its own
    round 4: direct       descriptor, into fresh memory; after a buffered run a page at the end
      │                   of each read-ahead window after it is read untimed, which waits out the
      │                   kernel's read-ahead still in flight (ABBA: a drift of the device
      │                   during the probe cancels out)
      │ a block: each mode's rate = its bytes / its rounds' time
      │ direct at least as fast: done. Buffered ahead: up to PROBE_BLOCKS blocks in all (as the
      │   files hold), stopping once a block has direct ahead again; each mode's rate is the
      │   median over the blocks, so one noisy block does not decide alone
      ▼
    the spans dropped from the page cache again: the job finds the files cold, as they were

Why one long run read by the job's readers: a buffered read of a whole file is served by the
kernel's read-ahead, which grows over the first few MiB of a sequential run to its full window
(``/sys/class/bdi/<dev>/read_ahead_kb``, 8 MiB on this project's VM) and then stays ahead of the
readers. Before, the probe read separate 8 MiB slices with 2 threads, each slice one preadv:
buffered never left the ramp, and the probe saw a tie (1.21 against 1.21 GiB/s) where whole cold
loads read buffered 5-17% faster. A run of 32 MiB is four full windows past the ramp.

Fairness: each round reads below every earlier one, and read-ahead only runs forward, so no round
reads pages that an earlier buffered round had the kernel fetch; a gap is at least twice the
device's read-ahead window, so a buffered round's read-ahead, in flight when it ends, lands in the
gap and is waited out before the next round starts instead of slowing it down. Both modes read
through the job's own reader (storage.direct_read.ShardFile.read_into: in place, no bounce
buffer). What it costs: a block times 4 runs (2 of each mode: 128 MiB for a 2 GiB load, about
0.1 s on this VM), the probe at most PROBE_BLOCKS blocks, and it stops after its first direct and
buffered rounds once it has taken PROBE_MAX_S. It holds one run's buffer (PROBE_SLICE at most)
while it runs.

Longer than 300 lines because the plan of the runs, their timing and the pages dropped again after
them must agree on every offset: kept in one module, each is read beside the others.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import mmap
import os
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from parallel_dcp.storage.direct_read import REQUEST_BYTES, ShardFile
from parallel_dcp.storage.io_mode import ALIGN

__all__ = [
    "MIN_SLICE",
    "PROBE_FRACTION",
    "PROBE_MAX_S",
    "PROBE_READERS",
    "PROBE_SLICE",
    "READERS_PER_STREAM",
    "Plan",
    "ReadRates",
    "drop_cached",
    "measure_reads",
    "probe_memory",
    "probe_readers",
    "settle_read_ahead",
    "slices",
]

# A round: one run of the file of at most PROBE_SLICE bytes (a few read-ahead windows: a buffered
# read reaches the kernel's full window, as a whole load's does), and no more than
# 1 / PROBE_FRACTION of the bytes of the files measured.
PROBE_SLICE = 32 << 20
PROBE_FRACTION = 64
# The job's readers (jobs/load_files.py: SPAN_REQUESTS_PER_THREAD per reading thread, each taking
# the next REQUEST_BYTES of the file), at most PROBE_READERS.
READERS_PER_STREAM = 4
PROBE_READERS = 16
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
_SYNC_RANGE = 1 | 2 | 4  # SYNC_FILE_RANGE_WAIT_BEFORE | _WRITE | _WAIT_AFTER

# Test seams: the clock, and the read of one slice (a test fakes a device where one mode is faster).
_clock = time.perf_counter


def _read_slice(shard: ShardFile, offset: int, view: memoryview) -> None:
    """One request, as the job's reader reads it (formats/span_read.py: in place, no bounce buffer)."""
    if shard.read_into([view], offset) < view.nbytes:
        raise OSError(f"{shard.path} ended inside the bytes the read probe measures (at {offset})")


def probe_readers(streams: int) -> int:
    """The readers a measurement for a job with ``streams`` reading threads runs at once."""
    return max(1, min(streams * READERS_PER_STREAM, PROBE_READERS))


def probe_memory(streams: int) -> int:
    """What a measurement holds while it runs: one round's buffer (the readers read into it in
    place, as the job's readers read into its tensors: no bounce buffer), whatever ``streams``."""
    del streams
    return PROBE_SLICE


@dataclass(frozen=True, slots=True)
class ReadRates:
    """What :func:`measure_reads` found: bytes per second of each mode, over ``nbytes`` timed of
    each (both None, nothing read, when the file system refused O_DIRECT on the sample);
    ``slice_bytes``: the length of each round's run; ``streams``: the readers that read it."""

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


def slices(sizes: list[int], readahead: int = _DEFAULT_READAHEAD) -> Plan | None:
    """Where to probe files of ``sizes`` bytes (the largest first): one run per round, of the
    longest length (PROBE_SLICE, halved down to :data:`MIN_SLICE`) that is at most
    1 / PROBE_FRACTION of their bytes and leaves room for four rounds and their gaps; None when
    they cannot hold four rounds of :data:`MIN_SLICE`. Within a file the rounds go from the top
    down (see the module docstring); a small file adds its few slots after a larger one."""
    length = PROBE_SLICE
    while length > MIN_SLICE and length * PROBE_FRACTION > sum(sizes):
        length //= 2
    while length >= MIN_SLICE:
        gap = max(length, 2 * readahead)
        step = length + gap
        slots = [(f, k * step) for f, size in enumerate(sizes) for k in range(size // step - 1, -1, -1)]
        if len(slots) >= len(_ROUNDS):
            rounds = len(_ROUNDS) * min(PROBE_BLOCKS, len(slots) // len(_ROUNDS))
            return Plan(length, gap, [[slot] for slot in slots[:rounds]])
        length //= 2
    return None


def readahead_bytes(device: int) -> int:
    """The read-ahead window of the file system on ``device`` (an ``st_dev``), from sysfs."""
    name = f"{os.major(device)}:{os.minor(device)}"
    for where in (f"/sys/class/bdi/{name}/read_ahead_kb", f"/sys/dev/block/{name}/../queue/read_ahead_kb"):
        with contextlib.suppress(OSError, ValueError), open(where, encoding="ascii") as f:
            return min(_MAX_READAHEAD, int(f.read().strip()) << 10)
    return _DEFAULT_READAHEAD


def measure_reads(paths: Sequence[str | os.PathLike[str]], streams: int = 1) -> ReadRates | None:
    """Cold direct against cold buffered reads of runs of ``paths`` (files of one file system,
    the largest first; see the module docstring), each read as a job with ``streams`` reading
    threads reads it; None when they are too small to measure.

    Raises:
        OSError, UnsafeCheckpointError, CorruptCheckpointError: as the job's own read of them
            would (each is opened by the same rule, storage.safe_files.open_regular).
    """
    files = [Path(p) for p in paths]
    held: list[ShardFile] = []  # one buffered descriptor per file, for the page-cache hints
    buffer: mmap.mmap | None = None
    try:
        for path in files:
            held.append(ShardFile(path, io="buffered"))
        plan = slices([h.size for h in held], readahead_bytes(os.fstat(held[0].fd).st_dev))
        if plan is None:
            return None
        readers = probe_readers(streams)
        for index, shard in enumerate(held):
            drop_cached(shard.fd, plan.span(index))
        blocks: list[dict[bool, list[float]]] = []  # per ABBA block: each mode's seconds and bytes
        started = _clock()
        with cf.ThreadPoolExecutor(max_workers=readers, thread_name_prefix="pdcp-read-probe") as pool:
            for number, [(file, offset)] in enumerate(plan.rounds):
                is_direct = _ROUNDS[number % len(_ROUNDS)]
                if number % len(_ROUNDS) == 0:
                    if blocks and _direct_holds(blocks[-1]):
                        break  # direct kept its lead: nothing to confirm
                    blocks.append({True: [0.0, 0.0], False: [0.0, 0.0]})
                # one descriptor per reader, as each of the job's readers opens its own
                shards = [ShardFile(files[file], io="direct" if is_direct else "buffered") for _ in range(readers)]
                try:
                    if is_direct and not all(shard.direct for shard in shards):
                        # the file system refused O_DIRECT on this file: nothing to compare
                        return ReadRates(direct=None, buffered=None, nbytes=0, slice_bytes=plan.length, streams=readers)
                    # fresh memory, its pages faulted in inside the reads, as the job's tensors are
                    buffer = mmap.mmap(-1, plan.length)
                    blocks[-1][is_direct][0] += _round(pool, shards, offset, memoryview(buffer))
                finally:
                    for shard in shards:
                        shard.close()
                    if buffer is not None:
                        buffer.close()
                        buffer = None
                blocks[-1][is_direct][1] += plan.length
                if not is_direct:
                    settle_read_ahead(files[file], offset, plan.length, plan.gap)
                if number >= 1 and _clock() - started > PROBE_MAX_S:
                    break
        for index, shard in enumerate(held):
            drop_cached(shard.fd, plan.span(index))
        measured = [b for b in blocks if b[True][1] and b[False][1]]
        return ReadRates(
            direct=statistics.median([_rate(b[True]) for b in measured]),
            buffered=statistics.median([_rate(b[False]) for b in measured]),
            nbytes=int(sum(b[True][1] for b in measured)),
            slice_bytes=plan.length,
            streams=readers,
            blocks=len(measured),
        )
    finally:
        for shard in held:
            shard.close()
        if buffer is not None:
            buffer.close()


def _rate(timed: list[float]) -> float:
    """Bytes per second of [seconds, bytes]."""
    return timed[1] / max(timed[0], 1e-9)


def _direct_holds(block: dict[bool, list[float]]) -> bool:
    """Whether a block measured direct at least as fast as buffered."""
    return bool(block[True][1] and block[False][1]) and _rate(block[True]) >= _rate(block[False])


def _round(pool: cf.ThreadPoolExecutor, shards: list[ShardFile], offset: int, buffer: memoryview) -> float:
    """Seconds for the run of ``buffer.nbytes`` bytes at ``offset``, read as the job reads a file:
    requests of REQUEST_BYTES, each reader (one per shard) taking the next in order."""
    requests = iter(range(0, buffer.nbytes, REQUEST_BYTES))
    lock = threading.Lock()

    def reader(shard: ShardFile) -> None:
        while True:
            with lock:
                at = next(requests, None)
            if at is None:
                return
            _read_slice(shard, offset + at, buffer[at : at + REQUEST_BYTES])

    start = _clock()
    futures = [pool.submit(reader, shard) for shard in shards]
    for future in futures:
        future.result()
    return _clock() - start


def settle_read_ahead(path: Path, offset: int, length: int, gap: int) -> None:
    """Wait out the read-ahead a buffered slice left in flight: one page at the end of each of the
    two read-ahead windows after it, read untimed on a descriptor without read-ahead (a page being
    read ahead is waited for; a page that is not costs one small read, and starts no new
    read-ahead)."""
    shard = ShardFile(path, io="buffered")
    page = memoryview(bytearray(ALIGN))
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(shard.fd, 0, 0, os.POSIX_FADV_RANDOM)
        end = offset + length
        for at in (end + gap // 2 - ALIGN, end + gap - ALIGN):
            shard.read(at, [page])
    finally:
        shard.close()


def drop_cached(fd: int, span: int) -> None:
    """Write back the span's dirty pages (a file written a moment ago) and drop its pages from the
    page cache, so that buffered reads of it are cold."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sync_file_range(ctypes.c_int(fd), ctypes.c_int64(0), ctypes.c_int64(span), ctypes.c_uint(_SYNC_RANGE))
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, span, os.POSIX_FADV_DONTNEED)
