"""Where a checkpoint is written: a staging directory beside the destination, then a swap.

Shards are never written next to a live ``.metadata`` (a crash there pairs the old metadata with
new shards, and DCP loads that silently). Instead:

    <parent>/.<name>.staging-<id>/   workers write shards; the coordinator commits .metadata
    publish():  staging ──rename──▶ <parent>/<name>           (no checkpoint there before)
                staging ◀─exchange─▶ <parent>/<name>          (overwrite: one atomic renameat2)
                then the old checkpoint, now under the staging name, is removed
    discard():  the staging directory is removed; the destination was never touched
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from parallel_dcp.errors import CheckpointExistsError, InsufficientSpaceError, InvalidDestinationError

__all__ = ["DCP_LAYOUT", "FileStaging", "Layout", "Staging", "is_checkpoint"]

METADATA_FILE = ".metadata"
MANIFEST_FILE = ".parallel_dcp.json"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


@dataclass(frozen=True, slots=True)
class Layout:
    """How a checkpoint directory of one format looks: what marks it committed, what it holds."""

    name: str
    markers: tuple[str, ...]
    suffixes: tuple[str, ...]

    def holds_checkpoint(self, path: Path) -> bool:
        return any(Path(path, marker).is_file() for marker in self.markers)

    def owns_only(self, path: Path) -> bool:
        """True when every entry of ``path`` is a file this layout writes (safe to replace)."""
        return all(
            entry.name in self.markers or entry.name.endswith(self.suffixes) or entry.name.startswith(MANIFEST_FILE)
            for entry in path.iterdir()
        )


DCP_LAYOUT = Layout("DCP checkpoint", (METADATA_FILE,), (".distcp", ".metadata.tmp"))


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a directory holding a committed DCP checkpoint (``.metadata``)."""
    return DCP_LAYOUT.holds_checkpoint(Path(path))


def _check_parent(destination: Path) -> None:
    parent = destination.parent
    if not parent.is_dir():
        raise InvalidDestinationError(f"cannot write {destination}: its parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidDestinationError(f"cannot write {destination}: directory {parent} is not writable")


class Staging:
    """A private directory to build a checkpoint in, published to ``destination`` atomically.

    Creating one checks the destination first, so bad destinations fail before any write.

    Raises:
        CheckpointExistsError: ``destination`` holds a checkpoint and ``overwrite`` is False.
        InvalidDestinationError: ``destination`` is a file, a directory holding other things
            than a DCP checkpoint, or inside a missing or unwritable parent.
    """

    def __init__(self, destination: str | os.PathLike[str], *, overwrite: bool, layout: Layout = DCP_LAYOUT) -> None:
        self.destination = Path(os.path.abspath(destination))
        parent = self.destination.parent
        _check_parent_exists(self.destination)
        if self.destination.exists() and not self.destination.is_dir():
            raise InvalidDestinationError(
                f"cannot write a checkpoint to {self.destination}: it is a file, not a directory"
            )
        if layout.holds_checkpoint(self.destination):
            if not overwrite:
                raise CheckpointExistsError(
                    f"{self.destination} already holds a checkpoint; pass overwrite=True (--overwrite) to replace it"
                )
        elif (
            self.destination.is_dir()
            and any(self.destination.iterdir())
            and not (overwrite and layout.owns_only(self.destination))
        ):
            raise InvalidDestinationError(
                f"{self.destination} is a non-empty directory that is not a {layout.name}; "
                "refusing to write into it (choose an empty or new directory)"
            )
        _check_parent(self.destination)
        self.path = parent / f".{self.destination.name}.staging-{uuid.uuid4().hex[:12]}"
        try:
            self.path.mkdir()
        except OSError as exc:
            raise InvalidDestinationError(f"cannot create a staging directory in {parent}: {exc}") from exc

    def check_space(self, nbytes: int) -> None:
        """Fail before writing if the file system cannot hold ``nbytes`` more.

        Raises:
            InsufficientSpaceError: with the figures, so the user knows how much to free.
        """
        _check_space(self.path, self.destination, nbytes)

    def publish(self) -> None:
        """Make the staged checkpoint the destination, atomically; remove what it replaces."""
        if self.destination.is_dir() and any(self.destination.iterdir()):
            if _exchange(self.path, self.destination):
                shutil.rmtree(self.path, ignore_errors=True)
            else:  # no renameat2 here: the old one moves aside first, for as short a time as possible
                aside = self.path.with_name(self.path.name + "-old")
                os.rename(self.destination, aside)
                os.rename(self.path, self.destination)
                shutil.rmtree(aside, ignore_errors=True)
        else:
            # rename() replaces an empty directory atomically, and creates a missing one.
            os.rename(self.path, self.destination)
        _fsync_dir(self.destination.parent)

    def discard(self) -> None:
        """Remove the staging directory and everything in it."""
        shutil.rmtree(self.path, ignore_errors=True)


class FileStaging:
    """A single-file output (``model.safetensors``, ``model.pt``): written beside, then renamed over.

    Raises:
        CheckpointExistsError: the file exists and ``overwrite`` is False.
        InvalidDestinationError: the destination is a directory, or its parent is missing or
            not writable.
    """

    def __init__(self, destination: str | os.PathLike[str], *, overwrite: bool) -> None:
        self.destination = Path(os.path.abspath(destination))
        _check_parent_exists(self.destination)
        if self.destination.is_dir():
            raise InvalidDestinationError(f"cannot write the file {self.destination}: it is a directory")
        if self.destination.exists() and not overwrite:
            raise CheckpointExistsError(
                f"{self.destination} already exists; pass overwrite=True (--overwrite) to replace it"
            )
        _check_parent(self.destination)
        self.path = self.destination.parent / f".{self.destination.name}.staging-{uuid.uuid4().hex[:12]}"

    def check_space(self, nbytes: int) -> None:
        _check_space(self.destination.parent, self.destination, nbytes)

    def publish(self) -> None:
        os.replace(self.path, self.destination)  # atomic: readers see the old file or the new one
        _fsync_dir(self.destination.parent)

    def discard(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _check_parent_exists(destination: Path) -> None:
    if not destination.parent.is_dir():
        raise InvalidDestinationError(
            f"cannot write {destination}: its parent directory {destination.parent} does not exist"
        )


def _check_space(where: Path, destination: Path, nbytes: int) -> None:
    free = free_bytes(where)
    if free is not None and free < nbytes:
        raise InsufficientSpaceError(
            errno.ENOSPC,
            f"No space left on device for {destination}: it needs about {nbytes} bytes "
            f"({nbytes / 2**30:.2f} GiB) and {destination.parent} has {free} bytes free",
        )


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s file system; None if unknown."""
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with renameat2(RENAME_EXCHANGE); False where unsupported."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        # Some file systems cannot fsync a directory; the rename is atomic all the same.
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
