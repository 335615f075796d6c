"""Cold shard reads started before the ``.metadata`` parse, so the disk works while Python does.

A load of many small records spends most of its time in Python before its first shard read
(unpickling ``.metadata``, checking it, flattening ``into``, planning: ~7 us a record), and only
then reads the shards, through the page cache, at the device's rate. Here the shards are read
into the page cache as soon as the load starts:

    load starts (.metadata not parsed yet)
      │ plan_prefetch: the rule below, from what is known without the parse: the directory's
      │   ``*.distcp`` files (each opened by the one rule, safe_files.open_regular: a symlink or
      │   a FIFO in a shard's place is skipped, never opened through), their sizes, .metadata's size
      │ Prefetch: .metadata, its side index and the plan's shards opened on the caller's thread
      ▼
    STREAMS threads, each taking the next file in that order (.metadata and the index, then the
      │   shards in name order): sendfile to /dev/null, CHUNK_BYTES a call (the GIL released
      │   for the whole call; the kernel's read-ahead keeps the device busy; nothing is copied)
      │   ── while the main thread parses, checks and plans
      │ keep(files): the plan's files, once known: the rest are not read any more
      │ order(files): the load's read stage takes the shards in this same order
      ▼
    the read stage finds the bytes (mostly) in the page cache, or reads right behind the
    prefetch; close(): the threads are stopped (within a chunk) and joined, the descriptors closed

Measured (50,000 small records, 490 MB in 8 shards, cold, this VM's disk): ``posix_fadvise``
(WILLNEED) reads at most one read-ahead window a call, so a thread asking for them returned to
Python ~60 times, each time waiting up to the GIL's switch interval (5 ms) behind the busy main
thread: the first shard was asked for 0.1 s in, and the disk, reading in name order, read last
the shard the read stage wanted third (0.24 s in one preadv). sendfile reads a whole chunk a call
(1.2-1.4 GiB/s, the device's buffered rate, against 0.9-1.1 for WILLNEED windows); two streams
keep the disk busy while the other waits for the GIL; and the read stage follows the prefetch's
order (jobs/load.py). WILLNEED windows remain where sendfile is refused (not Linux...).

Prefetched only when it helps and cannot hurt (:func:`plan_prefetch`, each refusal says why):

- a local checkpoint on a file system that is not memory already (tmpfs...), never object storage;
- the whole checkpoint is loaded (no ``keys=``: which files a subset needs is known only after the
  parse), in this process (``retries``/``task_timeout`` fork workers: no thread beside a fork).
  An ``into`` is flattened right after the prefetch starts (its tensors' bytes are not known
  before): one holding under :data:`INTO_SHARE` of the shards' bytes is a subset, and the
  shards are no longer read (:meth:`Prefetch.wanted`); what was read meanwhile is what the disk
  reads during that flattening (~0.7 us a key: 35 ms for 50,000 keys, none for a few) and the
  chunk each stream is in;
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

Longer than 300 lines because the rule (plan_prefetch) and the reading it decides (Prefetch) are
read together: each refusal above answers a way the reading could hurt.
"""

from __future__ import annotations

import collections
import contextlib
import errno
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

__all__ = [
    "CHUNK_BYTES",
    "INTO_SHARE",
    "METADATA_RATIO",
    "STREAMS",
    "Prefetch",
    "PrefetchPlan",
    "plan_prefetch",
    "read_ahead_window",
]

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
# Files read at once: while one stream's thread waits to take the GIL back between two calls (up
# to the switch interval, 5 ms, behind a busy main thread) the other's read goes on.
STREAMS = 2
# The most one call reads: the prefetch stops (close, keep) within one of these.
CHUNK_BYTES = 16 << 20
# Files opened before the threads start (the rest by the threads, each open a wait for the GIL).
OPEN_AHEAD = 64
# sendfile cannot send this file to /dev/null here (not Linux, an old kernel, an odd file system).
_NO_SENDFILE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSOCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF}


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
    """Reads a plan's files into the page cache in :data:`STREAMS` threads (see the module doc); a
    context manager that stops and joins them on exit. Does nothing for an empty plan (or where
    neither ``sendfile`` nor ``posix_fadvise`` exists)."""

    where: Location
    plan: PrefetchPlan
    advised: int = 0  # bytes read ahead (or, by the fallback, asked for) so far
    _keep: frozenset[str] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    # (name, descriptor or None: opened by the thread, size or None: looked up), in the order read
    _files: collections.deque[tuple[str, int | None, int | None]] = field(default_factory=collections.deque)
    _fds: list[int] = field(default_factory=list)  # every descriptor opened, closed by close()
    _directory: int | None = None
    _sink: int | None = None  # /dev/null: where sendfile sends what it read
    _sendfile: bool = hasattr(os, "sendfile")
    _count: threading.Lock = field(default_factory=threading.Lock)  # ``advised`` has two writers

    def __enter__(self) -> Prefetch:
        if not self.plan.files or isinstance(self.where, Remote):
            return self
        if not (self._sendfile or hasattr(os, "posix_fadvise")):
            return self
        try:
            self._open_files()
        except OSError:
            self.close()
            return self
        for number in range(min(STREAMS, len(self._files))):
            thread = threading.Thread(target=self._run, name=f"pdcp-prefetch-{number}", daemon=True)
            self._threads.append(thread)
            thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def keep(self, names: Iterable[str]) -> None:
        """Only the files ``names`` are still wanted (the plan's, once known): the others are not
        read any more."""
        self._keep = frozenset(names)

    def wanted(self, nbytes: int) -> None:
        """The load fills ``nbytes`` of tensors (its ``into``): under :data:`INTO_SHARE` of the
        shards' bytes it is a subset, and no shard is read any more."""
        if nbytes < INTO_SHARE * self.plan.nbytes:
            self.keep(())

    def order(self, names: Iterable[str]) -> list[str]:
        """``names`` in the order this prefetch reads them (its plan's), any other after them in
        its own order: a reader that takes them so finds each file resident, or on its way, when
        it comes to it, never one the disk will read last while it waits."""
        rank = {name: number for number, (name, _) in enumerate(self.plan.files)}
        return sorted(names, key=lambda name: rank.get(name, len(rank)))

    def join(self) -> None:
        """Wait until every file still wanted is read (or asked for), without stopping the threads."""
        for thread in self._threads:
            thread.join()

    def close(self) -> None:
        self._stop.set()
        self.join()
        self._threads.clear()
        fds, self._fds = self._fds, []
        for fd in [*fds, self._sink, self._directory]:
            if fd is not None:
                os.close(fd)
        self._sink = self._directory = None

    def _open_files(self) -> None:
        """The directory, the sink and the first files, opened on the caller's thread: every
        system call a prefetch thread makes gives up the GIL and waits to take it back, up to the
        switch interval behind a busy main thread (measured: 35 ms before the first read-ahead of
        .metadata when the thread opened it). The threads then make only the reading calls."""
        directory = self._directory = open_directory(self.where)  # type: ignore[arg-type]
        if self._sendfile:
            try:
                self._sink = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            except OSError:  # (a sandbox without /dev/null) the windows, then
                self._sendfile = False
        names = [*FIRST, *(name for name, _ in self.plan.files)]
        for number, name in enumerate(names):
            fd: int | None = None
            size: int | None = None
            if number < OPEN_AHEAD:
                try:
                    # the one rule, again: the name may have changed since the plan
                    fd = open_regular(directory, name)
                except (OSError, UnsafeCheckpointError):
                    continue
                self._fds.append(fd)
                size = os.fstat(fd).st_size
            self._files.append((name, fd, size))

    def _wanted(self, name: str) -> bool:
        keep = self._keep
        return not self._stop.is_set() and (keep is None or name in keep or name in FIRST)

    def _run(self) -> None:
        """Take the next file and read it, until none is left or the prefetch stops."""
        while not self._stop.is_set():
            try:
                name, fd, size = self._files.popleft()  # (atomic: the streams share the deque)
            except IndexError:
                return
            if not self._wanted(name):
                continue
            with contextlib.suppress(OSError, UnsafeCheckpointError):  # the load's own read reports it
                if fd is None:
                    fd = open_regular(self._directory, name)
                    self._fds.append(fd)
                    size = os.fstat(fd).st_size
                assert size is not None
                self._read(name, fd, size)

    def _read(self, name: str, fd: int, size: int) -> None:
        """Read ``fd`` into the page cache: ``sendfile`` to /dev/null, CHUNK_BYTES a call (the
        kernel's read-ahead keeps the device's queue full meanwhile, and nothing is copied); where
        sendfile refuses, ``POSIX_FADV_WILLNEED`` per read-ahead window (the kernel reads at most one
        a call)."""
        offset = 0
        window = 0
        while offset < size and self._wanted(name):
            if self._sendfile:
                try:  # the GIL is released in the call, which returns once the chunk is cached
                    got = os.sendfile(self._sink, fd, offset, min(CHUNK_BYTES, size - offset))  # type: ignore[arg-type]
                except OSError as exc:
                    if exc.errno not in _NO_SENDFILE:
                        raise
                    self._sendfile = False  # (this process's other streams find out on their own)
                    continue
                if not got:  # the file shrank since its size was read
                    return
            elif not hasattr(os, "posix_fadvise"):  # (macOS: sendfile sends to sockets alone)
                return
            else:
                window = window or read_ahead_window(os.fstat(fd).st_dev)
                got = min(window, size - offset)
                os.posix_fadvise(fd, offset, window, os.POSIX_FADV_WILLNEED)
            offset += got
            with self._count:
                self.advised += got
