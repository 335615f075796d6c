"""A short measurement of how a conversion should read its source: the O_DIRECT ring against the
mmap, each while writing what it read to the destination's file system, as a conversion does.

A cold read alone (storage.read_probe) does not decide a conversion: on this project's VM it found
direct reads 1.54 GiB/s against buffered 1.04, yet a 1 GiB safetensors -> DCP conversion through
the O_DIRECT ring took 1.69 s where the mmap took 1.47 s, the writes sharing the device with the
reads. So ``io="auto"`` measures the conversion's own traffic, once per (source file system,
destination file system) and process (storage.copy_choice), without root:

    the largest source files the conversion reads anyway (nothing else is read)
      │ the probed spans: written back if dirty, dropped from the page cache (cold pages)
      │ per round, one run of L bytes per stream (the conversion's workers), each stream copying
      │ its run into a new file in the destination's staging directory (a temporary file of
      │ the save, by name), written as the conversion writes its shards (O_DIRECT through the
      │ aligned buffers, or buffered + fsync)
      ▼
    round 1: ring    ── storage.read_ahead.ReadAhead (O_DIRECT pieces read ahead) -> the writer
    round 2: mmap    ── the file's pages mapped, copied into the writer (the kernel reads around
    round 3: mmap       the faults), as a worker writes a tensor that is a view of the mmap
    round 4: ring       (ABBA: a drift of the device during the probe cancels out)
      │ each mode's rate: its bytes over its rounds' time, the writes on the device included
      │ (the scratch files are removed after each round, untimed)
      ▼
    the spans dropped from the page cache again: the conversion finds the source cold

Fairness as in storage.read_probe: the runs go from the top of the largest file down, each
followed by a gap of at least twice the read-ahead window that no round reads, so a round never
reads pages an earlier mmap round had the kernel fetch, and the read-ahead an mmap round left in
flight is waited out (storage.read_probe.settle_read_ahead) before the next round. What it costs:
4 rounds of ``streams`` runs (32 MiB each at most, and all runs together at most 1 / PROBE_FRACTION
of the files: 256 MiB read and as much written for a 1 GiB source at w=2, about 0.5 s on this
project's VM, paid by the first conversion between two file systems in a process); it holds what
:func:`probe_memory` says while it runs.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import mmap
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from parallel_dcp.storage import read_ahead, read_probe
from parallel_dcp.storage.direct_read import ShardFile
from parallel_dcp.storage.direct_write import direct_write_memory, new_file
from parallel_dcp.storage.ownership import temp_name
from parallel_dcp.storage.read_ahead import ReadAhead, Ring, Span
from parallel_dcp.storage.safe_files import open_regular

__all__ = ["MIN_RUN", "PROBE_FRACTION", "PROBE_RUN", "CopyRates", "measure_copies", "plan", "probe_memory"]

# One stream's run per round: a few read-ahead windows (the mmap's read-around reaches its full
# window), and all runs of the four rounds together no more than 1 / PROBE_FRACTION of the files.
# Below MIN_RUN the probe measures the setting up of each run (the writer's buffers faulted in, the
# ring's threads) more than the device: on this project's VM, runs of 8 MiB at w=2 had the ring
# ahead (0.45 against 0.37 GiB/s) where whole conversions were 12% faster through the mmap; runs of
# 32 MiB had the mmap ahead or the two tied. A source too small for that is converted through the mmap unmeasured.
PROBE_RUN = 32 << 20
MIN_RUN = 16 << 20
PROBE_FRACTION = 4
# The order of the rounds: ring (True), mmap, mmap, ring.
_ROUNDS = (True, False, False, True)
SCRATCH_NAME = "parallel_dcp-copy-probe"

# Test seams: the clock, and one stream's copy of one run (a test fakes a device where one wins).
_clock = time.perf_counter


@dataclass(frozen=True, slots=True)
class CopyRates:
    """What :func:`measure_copies` found: bytes per second each mode moved (read and written
    again) over ``nbytes`` timed of each; ``run_bytes``: one stream's run per round;
    ``streams``: the runs copied at once; ``direct_writes``: how the scratch files were written.
    ``ring`` is None (nothing measured) where the source's file system refused O_DIRECT."""

    ring: float | None
    mmap: float | None
    nbytes: int
    run_bytes: int
    streams: int
    direct_writes: bool


def plan(sizes: list[int], streams: int, readahead: int) -> read_probe.Plan | None:
    """Where ``streams`` streams copy from files of ``sizes`` bytes (the largest first) in each of
    the four rounds: runs of the longest length (PROBE_RUN, halved down to MIN_RUN) whose four
    rounds together take at most 1 / PROBE_FRACTION of the bytes; None where not even MIN_RUN
    runs fit that share, or the files cannot hold them with their gaps."""
    need = len(_ROUNDS) * streams
    length = PROBE_RUN
    while length > MIN_RUN and length * need * PROBE_FRACTION > sum(sizes):
        length //= 2
    if length * need * PROBE_FRACTION > sum(sizes):
        return None
    gap = max(length, 2 * readahead)
    step = length + gap
    slots = [(f, k * step) for f, size in enumerate(sizes) for k in range(size // step - 1, -1, -1)]
    if len(slots) < need:
        return None
    return read_probe.Plan(length, gap, [slots[r * streams : (r + 1) * streams] for r in range(len(_ROUNDS))])


def _ring() -> Ring:
    """The ring a conversion's task reads through when its room holds the full one."""
    return Ring(read_ahead.DEPTH, read_ahead.PIECE_BYTES)


def probe_memory(streams: int, *, direct_writes: bool) -> int:
    """What a measurement with ``streams`` streams holds while it runs: each stream's writer
    buffers, and its ring or its run's mapped pages (whichever is larger)."""
    per_stream = max(_ring().memory, PROBE_RUN) + (direct_write_memory() if direct_writes else 0)
    return streams * per_stream


def measure_copies(
    paths: Sequence[str | os.PathLike[str]],
    destination: str | os.PathLike[str],
    streams: int,
    *,
    direct_writes: bool,
    save_id: str,
) -> CopyRates | None:
    """The ring against the mmap, each copying runs of ``paths`` (the source files of one file
    system, the largest first) into new files in the directory ``destination`` with ``streams``
    streams at once (see the module docstring); None when the files are too small to measure.
    The scratch files carry the names of temporary files of the save ``save_id``
    (storage.ownership.temp_name), so that one a killed process left behind is that save's
    leftover, which the next save to the destination removes.

    Raises:
        OSError, UnsafeCheckpointError, CorruptCheckpointError: as the conversion's own read of
            the files, or its writes to ``destination``, would.
    """
    files = [Path(p) for p in paths]
    held: list[ShardFile] = []  # one buffered descriptor per file, for the page-cache hints
    try:
        for path in files:
            held.append(ShardFile(path, io="buffered"))
        device = os.fstat(held[0].fd).st_dev
        copy_plan = plan([h.size for h in held], streams, read_probe.readahead_bytes(device))
        if copy_plan is None:
            return None
        probe = ShardFile(files[copy_plan.rounds[0][0][0]], io="direct")
        refused = not probe.direct
        probe.close()
        if refused:
            return CopyRates(None, None, 0, copy_plan.length, streams, direct_writes)
        for index, shard in enumerate(held):
            read_probe.drop_cached(shard.fd, copy_plan.span(index))
        timed = {True: 0.0, False: 0.0}
        moved = {True: 0, False: 0}
        with cf.ThreadPoolExecutor(max_workers=streams, thread_name_prefix="pdcp-copy-probe") as pool:
            for number, runs in enumerate(copy_plan.rounds):
                ring = _ROUNDS[number]
                timed[ring] += _round(
                    pool, files, runs, copy_plan.length, Path(destination), ring, direct_writes, save_id
                )
                moved[ring] += copy_plan.length * len(runs)
                if not ring:
                    for file, offset in runs:
                        read_probe.settle_read_ahead(files[file], offset, copy_plan.length, copy_plan.gap)
        for index, shard in enumerate(held):
            read_probe.drop_cached(shard.fd, copy_plan.span(index))
        return CopyRates(
            ring=moved[True] / max(timed[True], 1e-9),
            mmap=moved[False] / max(timed[False], 1e-9),
            nbytes=moved[True],
            run_bytes=copy_plan.length,
            streams=streams,
            direct_writes=direct_writes,
        )
    finally:
        for shard in held:
            shard.close()


def _round(
    pool: cf.ThreadPoolExecutor,
    files: list[Path],
    runs: list[tuple[int, int]],
    length: int,
    directory: Path,
    ring: bool,
    direct_writes: bool,
    save_id: str,
) -> float:
    """Seconds for the streams to copy their runs (read, written, on the device); the scratch
    files are removed afterwards, untimed."""
    names = [temp_name(f"{SCRATCH_NAME}.{secrets.token_hex(6)}", save_id) for _ in runs]
    start = _clock()
    futures = [
        pool.submit(_copy, files[file], offset, length, directory, name, ring, direct_writes)
        for (file, offset), name in zip(runs, names, strict=True)
    ]
    try:
        for future in futures:
            future.result()
        return _clock() - start
    finally:
        cf.wait(futures)
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / name)


def _copy(path: Path, offset: int, length: int, directory: Path, name: str, ring: bool, direct_writes: bool) -> None:
    """One stream's run: ``length`` bytes of ``path`` at ``offset`` into the new file ``name`` in
    ``directory`` (created by the one rule, storage.direct_write.new_file), read through the ring
    or the mmap, written as the conversion writes its shards."""
    with new_file(directory / name, direct=direct_writes) as stream:
        if ring:
            with ReadAhead([Span(os.fspath(path), offset, length)], _ring(), "direct") as reader:
                reader.read_span(0, stream.write)
        else:
            _copy_mapped(path, offset, length, stream)
        if not direct_writes:
            stream.flush()
            os.fsync(stream.fileno())


def _copy_mapped(path: Path, offset: int, length: int, stream: object) -> None:
    """The run's bytes through a mapping of the file, as a worker writes a tensor that is a view
    of the safetensors library's mmap (the writer copies it out in one call)."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    fd = open_regular(None, path)
    try:
        mapped = mmap.mmap(fd, offset + length - start, prot=mmap.PROT_READ, offset=start)
    finally:
        os.close(fd)
    try:
        with memoryview(mapped) as view:
            stream.write(view[offset - start :])  # type: ignore[attr-defined]
    finally:
        mapped.close()
