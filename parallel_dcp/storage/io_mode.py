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
- a read measures instead (storage.read_choice, storage.read_probe): once per file system
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
from pathlib import Path
from typing import TYPE_CHECKING

from parallel_dcp.errors import InvalidDestinationError
from parallel_dcp.storage.safe_files import create_new, open_directory

if TYPE_CHECKING:  # location imports torch; the CLI checks --io before torch is loaded
    from parallel_dcp.storage.location import Remote

__all__ = [
    "ALIGN",
    "DIRECT_MIN_BYTES",
    "IO_MODES",
    "check_io",
    "direct_refusal",
    "file_system_type",
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
