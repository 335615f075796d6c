"""How a job reads its local files under ``io="auto"``: chosen by measurement, once per file
system and process (storage.read_probe reads cold direct and cold buffered slices of the files the
job is about to read; the faster wins).

    read_choice(io, where, files) ──▶ "buffered" / "direct" asked: as asked, nothing measured
                                  ──▶ tmpfs, object storage (storage.io_mode): buffered
                                  ──▶ "auto": the largest files measured (read_probe), remembered
                                      per st_dev: ReadChoice(io=..., reads=..., rates)

Its own module, above storage.direct_read and storage.read_probe (which read through the direct
reader, which needs storage.io_mode's rules): io_mode stays the small rule book they all import.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parallel_dcp.errors import CorruptCheckpointError, InvalidDestinationError, UnsafeCheckpointError
from parallel_dcp.storage import io_mode, read_probe
from parallel_dcp.storage.pinned_paths import open_source

if TYPE_CHECKING:
    from parallel_dcp.storage.location import Remote

__all__ = [
    "BUFFERED_MARGIN",
    "ReadChoice",
    "forget_read_choices",
    "known_read_choice",
    "read_choice",
    "read_probe_count",
]

# Buffered is chosen only when measured faster than direct by more than this. On this project's VM
# a direct read's time does not depend on the memory it lands in, while a buffered one's does: the
# same cold 2 GiB load read buffered took 1.33 s right after another buffered read's pages were
# dropped and 1.75 s after a direct read; direct took 1.31-1.34 s after either
# (bench/read-memory-state.txt). The probe's page cache is its first 128 MiB, the job's is all of
# it: within the margin, what the probe saw of buffered may be the best case of a tie.
BUFFERED_MARGIN = 1.10


@dataclass(frozen=True, slots=True)
class ReadChoice:
    """How a job reads its local files, and why (:func:`read_choice`).

    Attributes:
        io: what to hand the readers (``ShardFile(io=...)``, ``fast_read.read_requests(io=...)``):
            ``"auto"`` (direct for files of at least :data:`~parallel_dcp.storage.io_mode.DIRECT_MIN_BYTES`, which the
            measurement chose), ``"direct"`` or ``"buffered"``.
        reads: how the large files are read: ``"direct"`` or ``"buffered"``.
        reason: why, in words (``"measured"``, the ``io`` asked for, the file system's type, ...).
        direct_bytes_per_s, buffered_bytes_per_s: the measured cold rates (None when not measured).
        probed: the file the measurement read (None when not measured).
        probe_seconds: what the measurement took (once per file system and process: a later
            choice on the same file system reports the first one's figures).
        probe_blocks: the measurement's ABBA blocks (storage.read_probe: more than one only
            where buffered led the first; the rates are then medians over them).
        beside_writes: for a conversion's source (storage.copy_choice), the writes the reads
            were measured beside; ``reads`` is then ``"direct"`` for the O_DIRECT ring and
            ``"buffered"`` for the mmap, and the rates are the bytes each moved (read and
            written) per second. None for a reader's choice (cold reads alone).
    """

    io: str
    reads: str
    reason: str
    direct_bytes_per_s: float | None = None
    buffered_bytes_per_s: float | None = None
    probed: str | None = None
    probe_seconds: float = 0.0
    probe_blocks: int = 0
    beside_writes: str | None = None

    @property
    def measured(self) -> bool:
        return self.direct_bytes_per_s is not None and self.buffered_bytes_per_s is not None

    def summary(self) -> str:
        """One line for logs and benchmark output."""
        if not self.measured:
            return f"reads {self.reads} ({self.reason})"
        assert self.direct_bytes_per_s is not None and self.buffered_bytes_per_s is not None
        if self.beside_writes is not None:
            return (
                f"reads {'through the O_DIRECT ring' if self.reads == 'direct' else 'through the mmap'}: "
                f"measured beside {self.beside_writes}: ring {self.direct_bytes_per_s / 2**30:.2f} GiB/s, "
                f"mmap {self.buffered_bytes_per_s / 2**30:.2f} GiB/s on {self.probed} ({self.reason}; "
                f"a {self.probe_seconds:.2f} s probe, once per source and destination file system and process)"
            )
        return (
            f"reads {self.reads}: measured cold direct {self.direct_bytes_per_s / 2**30:.2f} GiB/s, "
            f"buffered {self.buffered_bytes_per_s / 2**30:.2f} GiB/s on {self.probed} "
            f"(a {self.probe_seconds:.2f} s probe of {self.probe_blocks} block(s), once per file system and process)"
        )


_read_choices: dict[int, ReadChoice] = {}
# The most files a measurement spreads its slices over (the largest the job reads).
_PROBE_FILES = 16
_read_lock = threading.Lock()
_probes = 0


def read_probe_count() -> int:
    """How many read measurements this process has run (one per file system at most)."""
    return _probes


def forget_read_choices() -> None:
    """Forget every measured choice: the next ``io="auto"`` read measures again."""
    with _read_lock:
        _read_choices.clear()


def known_read_choice(where: str | os.PathLike[str]) -> ReadChoice | None:
    """The choice ``io="auto"`` made for the local file system holding ``where``, as measured
    earlier in this process; None when it has not been measured yet (nothing is measured here)."""
    try:
        device = os.stat(where).st_dev
    except OSError:
        return None
    with _read_lock:
        return _read_choices.get(device)


def read_choice(
    io: str,
    where: str | os.PathLike[str] | Remote,
    files: Iterable[str | os.PathLike[str]] = (),
    *,
    streams: int = 1,
) -> ReadChoice:
    """How a job reads ``files`` (the local files it is about to read, under ``where``) for ``io``.

    - ``"buffered"``: buffered, nothing measured;
    - object storage, and the file systems of ``io_mode._BUFFERED_TYPES`` (tmpfs, ...):
      buffered, nothing measured (``io="direct"`` there is an InvalidDestinationError before any read);
    - ``"direct"``: direct;
    - ``"auto"``: when one of ``files`` has at least ``io_mode.DIRECT_MIN_BYTES`` (the only
      files auto would read with O_DIRECT), the largest are measured with ``streams`` reading threads
      (storage.read_probe: cold direct against cold buffered slices of them) unless a file on the
      same file system (``st_dev``) was measured earlier in this process, and the faster is
      chosen (buffered only when faster by more than :data:`BUFFERED_MARGIN`). A file system
      that refuses O_DIRECT on it is remembered as buffered. Files too
      small to measure keep the rule: direct for large files.

    The measurement reads as a job with ``streams`` reading threads does and holds at most
    :data:`~parallel_dcp.storage.read_probe.PROBE_SLICE` (one run's buffer) while it runs.

    Raises:
        InvalidDestinationError: ``io="direct"`` where O_DIRECT is not used.
        ValueError: ``io`` is not one of :data:`IO_MODES`.
    """
    io = io_mode.check_io(io)
    if io == "buffered":
        return ReadChoice("buffered", "buffered", 'io="buffered"')
    refusal = io_mode.direct_refusal(where, probe=False)
    if refusal is not None:
        if io == "direct":
            raise InvalidDestinationError(f"io='direct': cannot read {where} with O_DIRECT: {refusal}")
        return ReadChoice("buffered", "buffered", refusal)
    if io == "direct":
        return ReadChoice("direct", "direct", 'io="direct"')
    found = _largest(files)
    if not found or found[0][1] < io_mode.DIRECT_MIN_BYTES:
        return ReadChoice(
            "auto", "buffered", f"no file of at least {io_mode.DIRECT_MIN_BYTES >> 20} MiB to read directly"
        )
    device = found[0][2]
    with _read_lock:
        known = _read_choices.get(device)
        if known is None:
            known = _measure([name for name, _, dev in found if dev == device][:_PROBE_FILES], streams)
            if known.probed is not None:  # measured, or refused: not a file too small or unreadable
                _read_choices[device] = known
    return known


def _largest(files: Iterable[str | os.PathLike[str]]) -> list[tuple[str, int, int]]:
    """(name, size, st_dev) of the regular files of ``files``, the largest first (each looked at
    by the one open rule; a file that is not there or not regular is skipped: the job's own read
    of it says why)."""
    found = []
    for name in dict.fromkeys(os.fspath(f) for f in files):
        try:
            fd = open_source(name)
        except (OSError, UnsafeCheckpointError):
            continue
        try:
            status = os.fstat(fd)
        finally:
            os.close(fd)
        found.append((name, status.st_size, status.st_dev))
    return sorted(found, key=lambda f: -f[1])


def _measure(candidates: list[str], streams: int) -> ReadChoice:
    global _probes
    _probes += 1
    sample = candidates[0]
    start = time.perf_counter()
    try:
        rates = read_probe.measure_reads(candidates, streams)
    except (OSError, UnsafeCheckpointError, CorruptCheckpointError) as exc:
        # The job's own read of the file reports the problem; the rule stands meanwhile.
        return ReadChoice("auto", "direct", f"could not measure {sample}: {exc}")
    if rates is None:
        return ReadChoice("auto", "direct", "too small to measure")
    if rates.direct is None or rates.buffered is None:
        return ReadChoice("buffered", "buffered", f"the file system of {sample} refuses O_DIRECT", probed=sample)
    direct = rates.direct * BUFFERED_MARGIN >= rates.buffered
    tie = direct and rates.direct < rates.buffered
    return ReadChoice(
        "auto" if direct else "buffered",
        "direct" if direct else "buffered",
        f"measured (buffered ahead by less than {BUFFERED_MARGIN - 1:.0%}: direct)" if tie else "measured",
        direct_bytes_per_s=rates.direct,
        buffered_bytes_per_s=rates.buffered,
        probed=sample,
        probe_seconds=time.perf_counter() - start,
        probe_blocks=rates.blocks,
    )
