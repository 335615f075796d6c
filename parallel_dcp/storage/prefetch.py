"""Cold shard reads started before the ``.metadata`` parse, so the disk works while Python does.

A load of many small records spends most of its time in Python before its first shard read
(unpickling ``.metadata``, checking it, flattening ``into``, planning: ~7 us a record), and only
then reads the shards, through the page cache, at the device's rate. Here the kernel is asked to
read the shards into the page cache as soon as the load starts:

    load starts (.metadata not parsed yet)
      │ plan_prefetch: the rule below, from what is known without the parse: the directory's
      │   ``*.distcp`` files (each opened by the one rule, safe_files.open_regular: a symlink or
      │   a FIFO in a shard's place is skipped, never opened through), their sizes, .metadata's size
      ▼
    a thread: posix_fadvise(WILLNEED) per read-ahead window of .metadata, then of each shard in
      │   name order
      │   (the kernel reads at most one window a call and returns; the call waits only when the
      │   device's queue is full) ── while the main thread parses, checks and plans
      │ keep(files): the plan's files, once known: the rest are not asked for any more
      ▼
    the read stage finds the bytes (mostly) in the page cache; close(): the thread is stopped
    and joined, its descriptors closed

Prefetched only when it helps and cannot hurt (:func:`plan_prefetch`, each refusal says why):

- a local checkpoint on a file system that is not memory already (tmpfs...), never object storage;
- the whole checkpoint is loaded (no ``keys=``: which files a subset needs is known only after the
  parse), in this process (``retries``/``task_timeout`` fork workers: no thread beside a fork).
  An ``into`` is flattened right after the prefetch starts (its tensors' bytes are not known
  before): one holding under :data:`INTO_SHARE` of the shards' bytes is a subset, and the
  shards are no longer asked for (:meth:`Prefetch.wanted`); what was asked meanwhile is what the
  disk reads during that flattening (~0.7 us a key: 35 ms for 50,000 keys, none for a few);
- many small records: ``.metadata`` at least 1/:data:`METADATA_RATIO` of the shards' bytes.
  Parsing costs ~20 ns a byte of ``.metadata`` here (4.4 us for a ~240-byte entry), the disk ~1 ns
  a byte of shard (1 GB/s): at that ratio the parse lasts at least ~8% of the read, and at the
  50,000 small records' 1/35 about as long as it. A big-tensor checkpoint has a few KiB of
  ``.metadata`` for GiBs of shards (1e-6): nothing to overlap, never prefetched;
- only files that will be read through the page cache: with ``io="direct"`` none (a prefetched
  byte would be read twice); with ``"auto"`` only those the remembered measurement
  (storage.read_choice) reads buffered (all of them where the small records are read buffered
  anyway: ``small_buffered``, measured or not: the load stops the prefetch before a probe of the
  files its tensor requests read, which must find them cold), and without ``small_buffered``
  nothing while that measurement is still to run on a file large enough to read directly;
- the shards fit: their bytes (twice that when the load allocates its output) at most half of the
  memory available now (psutil), so the prefetch evicts nothing the load or the node needs.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import psutil

from parallel_dcp.errors import UnsafeCheckpointError
from parallel_dcp.storage import io_mode
from parallel_dcp.storage.location import Location, Remote
from parallel_dcp.storage.read_choice import known_read_choice
from parallel_dcp.storage.safe_files import open_directory, open_regular
from parallel_dcp.storage.side_index import INDEX_FILE

__all__ = ["INTO_SHARE", "METADATA_RATIO", "Prefetch", "PrefetchPlan", "plan_prefetch", "read_ahead_window"]

# .metadata at least this fraction of the shards' bytes: many small records (see the module doc).
METADATA_RATIO = 256
# An ``into`` holding at least this share of the shards' bytes loads (most of) the checkpoint.
INTO_SHARE = 0.5
# Asked for before any shard, whatever the plan keeps: what the load reads first (the side index
# of our own checkpoints, storage/side_index.py, is read in place of unpickling .metadata).
FIRST = (".metadata", INDEX_FILE)
# What the shards may take of the memory available (the rest for the load and the node).
MEMORY_SHARE = 0.5
_IN_MEMORY = ("tmpfs", "ramfs", "devtmpfs", "hugetlbfs")
# The kernel's default read-ahead window, where the device's own cannot be read.
_DEFAULT_WINDOW = 128 << 10


@dataclass(frozen=True, slots=True)
class PrefetchPlan:
    """What :func:`plan_prefetch` decided: ``files`` (name, size) to prefetch, or none and why."""

    files: tuple[tuple[str, int], ...] = ()
    reason: str = ""

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.files)


def _shards(directory: int) -> list[tuple[str, int]]:
    """(name, size) of the directory's regular ``*.distcp`` files, by the one open rule (a symlink
    or anything not a regular file in a shard's place is skipped: the load's own open refuses it
    if ``.metadata`` names it)."""
    found = []
    with os.scandir(directory) as entries:
        names = sorted(entry.name for entry in entries if entry.name.endswith(".distcp"))
    for name in names:
        size = _size(directory, name)
        if size:
            found.append((name, size))
    return found


def _size(directory: int, name: str) -> int | None:
    try:
        fd = open_regular(directory, name)
    except (OSError, UnsafeCheckpointError):
        return None
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def plan_prefetch(
    where: Location,
    io: str,
    *,
    whole: bool,
    allocates: bool,
    small_buffered: bool = False,
) -> PrefetchPlan:
    """Which shard files of the checkpoint at ``where`` to prefetch before its ``.metadata`` is
    parsed (the rule of the module doc). ``io``: how the load reads its shards (as asked:
    ``"auto"``, ``"direct"``, ``"buffered"``); ``whole``: the load takes every key (no ``keys=``)
    in this process; ``allocates``: it allocates its output (no ``into``);
    ``small_buffered``: the load reads small records through the page cache whatever ``io="auto"``
    measured (formats/scatter_read.py), so once the measurement is made every shard qualifies.

    Never raises for a checkpoint it cannot look at: it plans nothing, and the load's own reads
    report what is wrong."""
    if isinstance(where, Remote):
        return PrefetchPlan(reason="object storage")
    if not whole:
        return PrefetchPlan(reason="a subset of the keys: its files are known only after the parse")
    if io == "direct":
        return PrefetchPlan(reason='io="direct": a prefetched byte would be read twice')
    kind = io_mode.file_system_type(where)
    if kind in _IN_MEMORY:
        return PrefetchPlan(reason=f"{kind}: the files are in memory already")
    try:
        directory = open_directory(where)
    except OSError:
        return PrefetchPlan(reason="cannot open the directory")
    try:
        metadata = _size(directory, ".metadata")
        shards = _shards(directory)
    finally:
        os.close(directory)
    total = sum(size for _, size in shards)
    if not metadata or not total:
        return PrefetchPlan(reason="no .metadata or no shard file")
    if metadata * METADATA_RATIO < total:
        return PrefetchPlan(reason=f".metadata is under 1/{METADATA_RATIO} of the shards: few large records")
    if io == "auto" and io_mode.direct_refusal(where, probe=False) is None:
        choice = known_read_choice(where)
        if choice is None:
            # (where small records read buffered anyway, the load stops this prefetch before the
            # probe measures the files its requests read: load._load)
            if not small_buffered and any(io_mode.uses_direct("auto", size) for _, size in shards):
                return PrefetchPlan(reason='io="auto" not measured on this file system yet: the probe needs cold files')
        elif choice.io != "buffered" and not small_buffered:
            shards = [(name, size) for name, size in shards if not io_mode.uses_direct(choice.io, size)]
            if not shards:
                return PrefetchPlan(reason="every shard is read with O_DIRECT here (measured)")
    total = sum(size for _, size in shards)
    if total * (2 if allocates else 1) > MEMORY_SHARE * psutil.virtual_memory().available:
        return PrefetchPlan(reason="the shards do not fit well in the memory available")
    return PrefetchPlan(tuple(shards))


@functools.cache
def read_ahead_window(device: int) -> int:
    """The most bytes one ``POSIX_FADV_WILLNEED`` call reads on the block device ``device``
    (``st_dev``): Linux caps it at the larger of the device's read-ahead window and its largest
    request; the kernel's default window where sysfs cannot tell."""
    base = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
    for queue in (base / "queue", base / ".." / "queue"):  # a partition's queue is its disk's
        sizes = []
        for name in ("read_ahead_kb", "max_sectors_kb"):
            with contextlib.suppress(OSError, ValueError):
                sizes.append(int((queue / name).read_text()) << 10)
        if sizes and max(sizes) > 0:
            return max(sizes)
    return _DEFAULT_WINDOW


@dataclass
class Prefetch:
    """Prefetches a plan's files in a thread (see the module doc); a context manager that stops
    and joins it on exit. Does nothing for an empty plan (or without ``posix_fadvise``)."""

    where: Location
    plan: PrefetchPlan
    advised: int = 0  # bytes asked for so far
    _keep: frozenset[str] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Prefetch:
        if self.plan.files and hasattr(os, "posix_fadvise") and not isinstance(self.where, Remote):
            self._thread = threading.Thread(target=self._run, name="pdcp-prefetch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def keep(self, names: Iterable[str]) -> None:
        """Only the files ``names`` are still wanted (the plan's, once known): the others are not
        asked for any more."""
        self._keep = frozenset(names)

    def wanted(self, nbytes: int) -> None:
        """The load fills ``nbytes`` of tensors (its ``into``): under :data:`INTO_SHARE` of the
        shards' bytes it is a subset, and no shard is asked for any more."""
        if nbytes < INTO_SHARE * self.plan.nbytes:
            self.keep(())

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        try:
            directory = open_directory(self.where)  # type: ignore[arg-type]
        except OSError:
            return
        try:
            window = read_ahead_window(os.fstat(directory).st_dev)
            # .metadata and its side index first: the load reads them now, and a read queued
            # behind the shards' waits for them all (measured: the .metadata stage 4.8 -> 11.7 us a
            # record without this; the index's, read after .metadata, 0.8 -> 8.2 cold)
            for name in FIRST:
                with contextlib.suppress(OSError, UnsafeCheckpointError):
                    self._file(directory, name, _size(directory, name) or 0, window)
            for name, size in self.plan.files:
                if self._stop.is_set():
                    return
                with contextlib.suppress(OSError, UnsafeCheckpointError):
                    self._file(directory, name, size, window)
        finally:
            os.close(directory)

    def _file(self, directory: int, name: str, size: int, window: int) -> None:
        fd = open_regular(directory, name)  # the one rule, again: the name may have changed since the plan
        try:
            for offset in range(0, size, window):
                keep = self._keep
                if self._stop.is_set() or (keep is not None and name not in keep and name not in FIRST):
                    return
                # the GIL is released in the call; it returns once the reads are queued
                os.posix_fadvise(fd, offset, window, os.POSIX_FADV_WILLNEED)
                self.advised += min(window, size - offset)
        finally:
            os.close(fd)
