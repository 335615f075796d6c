"""Where a checkpoint is written: a staging directory beside the destination, then a swap.

Shards are never written next to a live ``.metadata`` (a crash there pairs the old metadata with
new shards, and DCP loads that silently). Instead:

    <parent>/.<name>.staging-<id>/   workers write shards; the coordinator commits .metadata
    publish():  staging ──rename──▶ <parent>/<name>           (no checkpoint there before)
                staging ◀─exchange─▶ <parent>/<name>          (overwrite: one atomic renameat2)
                then the old checkpoint, now under the staging name, is removed
    discard():  the staging directory is removed; the destination was never touched

Object storage has no rename, so there a save writes beside the checkpoint it replaces
(:class:`RemoteStaging`), under shard names no other save uses (``__<task>_<tag>_0.distcp``):

    upload every shard ── all done? ── delete the old .metadata ── upload the manifest, then
    .metadata (the commit) ── delete the old checkpoint's shards
    discard():  this save's shards and unfinished uploads are deleted; the old checkpoint,
                whose .metadata still names only its own shards, loads as before

A crash can leave no ``.metadata`` (between its delete and the upload of the new one), never an
old ``.metadata`` beside new shards.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from parallel_dcp.errors import CheckpointExistsError, InsufficientSpaceError, InvalidDestinationError
from parallel_dcp.storage.location import Remote

__all__ = ["DCP_LAYOUT", "FileStaging", "Layout", "RemoteFileStaging", "RemoteStaging", "Staging", "is_checkpoint"]

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

    def owns(self, name: str) -> bool:
        """True when a file of this name is one this layout writes."""
        return name in self.markers or name.endswith(self.suffixes) or name.startswith(MANIFEST_FILE)

    def owns_only(self, path: Path) -> bool:
        """True when every entry of ``path`` is a file this layout writes (safe to replace)."""
        return all(self.owns(entry.name) for entry in path.iterdir())


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


def _check_bucket(destination: Remote) -> None:
    """Fail before any write when the bucket is missing or the credentials are refused."""
    protocol, rest = destination.url.split("://", 1)
    bucket = Remote(f"{protocol}://{rest.split('/', 1)[0]}", destination.options)
    try:
        found = bucket.exists()
    except Exception as exc:  # botocore's credential and endpoint errors are not OSErrors
        raise InvalidDestinationError(f"cannot reach {bucket}: {type(exc).__name__}: {exc}") from exc
    if not found:
        raise InvalidDestinationError(f"cannot write {destination}: {bucket} does not exist (or is not accessible)")


def _abort_uploads(destination: Remote, mine: Callable[[str], bool]) -> None:
    """Abort the unfinished multipart uploads under ``destination`` whose names ``mine`` accepts.

    A killed worker leaves its upload open: the object never appears, but its parts are stored
    (and billed) until aborted.
    """
    fs = destination.fs
    if not hasattr(fs, "list_multipart_uploads"):
        return
    bucket, _, key = destination.key.partition("/")
    prefix = f"{key}/" if key else ""
    with contextlib.suppress(Exception):  # best effort: cleanup must not hide the real failure
        for upload in fs.list_multipart_uploads(bucket):
            name = str(upload.get("Key", ""))
            if name.startswith(prefix) and "/" not in name[len(prefix) :] and mine(name[len(prefix) :]):
                fs.abort_mpu(bucket, name, upload["UploadId"])


class RemoteStaging:
    """A checkpoint prefix on object storage, written in place (see the module docstring).

    ``unique_names`` says the layout's data files are named per save (DCP), so an old checkpoint
    survives a failed overwrite; layouts with fixed shard names (Hugging Face directories) refuse
    to overwrite on object storage instead.

    Raises:
        CheckpointExistsError: a checkpoint is there and ``overwrite`` is False.
        InvalidDestinationError: the bucket is missing or unreachable, the URL is an object, or
            the prefix holds other things than a checkpoint of this layout.
    """

    def __init__(self, destination: Remote, *, overwrite: bool, layout: Layout, unique_names: bool) -> None:
        _check_bucket(destination)
        if destination.is_file():
            raise InvalidDestinationError(f"cannot write a checkpoint to {destination}: it is an object, not a prefix")
        names = destination.listdir()
        holds = any(marker in names for marker in layout.markers)
        if holds and not overwrite:
            raise CheckpointExistsError(
                f"{destination} already holds a checkpoint; pass overwrite=True (--overwrite) to replace it"
            )
        if names and not (overwrite and all(layout.owns(n) for n in names)):
            raise InvalidDestinationError(
                f"{destination} holds objects that are not a {layout.name} ({', '.join(names[:5])}); "
                "refusing to write into it (choose an empty or new prefix)"
            )
        if names and not unique_names:
            raise InvalidDestinationError(
                f"cannot overwrite the {layout.name} at {destination}: on object storage its shards would be "
                "replaced in place, so a failure would leave neither checkpoint; delete it first or write to a "
                "new prefix"
            )
        self.destination = destination
        self.path = destination
        self.layout = layout
        self.tag = uuid.uuid4().hex[:8]
        self._existing = names
        self._committed = False

    def check_space(self, nbytes: int) -> None:
        """Object storage has no free-space figure to check."""

    def commit(self, marker: str, payload: bytes, before: dict[str, bytes]) -> None:
        """Delete the old ``marker``, upload ``before`` (the manifest), then ``marker`` itself."""
        (self.destination / marker).remove()
        for name, data in before.items():
            (self.destination / name).write_bytes(data)
        (self.destination / marker).write_bytes(payload)
        self._committed = True

    def publish(self) -> None:
        """Delete the old checkpoint's data files (the commit already made the new one)."""
        if not self._committed:
            raise RuntimeError(f"nothing was committed to {self.destination}")
        rewritten = {*self.layout.markers, MANIFEST_FILE}
        stale = [n for n in self._existing if n not in rewritten and self.layout.owns(n)]
        try:
            self.destination.remove_all(stale)
        except Exception as exc:  # the new checkpoint is committed: leftovers only cost space
            warnings.warn(f"{self.destination}: could not delete the replaced shards {stale[:3]}: {exc}", stacklevel=2)

    def discard(self) -> None:
        """Delete this save's files and unfinished uploads; the old checkpoint stays as it was."""
        if self._committed:
            return
        with contextlib.suppress(Exception):  # best effort: cleanup must not hide the real failure
            self.destination.remove_all(n for n in self.destination.listdir() if self._mine(n))
        _abort_uploads(self.destination, self._mine)

    def _mine(self, name: str) -> bool:
        return f"_{self.tag}_" in name or name not in self._existing


class RemoteFileStaging:
    """A single-file output on object storage. It is uploaded straight to its name: an object
    appears only when its (multipart) upload completes, so readers see the old one or the new.

    Raises:
        CheckpointExistsError: the object exists and ``overwrite`` is False.
        InvalidDestinationError: the bucket is missing or unreachable, or the URL is a prefix.
    """

    def __init__(self, destination: Remote, *, overwrite: bool) -> None:
        _check_bucket(destination)
        if destination.is_dir():
            raise InvalidDestinationError(f"cannot write the file {destination}: it is a prefix holding objects")
        if destination.exists() and not overwrite:
            raise CheckpointExistsError(
                f"{destination} already exists; pass overwrite=True (--overwrite) to replace it"
            )
        self.destination = destination
        self.path = destination

    def check_space(self, nbytes: int) -> None:
        """Object storage has no free-space figure to check."""

    def publish(self) -> None:
        """The completed upload was the publish."""

    def discard(self) -> None:
        _abort_uploads(self.destination.parent, lambda name: name == self.destination.name)
