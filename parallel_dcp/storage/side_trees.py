"""Folders copied beside a checkpoint's files (``1_Pooling/``, ``2_Normalize/``), written safely.

    extras {"1_Pooling/config.json": b"..."}          (names with a "/", relative to the destination)
        │  grouped by their first folder
        ▼
    .1_Pooling.<save_id>.tmp/config.json               made new: mkdir + O_CREAT|O_EXCL|O_NOFOLLOW,
        │                                              every level opened O_DIRECTORY|O_NOFOLLOW
        ▼  after the commit point
    1_Pooling/                                          one rename; with overwrite, into an existing
                                                        folder file by file (merge_tree): each file
                                                        replaces its namesake, the rest is kept

Every name is resolved relative to an open directory descriptor, one plain component at a time, so
nothing is written through a symlink or outside the destination, whatever was planted there.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable, Mapping

from parallel_dcp.errors import InvalidDestinationError, UnsafeCheckpointError
from parallel_dcp.storage.safe_files import plain_name, write_new

__all__ = ["check_merge", "is_directory", "merge_tree", "remove_tree", "split_trees", "write_tree"]

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def split_trees(files: Mapping[str, bytes]) -> tuple[dict[str, bytes], dict[str, dict[str, bytes]]]:
    """(plain names -> data, first folder -> {path under it -> data}) of ``files``.

    Raises:
        UnsafeCheckpointError: a path with an empty, ``.`` or ``..`` component, or absolute.
    """
    flat: dict[str, bytes] = {}
    trees: dict[str, dict[str, bytes]] = {}
    for name, data in files.items():
        if "/" not in name:
            flat[name] = data
            continue
        parts = name.split("/")
        for part in parts:
            plain_name(part)
        trees.setdefault(parts[0], {})["/".join(parts[1:])] = data
    return flat, trees


def _open_dir(parent: int, name: str) -> int:
    try:
        return os.open(plain_name(name), _OPEN_DIR, dir_fd=parent)
    except OSError as exc:
        raise UnsafeCheckpointError(f"{name!r} in the destination is not a plain folder (a symlink?): {exc}") from exc


def write_tree(directory: int, name: str, files: Mapping[str, bytes], *, sync: bool = True) -> None:
    """Make the folder ``name`` new in ``directory`` holding ``files`` (paths under it -> data).

    Raises:
        InvalidDestinationError: ``name`` (or a folder or file in it) exists already.
    """
    try:
        os.mkdir(plain_name(name), 0o755, dir_fd=directory)
    except FileExistsError:
        raise InvalidDestinationError(
            f"{name!r} exists already in the destination; refusing to write into it"
        ) from None
    opened: dict[str, int] = {"": _open_dir(directory, name)}
    try:
        for path, data in sorted(files.items()):
            *folders, leaf = path.split("/")
            at = ""
            for folder in folders:
                below = f"{at}/{folder}" if at else folder
                if below not in opened:
                    with contextlib.suppress(FileExistsError):  # made by an earlier path of this tree
                        os.mkdir(plain_name(folder), 0o755, dir_fd=opened[at])
                    opened[below] = _open_dir(opened[at], folder)
                at = below
            write_new(opened[at], leaf, data, sync=sync)
        if sync:
            for fd in opened.values():
                with contextlib.suppress(OSError):
                    os.fsync(fd)
    finally:
        for fd in opened.values():
            os.close(fd)


def is_directory(directory: int, name: str) -> bool:
    """True when ``name`` in ``directory`` is a folder itself (not a symlink to one)."""
    try:
        return stat.S_ISDIR(os.stat(plain_name(name), dir_fd=directory, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def remove_tree(directory: int, name: str) -> None:
    """Remove the folder ``name`` in ``directory`` and all in it, following no symlink (a link in
    it is removed itself, never what it points to). Nothing there: nothing to do."""
    try:
        fd = os.open(plain_name(name), _OPEN_DIR, dir_fd=directory)
    except FileNotFoundError:
        return
    try:
        for entry in os.listdir(fd):
            if is_directory(fd, entry):
                remove_tree(fd, entry)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=directory)


def merge_tree(directory: int, made: str, into: str) -> None:
    """Move each file of the folder ``made`` (this save's, new) to the same path under the existing
    folder ``into``, replacing the file or symlink of that name there (itself, never followed);
    folders are made as needed, and whatever else ``into`` holds is kept. ``made``, emptied, is
    removed. An overwrite replaces the files it copies, never a folder's other files (a release's
    ``original/consolidated.00.pth`` beside a copied ``original/params.json``).

    Raises:
        UnsafeCheckpointError: a symlink or a file under ``into`` where a folder of ``made`` goes.
        InvalidDestinationError: a folder under ``into`` where a file of ``made`` goes (both are
            checked before anything is written: :func:`check_merge`).
    """
    source, target = _open_dir(directory, made), _open_dir(directory, into)
    try:
        _merge(source, target, into)
    finally:
        os.close(source)
        os.close(target)
    remove_tree(directory, made)


def _merge(source: int, target: int, shown: str) -> None:
    for name in sorted(os.listdir(source)):
        if is_directory(source, name):
            with contextlib.suppress(FileExistsError):
                os.mkdir(plain_name(name), 0o755, dir_fd=target)
            inner, outer = _open_dir(source, name), _open_dir(target, name)
            try:
                _merge(inner, outer, f"{shown}/{name}")
            finally:
                os.close(inner)
                os.close(outer)
            continue
        if is_directory(target, name):
            raise InvalidDestinationError(f"{shown}/{name} in the destination is a folder where a copied file goes")
        os.replace(plain_name(name), name, src_dir_fd=source, dst_dir_fd=target)
    os.fsync(target)


def check_merge(destination: str | os.PathLike[str], paths: Iterable[str]) -> None:
    """Refuse, before anything is written, copied files (``paths`` under ``destination``, each with
    a "/") that an overwrite could not merge without deleting a folder, or without writing through
    a link: a folder where a file goes, a file or a symlink where a folder inside a copied folder
    goes. (A file or a symlink where a whole copied folder goes is replaced by it, never followed.)

    Raises:
        InvalidDestinationError: naming the path.
    """
    for path in sorted(paths):
        *folders, leaf = path.split("/")
        at = os.fspath(destination)
        for depth, folder in enumerate(folders):
            at = os.path.join(at, folder)
            try:
                mode = os.lstat(at).st_mode
            except FileNotFoundError:
                break
            if depth == 0 and not stat.S_ISDIR(mode):
                break  # a file or a symlink where a whole copied folder goes: replaced itself, never followed
            if not stat.S_ISDIR(mode):
                raise InvalidDestinationError(
                    f"{at} is {'a symlink' if stat.S_ISLNK(mode) else 'a file'} where the copied folder "
                    f"{'/'.join(folders)}/ goes; remove it, or convert with --no-copy-files (nothing was written)"
                )
        else:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISDIR(os.lstat(os.path.join(at, leaf)).st_mode):
                    raise InvalidDestinationError(
                        f"{os.path.join(at, leaf)} is a folder where the copied file {path} goes; remove it, or "
                        "convert with --no-copy-files (nothing was written)"
                    )
