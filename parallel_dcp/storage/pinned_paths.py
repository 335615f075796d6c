"""Side files chosen now and read later (at the commit): pinned to a path with no link on its way.

    chosen      pinned_path(file, tree)      its folder's realpath (inside the source's tree) + its own name
       │
       ▼ at the commit
    read        open_without_links(pinned)   walked from / one component at a time, O_NOFOLLOW each

A folder of the source (``1_Pooling/``) swapped for a link out between the choice and the read is
refused at the read, never followed: the pinned path had no link in it, so any link there now is
a change (someone who can write the source folder on a shared file system).

Every shard of a source a job reads (and every file a link within the tree was resolved for:
verify's and the source check's hashing, an index) is opened by one rule, :func:`open_source`: the
listing gave it as a path with no link on its way (the source folder resolved once, an in-tree
link resolved to where it leads), and the open confirms that the file opened is the one at that
path now, so a folder on the way swapped for a link out of the tree after the listing
(``store -> /elsewhere``) is refused, never followed. (A hub snapshot's own link is confirmed the
same way by ``open_regular``, for every reader: ``blobs -> /elsewhere`` is refused.)

    open_regular(path)           O_NOFOLLOW | O_NONBLOCK on its last component, fstat S_ISREG
       │
       ▼
    the kernel's name for it    readlink(/proc/self/fd/N) == path: no link was followed on the way
       │ (else, or no /proc)     (one syscall, where walking costs two per folder of the path)
       ▼
    open_without_links(path)     the walk: opens it if nothing changed, else names the link

A library that opens files by name (safetensors' mmap, ``torch.load``) gets the file opened here
as ``/proc/self/fd/N`` (:func:`opened_for_library`).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from parallel_dcp.errors import UnsafeCheckpointError
from parallel_dcp.storage.safe_files import hub_repository, open_regular

__all__ = ["open_source", "open_without_links", "opened_for_library", "pinned_path"]

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
                        f"{shown}{_leads(shown)} (on the way to {path}) is now a symlink or not a folder; "
                        "refusing to follow it"
                    ) from None
                raise
            os.close(fd)
            fd = below
        return open_regular(fd, leaf)
    finally:
        os.close(fd)


def _leads(link: str) -> str:
    """`` -> where it leads`` for a symlink, else nothing (for messages)."""
    try:
        return f" -> {os.readlink(link)}"
    except OSError:
        return ""


_FDS = "/proc/self/fd"


def open_source(path: str | os.PathLike[str]) -> int:
    """Open the regular file at ``path``, a file of a source as its listing gave it (a path with
    no link on its way: the folder resolved once, an in-tree link resolved to where it leads), by
    the one rule for reading a source: no symlink followed anywhere on the path, never blocking
    on a FIFO, a regular file. A folder on the way swapped for a link since is refused.

    The one link followed is a file of a Hugging Face cache snapshot (``models--X/snapshots/<rev>/
    .metadata -> ../../blobs/<sha>``, a DCP checkpoint on the hub; :func:`~parallel_dcp.storage.
    safe_files.open_regular`): the file opened must then lie, by the kernel's name for it, in the
    repository's cache folder the path names. A link in any other folder is refused.

    Raises:
        UnsafeCheckpointError: a planted link, a folder on the way that is now a link (naming it
            and where it leads), not a regular file.
        FileNotFoundError: nothing there (a hub snapshot's link to a missing blob names the link).
    """
    path = os.path.abspath(path)
    fd = open_regular(None, path)
    try:
        opened = os.readlink(f"{_FDS}/{fd}")
    except OSError:
        opened = None  # (no /proc: the walk below confirms it)
    if opened == path or (hub_repository(path) is not None and os.path.islink(path)):
        return fd  # (a snapshot's link: open_regular confirmed it was opened within its repository)
    os.close(fd)
    return open_without_links(path)


@contextlib.contextmanager
def opened_for_library(path: str | os.PathLike[str]) -> Iterator[str]:
    """A name for the regular file at ``path``, opened now by the one rule (:func:`open_source`):
    ``/proc/self/fd/N`` while the block runs, which the library opens as the very file opened
    here, whatever ``path`` leads to by then. Where there is no ``/proc``, ``path`` itself
    (checked just before).

    Raises:
        UnsafeCheckpointError: ``path`` is a symlink, or not a regular file.
    """
    fd = open_source(path)
    try:
        yield f"{_FDS}/{fd}" if os.path.isdir(_FDS) else os.fspath(path)
    finally:
        os.close(fd)
