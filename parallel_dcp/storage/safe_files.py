"""Opening files in a directory that someone else may also write.

A checkpoint directory can be writable by other users (a shared scratch file system), so any name in
it may be a planted symlink at any moment. Two rules make that harmless:

- a file a job writes is always created new: ``O_CREAT | O_EXCL | O_NOFOLLOW``, by name relative to
  an open descriptor of the directory. ``O_EXCL`` refuses any existing name, a symlink included, so
  no write ever lands outside the directory or in a file the job did not create;
- a file a job reads is opened with ``O_NOFOLLOW`` and checked to be a regular file, so a symlink
  or a FIFO in place of a shard is refused instead of followed (or blocked on).

Resolving names against a directory descriptor, not a path, also keeps a job in the directory it
checked even if a parent directory is renamed or replaced while it runs.

Longer than 300 lines because every way a job creates, reads, renames or removes a name in such a
directory follows the same two rules, and they are checked in one place.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import os
import pickle
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from parallel_dcp.errors import (
    CheckpointExistsError,
    CorruptCheckpointError,
    InvalidDestinationError,
    UnsafeCheckpointError,
)

__all__ = [
    "create_new",
    "hub_blob",
    "hub_cache_repo",
    "hub_repository",
    "open_directory",
    "open_in_tree",
    "open_regular",
    "plain_name",
    "read_small",
    "regular_size",
    "remove_name",
    "rename_name",
    "replace_new",
    "resolve_in_tree",
    "source_tree",
    "sync_directory",
    "vanished",
    "write_all",
    "write_new",
]

_CREATE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def plain_name(name: str) -> str:
    """``name`` if it is a plain file name (no separator, not ``.``/``..``, no NUL); else raise."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise UnsafeCheckpointError(f"{name!r} is not a plain file name")
    return name


def open_directory(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of the directory ``path`` (the caller closes it).

    The path itself may go through symlinks (the user chose it); names opened relative to the
    descriptor then cannot.
    """
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def create_new(directory: int, name: str, *, flags: int = os.O_WRONLY, mode: int = 0o644) -> int:
    """Create ``name`` in the directory open as ``directory``; return a descriptor open with ``flags``.

    Raises FileExistsError if the name exists in any form (a file, a directory, a symlink to
    anything), so a name planted before the call is never written through.
    """
    return os.open(plain_name(name), flags | _CREATE, mode, dir_fd=directory)


def open_regular(directory: int | None, name: str | os.PathLike[str], *, flags: int = os.O_RDONLY) -> int:
    """Open an existing regular file without following a symlink in its last component.

    ``directory`` is a descriptor ``name`` is relative to (``name`` must then be a plain name), or
    None for a path. Raises UnsafeCheckpointError if the name is a symlink, a directory, a FIFO or
    anything else that is not a regular file; FileNotFoundError if it does not exist.

    The one link followed: a file of a Hugging Face cache snapshot named by its path
    (``models--X/snapshots/<rev>/.metadata -> ../../blobs/<sha>``: a DCP checkpoint on the hub, a
    record), opened where it leads within the repository's cache folder (:func:`hub_blob`).
    """
    if directory is not None:
        name = plain_name(os.fspath(name))
    try:
        # O_NONBLOCK: opening a planted FIFO must not hang before fstat can refuse it.
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=directory)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a socket (or a device with no driver): open fails before fstat
            raise UnsafeCheckpointError(
                f"{_shown(directory, name)} is not a regular file (a socket or a device)"
            ) from None
        if exc.errno != errno.ELOOP:
            raise
        blob = hub_blob(name) if directory is None else None
        if blob is None:
            raise UnsafeCheckpointError(f"{_shown(directory, name)} is a symlink; refusing to follow it") from None
        fd = _open_blob(os.fspath(name), blob, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnsafeCheckpointError(f"{_shown(directory, name)} is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_blob(name: str, blob: str, flags: int) -> int:
    """The hub snapshot link ``name``'s file ``blob`` (its realpath, in its repository), opened and
    confirmed by the kernel's name for the file opened to lie in that repository: a ``blobs/``
    swapped for a link out since the link was resolved is refused, never read."""
    try:
        fd = os.open(blob, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeCheckpointError(f"{name} -> {blob}: a symlink; refusing to follow it") from None
        raise
    repository = hub_repository(blob)
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        opened = blob  # (no /proc: as resolved, the last component not followed)
    if repository is None or os.path.commonpath([repository, opened]) != repository:
        os.close(fd)
        raise UnsafeCheckpointError(
            f"{name} was opened at {opened}, out of its Hugging Face cache repository {repository} (a folder "
            "on its way swapped for a link out); refusing to read it"
        )
    return fd


def regular_size(path: str | os.PathLike[str]) -> int:
    """The size of the regular file at ``path``, looked at by the same rule a read opens it by
    (:func:`open_regular`): a symlink or a FIFO in its place is refused by name, not measured
    through. Raises FileNotFoundError when nothing is there."""
    fd = open_regular(None, path)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def vanished(path: object) -> CorruptCheckpointError:
    """The error for a file of a checkpoint that disappeared between the check and the read."""
    return CorruptCheckpointError(
        f"{path} vanished: the checkpoint changed while reading (replaced or removed by another process)"
    )


# The folders of a Hugging Face cache repository: ``models--org--name/snapshots/<revision>/`` holds
# links into ``models--org--name/blobs/``, which are the repository's own files.
_HF_CACHE_REPOS = ("models--", "datasets--", "spaces--")


def source_tree(directory: str | os.PathLike[str]) -> Path:
    """The tree a source directory's files may link within: the directory itself, or, for a
    snapshot in a Hugging Face cache (``models--X/snapshots/<revision>/``), the repository's cache
    folder ``models--X/`` (its files are symlinks into ``../../blobs/``), also where the
    directory is named through a link to the snapshot (``mymodel -> hub/models--X/snapshots/abc``)
    and where it is a folder below the snapshot's root (a diffusers ``unet/``, a ``subfolder=``)."""
    real = Path(os.path.realpath(directory))
    for folder in (real, *real.parents):
        if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith(_HF_CACHE_REPOS):
            return folder.parent.parent
    return real  # (the folder the reads open: abspath would fold a ``..`` after a link into another)


def hub_blob(path: str | os.PathLike[str]) -> str | None:
    """Where ``path`` leads, if it is a symlink in a Hugging Face cache snapshot leading within
    the repository's cache folder (:func:`source_tree`); None if it is no link of a snapshot (a
    link elsewhere stays refused: our saves never make one, so it was planted).

    Raises:
        UnsafeCheckpointError: a snapshot's link leading out of its repository.
        FileNotFoundError: a snapshot's link to a blob that is not there (naming both).
    """
    if not os.path.islink(path):
        return None
    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    tree = source_tree(folder)
    if os.fspath(tree) == folder:
        return None
    return os.fspath(resolve_in_tree(path, tree))


def hub_repository(path: str) -> str | None:
    """The Hugging Face cache repository folder (``.../models--X``) the absolute ``path`` names a
    file of, read from the path alone (``models--X/snapshots/<rev>/...`` or ``models--X/blobs/...``);
    None where it names none."""
    parts = path.split("/")
    for at in range(len(parts) - 1, 0, -1):
        if parts[at].startswith(_HF_CACHE_REPOS) and at + 1 < len(parts) and parts[at + 1] in ("snapshots", "blobs"):
            return "/".join(parts[: at + 1])
    return None


def hub_cache_repo(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` is a Hugging Face cache repository folder (``models--X/``, holding its
    ``snapshots/`` and ``blobs/``): the tree :func:`source_tree` returns for a snapshot."""
    folder = Path(folder)
    return folder.name.startswith(_HF_CACHE_REPOS) and (folder / "snapshots").is_dir()


def resolve_in_tree(path: str | os.PathLike[str], tree: str | os.PathLike[str]) -> Path:
    """``path`` if it is not a symlink; else the file it leads to, if that lies inside ``tree``
    (a link of a Hugging Face cache snapshot into its ``blobs/``).

    Raises:
        UnsafeCheckpointError: a symlink leading out of ``tree`` (``tokenizer.json -> /etc/passwd``,
            ``README.md -> /proc/self/environ``), or a loop.
        FileNotFoundError: a link within ``tree`` to a file that does not exist (a hub snapshot
            whose blob was deleted, an interrupted download), naming the link as the folder
            shows it, not only the missing target.
    """
    path = Path(path)
    if not path.is_symlink():
        return path
    real = Path(os.path.realpath(path))
    root = os.path.realpath(tree)
    if os.path.commonpath([root, real]) != root or os.path.islink(real):
        raise UnsafeCheckpointError(
            f"{os.fspath(path)} is a symlink leading out of {root} (to {real}); refusing to follow it"
        )
    if not os.path.lexists(real):
        raise FileNotFoundError(f"{os.fspath(path)} is a link to {real}, which does not exist")
    return real


def open_in_tree(path: str | os.PathLike[str], tree: str | os.PathLike[str]) -> int:
    """The one rule for a source file that may be a link inside its tree: resolved by
    :func:`resolve_in_tree`, then opened by :func:`open_regular` (regular files only, never
    blocking on a FIFO, no symlink swapped in meanwhile followed)."""
    return open_regular(None, resolve_in_tree(path, tree))


def read_small(path: str | os.PathLike[str], limit: int = 2**20) -> bytes:
    """The bytes of the small regular file at ``path`` (a record, a manifest), never following a
    symlink in its last component nor blocking on a FIFO someone planted there.

    Raises:
        FileNotFoundError: nothing there.
        UnsafeCheckpointError: a symlink, or not a regular file.
        ValueError: larger than ``limit`` bytes (not a file a save wrote).
    """
    fd = open_regular(None, path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise ValueError(f"{os.fspath(path)} has {size} bytes, more than the {limit} a record can have")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit + 1)[:limit]
    finally:
        os.close(fd)


# A file's bytes: one buffer, or pieces written one after another by gathered writes (a
# ``.metadata`` spliced from its workers' runs: never joined into one copy first).
FileData = bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview | pickle.PickleBuffer]
_IOV_MAX = 1024  # Linux's limit on the pieces of one writev


def write_new(directory: int, name: str, data: FileData, *, sync: bool = True) -> None:
    """Create ``name`` new in ``directory`` (see :func:`create_new`) holding ``data``, fsynced.

    Raises:
        InvalidDestinationError: the name exists already (a file, or a symlink someone planted):
            nothing was written, and whatever the name points to is untouched.
    """
    try:
        fd = create_new(directory, name)
    except FileExistsError:
        raise InvalidDestinationError(
            f"{_shown(directory, name)} exists already (it was not written by this save: a planted file or "
            "symlink?); refusing to write through it"
        ) from None
    try:
        write_all(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: FileData) -> None:
    """Write all of ``data`` at ``fd``'s position (a sequence of pieces: with ``writev``)."""
    pieces = [data] if isinstance(data, bytes | bytearray | memoryview) else data
    views = [view for view in (memoryview(piece).cast("B") for piece in pieces) if view.nbytes]
    at = 0
    while at < len(views):
        written = os.writev(fd, views[at : at + _IOV_MAX])
        while written and written >= views[at].nbytes:  # a short write ends inside a piece: resumed there
            written -= views[at].nbytes
            at += 1
        if written:
            views[at] = views[at][written:]


def replace_new(directory: int, name: str, data: bytes) -> None:
    """Replace ``name`` in ``directory`` with ``data`` atomically: written new under a temporary name,
    fsynced, renamed over ``name`` (a rename replaces a symlink itself, never what it points to)."""
    temporary = f".{name}.tmp"
    remove_name(directory, temporary)  # a stale one, or a planted symlink: unlinking it is harmless
    write_new(directory, temporary, data)
    os.replace(temporary, plain_name(name), src_dir_fd=directory, dst_dir_fd=directory)


def remove_name(directory: int, name: str) -> None:
    """Unlink ``name`` in ``directory`` if it is there; a symlink is removed itself (never its
    target), and a directory is left alone (a checkpoint's files are plain files)."""
    with contextlib.suppress(FileNotFoundError, IsADirectoryError):
        try:
            os.unlink(plain_name(name), dir_fd=directory)
        except PermissionError:
            if not stat.S_ISDIR(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode):
                raise  # Linux says EISDIR for a directory; other systems EPERM


_RENAME_NOREPLACE = 1


def rename_name(directory: int, source: str, target: str, *, replace: bool) -> None:
    """Rename ``source`` to ``target``, both in ``directory``; without ``replace`` never over an
    existing ``target``, atomically (``renameat2(RENAME_NOREPLACE)``, else ``link`` + ``unlink``).

    Raises:
        CheckpointExistsError: ``target`` appeared meanwhile (without ``replace``); it was kept.
    """
    source, target = plain_name(source), plain_name(target)
    if replace:
        os.replace(source, target, src_dir_fd=directory, dst_dir_fd=directory)
        return
    renameat2 = _renameat2()
    if renameat2 is not None:
        if renameat2(directory, os.fsencode(source), directory, os.fsencode(target), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise CheckpointExistsError(
                f"{_shown(directory, target)} appeared while this save ran; it was not replaced "
                "(pass overwrite=True to replace it)"
            )
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, f"cannot rename {source} to {target}: {os.strerror(err)}")
    # No renameat2 here: link() also refuses an existing name, atomically.
    try:
        os.link(source, target, src_dir_fd=directory, dst_dir_fd=directory, follow_symlinks=False)
    except FileExistsError:
        raise CheckpointExistsError(
            f"{_shown(directory, target)} appeared while this save ran; it was not replaced"
        ) from None
    os.unlink(source, dir_fd=directory)


@functools.cache  # find_library runs ldconfig in a subprocess: once per process, not per rename
def _renameat2() -> Any:
    libc_name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(libc_name, use_errno=True), "renameat2", None) if libc_name else None


def sync_directory(directory: int) -> None:
    """fsync a directory (its renames and unlinks); some file systems cannot, and the renames are
    atomic all the same."""
    with contextlib.suppress(OSError):
        os.fsync(directory)


def _shown(directory: int | None, name: str | os.PathLike[str]) -> str:
    if directory is None:
        return os.fspath(name)
    try:
        return os.fspath(Path(os.readlink(f"/proc/self/fd/{directory}")) / os.fspath(name))
    except OSError:
        return os.fspath(name)
