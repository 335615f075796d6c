"""Side files chosen now and read later (at the commit): pinned to a path with no link on its way.

    chosen      pinned_path(file, tree)      its folder's realpath (inside the source's tree) + its own name
       │
       ▼ at the commit
    read        open_without_links(pinned)   walked from / one component at a time, O_NOFOLLOW each

A folder of the source (``1_Pooling/``) swapped for a link out between the choice and the read is
refused at the read, never followed: the pinned path had no link in it, so any link there now is
a change (someone who can write the source folder on a shared file system).

A shard listed when the job opened its source and read later by a library that opens files by
name (safetensors' mmap, ``torch.load``) is opened here by the one rule and handed over as
``/proc/self/fd/N`` (:func:`opened_for_library`): a shard swapped for a symlink out of the folder
after the listing is refused, never followed.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from parallel_dcp.errors import UnsafeCheckpointError
from parallel_dcp.storage.safe_files import open_regular

__all__ = ["open_without_links", "opened_for_library", "pinned_path"]

# O_PATH: a folder on the way needs only search permission (x), as for any path, not read (r):
# a home directory of mode 0711 is walked as the kernel would walk it.
_WALK = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC


def pinned_path(path: str | os.PathLike[str], tree: str | os.PathLike[str]) -> Path:
    """The path with no link on its way to the file ``path`` of ``tree`` (its folder's realpath and
    its own name, never resolved: it was checked not to be a link), to be read later by
    :func:`open_without_links`.

    Raises:
        UnsafeCheckpointError: its folder now leads out of ``tree`` (swapped for a link).
    """
    path = Path(path)
    folder = os.path.realpath(path.parent)
    root = os.path.realpath(tree)
    if os.path.commonpath([root, folder]) != root:
        raise UnsafeCheckpointError(f"{os.fspath(path)} now lies out of {root} (in {folder}); refusing to read it")
    return Path(folder) / path.name


def open_without_links(path: str | os.PathLike[str]) -> int:
    """Open the regular file at the absolute ``path`` (a ``realpath``, taken when the file was
    chosen) walking it one component at a time from ``/`` without following any symlink: a folder
    on the way swapped for a link since (``1_Pooling -> /elsewhere``) is refused, never followed.

    Raises:
        UnsafeCheckpointError: a component became a symlink, or the file is not a regular file.
        FileNotFoundError: something on the way is gone.
    """
    path = os.fspath(path)
    if not os.path.isabs(path):
        raise ValueError(f"{path!r} is not an absolute path")
    *folders, leaf = [part for part in path.split("/") if part]
    fd = os.open("/", _WALK)
    try:
        for at, folder in enumerate(folders):
            try:
                below = os.open(folder, _WALK | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    shown = "/" + "/".join(folders[: at + 1])
                    raise UnsafeCheckpointError(
                        f"{shown} (on the way to {path}) is now a symlink or not a folder; refusing to follow it"
                    ) from None
                raise
            os.close(fd)
            fd = below
        return open_regular(fd, leaf)
    finally:
        os.close(fd)


_FDS = "/proc/self/fd"


@contextlib.contextmanager
def opened_for_library(path: str | os.PathLike[str]) -> Iterator[str]:
    """A name for the regular file at ``path``, opened now by the one rule (no symlink in its last
    component, never blocking on a FIFO): ``/proc/self/fd/N`` while the block runs, which the
    library opens as the very file opened here, whatever ``path`` leads to by then. Where there is
    no ``/proc``, ``path`` itself (checked just before).

    Raises:
        UnsafeCheckpointError: ``path`` is a symlink, or not a regular file.
    """
    fd = open_regular(None, path)
    try:
        yield f"{_FDS}/{fd}" if os.path.isdir(_FDS) else os.fspath(path)
    finally:
        os.close(fd)
