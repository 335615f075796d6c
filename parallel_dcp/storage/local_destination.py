"""The checks of a local destination before anything is written, shared by the real run's
staging (:mod:`parallel_dcp.storage.local_staging`) and a dry run (through
:func:`parallel_dcp.storage.staging.check_directory` / ``check_file``), so both refuse the same
destinations: a missing or read-only parent, the Hugging Face cache, a broken link, a file where
a directory goes (or the reverse), a non-empty directory that holds no checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

from parallel_dcp.errors import InvalidDestinationError
from parallel_dcp.storage.ownership import (
    LOCK_FILE,
    Layout,
    find_leftovers,
    others_leftovers,
    owner_name,
    written_by_us,
)
from parallel_dcp.storage.safe_files import hub_repository

__all__ = [
    "check_local_contents",
    "check_local_directory",
    "check_local_file",
    "refuse_foreign",
    "why_not_writable",
]


def check_local_directory(dest: Path) -> None:
    """The checks of a checkpoint directory ``dest`` (absolute) before it is made or locked.

    Raises:
        InvalidDestinationError: its parent is missing or not writable (where ``dest`` must be
            made), it is in the Hugging Face cache, a broken link, or a file."""
    # Written inside only: its parent needs to be writable where it must be made (an existing
    # /output of a container, its parent root's, was refused).
    _check_parent(dest, writable=not dest.is_dir())
    if os.path.lexists(dest) and not dest.exists():
        raise InvalidDestinationError(f"cannot write a checkpoint to {dest}: it is a broken symbolic link")
    if dest.exists() and not dest.is_dir():
        raise InvalidDestinationError(f"cannot write a checkpoint to {dest}: it is a file, not a directory")


def check_local_file(dest: Path) -> None:
    """The checks of a single-file output ``dest`` (absolute) before its directory is locked.

    Raises:
        InvalidDestinationError: its parent is missing or not writable, it is in the Hugging Face
            cache, or a directory."""
    _check_parent(dest)
    if dest.is_dir():
        raise InvalidDestinationError(f"cannot write the file {dest}: it is a directory")


def check_local_contents(dest: Path, layout: Layout) -> None:
    """What :class:`LocalDirStaging` refuses of an existing directory's contents, checked without
    its lock and writing nothing (a dry run's check): a non-empty directory that holds no
    ``layout`` checkpoint. This user's dead saves' files are left out (a real run removes them
    first: :func:`~parallel_dcp.storage.ownership.clean_leftovers`).

    Raises:
        InvalidDestinationError: as the real run's check under the lock does."""
    if not dest.is_dir():
        return
    names = sorted(os.listdir(dest))
    cleaned: set[str] = set()
    for leftover in find_leftovers(dest, names):
        owner = owner_name(leftover["save_id"])
        if leftover["running"] is False and written_by_us(dest / owner):
            cleaned.update([owner, *leftover["files"]])
    names = [n for n in names if n != LOCK_FILE and n not in cleaned]
    if not layout.holds_checkpoint(dest, names):
        refuse_foreign(dest, names, layout)


def refuse_foreign(directory: Path, names: list[str], layout: Layout) -> None:
    """Refuse ``directory`` when it holds ``names`` (none of a ``layout`` checkpoint): it is no
    checkpoint of this kind, and nothing in it is ours to replace."""
    if not names:
        return
    theirs = others_leftovers(directory, names)
    raise InvalidDestinationError(
        f"{directory} is a non-empty directory that is not a {layout.name}; refusing to write into it "
        + (
            f"(it holds {theirs}; another user's files are never removed on their behalf: choose another "
            "directory, or have their owner resume that job or remove its files)"
            if theirs
            else "(choose an empty or new directory)"
        )
    )


def _check_parent(destination: Path, *, writable: bool = True) -> None:
    parent = destination.parent
    if not parent.is_dir():
        raise InvalidDestinationError(f"cannot write {destination}: its parent directory {parent} does not exist")
    # A hub cache snapshot's files are links the hub library manages into blobs/ (a checkpoint there
    # is read through them): a save would replace them, an overwrite delete them.
    repository = hub_repository(os.path.realpath(destination if destination.is_dir() else parent))
    if repository is not None:
        raise InvalidDestinationError(
            f"cannot write {destination}: it is in the Hugging Face cache {repository}, whose files the hub "
            "library manages (links into its blobs/); write to a folder outside the cache"
        )
    if writable and not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidDestinationError(f"cannot write {destination}: {why_not_writable(parent, f'directory {parent}')}")


def why_not_writable(directory: Path, what: str) -> str:
    """``what`` is not writable, and why where the file system says: it is mounted read-only."""
    try:
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return f"{what} is on a read-only file system" if read_only else f"{what} is not writable"
