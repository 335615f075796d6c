"""How shard bytes reach the device: ``io="auto" | "direct" | "buffered"``.

``buffered`` goes through the page cache (plain ``write``/``preadv``). ``direct`` opens shards with
``O_DIRECT`` and moves them through page-aligned buffers (:mod:`parallel_dcp.storage.direct_write`,
:mod:`parallel_dcp.storage.direct_read`): no copy into the page cache, no dirty pages left behind
for the kernel to flush, several large writes in flight per worker.

The ``auto`` rule, decided once per destination (or source) directory:

- object storage, and file systems that live in memory or in user space (tmpfs, ramfs, FUSE,
  network and overlay file systems: see ``_BUFFERED_TYPES``): buffered. On tmpfs the page cache
  *is* the storage, so O_DIRECT only adds a copy; recent kernels accept it there anyway, which is
  why the type is checked and not only the flag;
- anywhere else, a write probes: a file is created with ``O_DIRECT`` and one aligned block
  written; a file system that refuses (EINVAL) gets buffered I/O;
- a read measures instead (:func:`read_choice`, storage.read_probe): once per file system
  (``st_dev``) and process, a few cold direct reads against cold buffered ones of slices of a file
  the job is about to read (never another, nothing written), and the faster is remembered;
- then per file: direct only for files of at least :data:`DIRECT_MIN_BYTES` (a small file is
  written or read faster through the cache than through a queue of aligned requests).

``io="direct"`` where the rule's first two steps say buffered is an
:class:`~parallel_dcp.errors.InvalidDestinationError` raised before anything is written.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from parallel_dcp.errors import CorruptCheckpointError, InvalidDestinationError, UnsafeCheckpointError
from parallel_dcp.storage.safe_files import create_new, open_directory, open_regular

if TYPE_CHECKING:  # location imports torch; the CLI checks --io before torch is loaded
    from parallel_dcp.storage.location import Remote

__all__ = [
    "ALIGN",
    "DIRECT_MIN_BYTES",
    "IO_MODES",
    "ReadChoice",
    "check_io",
    "direct_refusal",
    "file_system_type",
    "forget_read_choices",
    "read_choice",
    "read_probe_count",
    "resolve_io",
    "uses_direct",
]

IO_MODES = ("auto", "direct", "buffered")
# O_DIRECT needs buffers, offsets and lengths aligned to the logical block size: 4096 covers
# every common device (512-byte and 4K-native).
ALIGN = 4096
# auto: files smaller than this are written and read through the page cache.
DIRECT_MIN_BYTES = 16 << 20
# File systems where auto (and direct) never use O_DIRECT.
_BUFFERED_TYPES = ("tmpfs", "ramfs", "devtmpfs", "hugetlbfs", "overlay", "nfs", "nfs4", "cifs", "smb3", "9p")

_refusals: dict[tuple[int, str], str | None] = {}


def check_io(io: object) -> str:
    """``io`` if it is one of :data:`IO_MODES`; else ValueError."""
    if io not in IO_MODES:
        raise ValueError(f"io must be 'auto', 'direct' or 'buffered', got {io!r}")
    return str(io)


def file_system_type(path: str | os.PathLike[str]) -> str:
    """The type of the file system holding ``path`` (its nearest existing ancestor), from
    /proc/self/mountinfo; "" when it cannot be told."""
    where = Path(os.path.abspath(path))
    while not where.exists() and where != where.parent:
        where = where.parent
    with contextlib.suppress(OSError):  # no stat or no /proc: the type cannot be told
        dev = os.stat(where).st_dev
        wanted = f"{os.major(dev)}:{os.minor(dev)}"
        with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) > 2 and fields[2] == wanted and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    return ""


def direct_refusal(path: str | os.PathLike[str] | Remote, *, probe: bool = True) -> str | None:
    """None when files under ``path`` (a directory, or its nearest existing ancestor) can be
    written and read with O_DIRECT; else why not. Probed once per file system and type (without
    ``probe``, as a dry run asks: from the file system's type alone)."""
    from parallel_dcp.storage.location import Remote

    if isinstance(path, Remote):
        return "object storage has no O_DIRECT"
    where = Path(os.path.abspath(path))
    while not where.is_dir() and where != where.parent:
        where = where.parent
    kind = file_system_type(where)
    if kind in _BUFFERED_TYPES or kind.startswith("fuse"):
        return f"{where} is on {kind}, where O_DIRECT gains nothing (buffered I/O is used there)"
    try:
        key = (os.stat(where).st_dev, kind)
    except OSError as exc:
        return f"cannot stat {where}: {exc.strerror}"
    if key not in _refusals:
        if not probe:
            return None
        _refusals[key] = _probe(where, kind)
    return _refusals[key]


def _probe(directory: Path, kind: str) -> str | None:
    """Create a hidden file with O_DIRECT in ``directory`` and write one aligned block to it."""
    name = f".parallel_dcp.direct-probe.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        dirfd = open_directory(directory)
    except OSError as exc:
        return f"cannot open {directory}: {exc.strerror}"
    try:
        fd = create_new(dirfd, name, flags=os.O_WRONLY | os.O_DIRECT, mode=0o600)
    except OSError as exc:
        os.close(dirfd)
        if exc.errno == errno.EINVAL:
            return f"the {kind or 'file system'} of {directory} refuses O_DIRECT"
        return None if exc.errno in (errno.EACCES, errno.EROFS) else f"cannot probe {directory}: {exc.strerror}"
    try:
        block = mmap.mmap(-1, ALIGN)
        try:
            os.pwrite(fd, block, 0)
        finally:
            block.close()
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return f"the {kind or 'file system'} of {directory} refuses O_DIRECT writes"
        if exc.errno != errno.ENOSPC:
            return f"cannot probe {directory}: {exc.strerror}"
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dirfd)
        os.close(dirfd)
    return None


def resolve_io(io: str, path: str | os.PathLike[str] | Remote, *, writing: bool, probe: bool = True) -> str:
    """What ``io`` becomes for ``path``: ``"buffered"`` where O_DIRECT is not used there,
    else ``io`` itself (``"auto"`` then still decides per file, see :func:`uses_direct`).

    Raises:
        InvalidDestinationError: ``io="direct"`` where O_DIRECT cannot be used (for a write,
            before anything is written).
    """
    io = check_io(io)
    if io == "buffered":
        return io
    # A reader never writes a probe into the checkpoint: a file that refuses O_DIRECT after all is
    # read buffered (storage.direct_read).
    refusal = direct_refusal(path, probe=probe and writing)
    if refusal is None:
        return io
    if io == "direct":
        what = "write" if writing else "read"
        raise InvalidDestinationError(f'io="direct" (--io direct): cannot {what} {path} with O_DIRECT: {refusal}')
    return "buffered"


def uses_direct(io: str, nbytes: int) -> bool:
    """Whether a file of ``nbytes`` goes through O_DIRECT under a resolved ``io``."""
    return io == "direct" or (io == "auto" and nbytes >= DIRECT_MIN_BYTES)


@dataclass(frozen=True, slots=True)
class ReadChoice:
    """How a job reads its local files, and why (:func:`read_choice`).

    Attributes:
        io: what to hand the readers (``ShardFile(io=...)``, ``fast_read.read_requests(io=...)``):
            ``"auto"`` (direct for files of at least :data:`DIRECT_MIN_BYTES`, which the
            measurement chose), ``"direct"`` or ``"buffered"``.
        reads: how the large files are read: ``"direct"`` or ``"buffered"``.
        reason: why, in words (``"measured"``, the ``io`` asked for, the file system's type, ...).
        direct_bytes_per_s, buffered_bytes_per_s: the measured cold rates (None when not measured).
        probed: the file the measurement read (None when not measured).
        probe_seconds: what the measurement took (once per file system and process: a later
            choice on the same file system reports the first one's figures).
    """

    io: str
    reads: str
    reason: str
    direct_bytes_per_s: float | None = None
    buffered_bytes_per_s: float | None = None
    probed: str | None = None
    probe_seconds: float = 0.0

    @property
    def measured(self) -> bool:
        return self.direct_bytes_per_s is not None and self.buffered_bytes_per_s is not None

    def summary(self) -> str:
        """One line for logs and benchmark output."""
        if not self.measured:
            return f"reads {self.reads} ({self.reason})"
        assert self.direct_bytes_per_s is not None and self.buffered_bytes_per_s is not None
        return (
            f"reads {self.reads}: measured cold direct {self.direct_bytes_per_s / 2**30:.2f} GiB/s, "
            f"buffered {self.buffered_bytes_per_s / 2**30:.2f} GiB/s on {self.probed} "
            f"(a {self.probe_seconds:.2f} s probe, once per file system and process)"
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


def read_choice(
    io: str,
    where: str | os.PathLike[str] | Remote,
    files: Iterable[str | os.PathLike[str]] = (),
    *,
    streams: int = 1,
) -> ReadChoice:
    """How a job reads ``files`` (the local files it is about to read, under ``where``) for ``io``.

    - ``"buffered"``: buffered, nothing measured;
    - object storage, and the file systems of :data:`_BUFFERED_TYPES` (tmpfs, ...): buffered,
      nothing measured (``io="direct"`` there is an InvalidDestinationError before any read);
    - ``"direct"``: direct;
    - ``"auto"``: when one of ``files`` has at least :data:`DIRECT_MIN_BYTES` (the only files
      auto would read with O_DIRECT), the largest are measured with ``streams`` reading threads
      (storage.read_probe: cold direct against cold buffered slices of them) unless a file on the
      same file system (``st_dev``) was measured earlier in this process, and the faster is
      chosen. A file system that refuses O_DIRECT on it is remembered as buffered. Files too
      small to measure keep the rule: direct for large files.

    The measurement holds at most ``streams`` times :data:`~parallel_dcp.storage.read_probe.PROBE_SLICE`
    plus the direct reader's buffers (``direct_read_memory()``) per stream, while it runs.

    Raises:
        InvalidDestinationError: ``io="direct"`` where O_DIRECT is not used.
        ValueError: ``io`` is not one of :data:`IO_MODES`.
    """
    io = check_io(io)
    if io == "buffered":
        return ReadChoice("buffered", "buffered", 'io="buffered"')
    refusal = direct_refusal(where, probe=False)
    if refusal is not None:
        if io == "direct":
            raise InvalidDestinationError(f"io='direct': cannot read {where} with O_DIRECT: {refusal}")
        return ReadChoice("buffered", "buffered", refusal)
    if io == "direct":
        return ReadChoice("direct", "direct", 'io="direct"')
    found = _largest(files)
    if not found or found[0][1] < DIRECT_MIN_BYTES:
        return ReadChoice("auto", "buffered", f"no file of at least {DIRECT_MIN_BYTES >> 20} MiB to read directly")
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
            fd = open_regular(None, name)
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
    from parallel_dcp.storage import read_probe  # it reads through direct_read, which imports this module

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
    direct = rates.direct >= rates.buffered
    return ReadChoice(
        "auto" if direct else "buffered",
        "direct" if direct else "buffered",
        "measured",
        direct_bytes_per_s=rates.direct,
        buffered_bytes_per_s=rates.buffered,
        probed=sample,
        probe_seconds=time.perf_counter() - start,
    )
