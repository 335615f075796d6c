"""How a conversion reads its local source under ``io="auto"``: through the O_DIRECT ring or the
mmap, chosen by measuring both beside the conversion's own writes (storage.copy_probe), once per
(source file system, destination file system) and process.

    copy_choice(files, destination, streams) ──▶ remembered for (source st_dev, destination st_dev)
                                             ──▶ else copy_probe.measure_copies: ring and mmap
                                                 rates, each copying runs of the largest files
                                                 into the destination's file system
                                             ──▶ ReadChoice(reads="direct": the ring, or
                                                 "buffered": the mmap; rates, probe seconds)

Why not storage.read_choice's cold reads alone: a conversion's writes share the device with its
reads. On this project's VM the read probe found direct 1.54 against buffered 1.04 GiB/s, yet a
cold 1 GiB conversion through the ring took 1.69 s where the mmap took 1.47 s
(bench/quiet-run-2026-12-05d.txt).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from parallel_dcp.errors import CorruptCheckpointError, UnsafeCheckpointError
from parallel_dcp.storage import copy_probe
from parallel_dcp.storage.read_choice import ReadChoice

__all__ = ["RING_MARGIN", "copy_choice", "copy_probe_count", "forget_copy_choices"]

# The ring is chosen only where it moved bytes faster than the mmap by at least this much. Within it
# the mmap converted faster: on this project's VM the probe had the mmap ahead by up to 13% or the
# two tied (ring 0.55-0.60, mmap 0.59-0.63 GiB/s, 32 MiB runs at w=2) while whole cold 1 GiB
# conversions took 1.48 s through the mmap against 1.62 s through the ring (medians of 3, one run).
RING_MARGIN = 1.10

_choices: dict[tuple[int, int], ReadChoice] = {}
_lock = threading.Lock()
_probes = 0


def copy_probe_count() -> int:
    """How many conversion read measurements this process has run."""
    return _probes


def forget_copy_choices() -> None:
    """Forget every measured choice: the next conversion under ``io="auto"`` measures again."""
    with _lock:
        _choices.clear()


def copy_choice(
    files: Sequence[str | os.PathLike[str]],
    destination: str | os.PathLike[str],
    streams: int,
    *,
    direct_writes: bool,
    save_id: str,
) -> ReadChoice:
    """How a conversion writing into the directory ``destination`` with ``streams`` workers reads
    ``files`` (its local source files of at least ``io_mode.DIRECT_MIN_BYTES``, the largest
    first): ``reads="direct"`` (``io="auto"``: the O_DIRECT ring) where the ring measured at
    least :data:`RING_MARGIN` times the mmap's rate, else ``reads="buffered"`` (the mmap).
    Measured once per (source file system, destination file system) and process; a later
    conversion between the same two reports the first one's figures. A probe that cannot run
    (an error of the files or the destination: the conversion's own reads and writes report it)
    keeps the mmap, remembering nothing. ``save_id``: the save whose staging directory
    ``destination`` is (the probe's scratch files are named as its temporary files)."""
    key = (os.stat(files[0]).st_dev, os.stat(destination).st_dev)
    with _lock:
        known = _choices.get(key)
        if known is None:
            known = _measure([os.fspath(f) for f in files], Path(destination), streams, direct_writes, save_id)
            if known.probed is not None:
                _choices[key] = known
    return known


def _measure(files: list[str], destination: Path, streams: int, direct_writes: bool, save_id: str) -> ReadChoice:
    global _probes
    _probes += 1
    writes = "direct" if direct_writes else "buffered"
    start = time.perf_counter()
    try:
        rates = copy_probe.measure_copies(files, destination, streams, direct_writes=direct_writes, save_id=save_id)
    except (OSError, UnsafeCheckpointError, CorruptCheckpointError) as exc:
        return ReadChoice("auto", "buffered", f"could not measure {files[0]} beside writes to {destination}: {exc}")
    if rates is None:
        return ReadChoice("auto", "buffered", "too small to measure beside writes: the mmap")
    if rates.ring is None or rates.mmap is None:
        return ReadChoice("buffered", "buffered", f"the file system of {files[0]} refuses O_DIRECT", probed=files[0])
    ring = rates.ring >= RING_MARGIN * rates.mmap
    return ReadChoice(
        "auto" if ring else "buffered",
        "direct" if ring else "buffered",
        "measured beside writes"
        if ring or rates.ring < rates.mmap
        else f"measured beside writes (the ring ahead by less than {RING_MARGIN - 1:.0%}: the mmap)",
        direct_bytes_per_s=rates.ring,
        buffered_bytes_per_s=rates.mmap,
        probed=files[0],
        probe_seconds=time.perf_counter() - start,
        probe_blocks=1,
        beside_writes=f"{writes} writes to {destination} ({rates.streams} x {rates.run_bytes >> 20} MiB runs)",
    )
