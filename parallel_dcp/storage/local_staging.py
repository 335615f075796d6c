"""Staging on a local file system: a directory (DCP or sharded) or a single file.

The destination's lock is an ``flock`` on a lock file; the commit is one ``rename`` of the marker
(``renameat2(RENAME_NOREPLACE)`` unless overwriting, so nothing that appeared meanwhile is ever
replaced). See :mod:`parallel_dcp.storage.staging` for the protocol.

Longer than 300 lines because the local commit protocol (lock, owner record, no-replace rename,
cleanup of leftovers) for both a directory and a single file, which share every step but the
names.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
from abc import abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from parallel_dcp.errors import (
    CheckpointExistsError,
    DestinationBusyError,
    InsufficientSpaceError,
    InvalidDestinationError,
)
from parallel_dcp.storage.ownership import (
    DCP_LAYOUT,
    LOCK_FILE,
    Layout,
    clean_leftovers,
    is_of_save,
    listing,
    new_save_id,
    owner_name,
    owner_record,
    protect_sources,
    remove_path,
    temp_name,
)
from parallel_dcp.storage.protocol import Staging, WriteLocation

__all__ = [
    "LocalDirStaging",
    "LocalFileStaging",
    "free_bytes",
]


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


class _Lock:
    """An exclusive ``flock`` on ``path``, held until :meth:`release`; the holder is recorded inside."""

    def __init__(self, path: Path, record: dict[str, Any], destination: Path) -> None:
        self.path = path
        for _ in range(20):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise InvalidDestinationError(f"cannot create the lock file {path}: {exc.strerror}") from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise DestinationBusyError(
                    f"{destination} is being written by another save ({holder}); one writer at a time: "
                    f"wait for it to finish (its lock is {path})"
                ) from None
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the previous holder removed the file between our open and our lock
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, (json.dumps(record) + "\n").encode())
            self.fd: int | None = fd
            return
        raise DestinationBusyError(f"{destination}: could not take the lock {path} (it keeps being replaced)")

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)  # while still locked: a waiter re-checks the inode and retries
        os.close(self.fd)
        self.fd = None


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        record = json.loads(os.pread(fd, 4096, 0))
        return f"pid {record['pid']} on host {record['host']}, save {record['save_id']}, since {record['since']}"
    return "a process that is still starting"


def _renameat2(src: Path, dst: Path, *, replace: bool) -> None:
    """Rename ``src`` to ``dst``; without ``replace`` never over an existing ``dst`` (atomically)."""
    if replace:
        os.replace(src, dst)
        return
    libc_name = ctypes.util.find_library("c")
    renameat2 = getattr(ctypes.CDLL(libc_name, use_errno=True), "renameat2", None) if libc_name else None
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise CheckpointExistsError(
                f"{dst} appeared while this save ran; it was not replaced (pass overwrite=True to replace it)"
            )
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, f"cannot rename {src} to {dst}: {os.strerror(err)}")
    # No renameat2 here: link() also refuses an existing name, atomically.
    try:
        os.link(src, dst)
    except FileExistsError:
        raise CheckpointExistsError(f"{dst} appeared while this save ran; it was not replaced") from None
    os.unlink(src)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class _LocalStaging(Staging):
    """What a local directory and a local file share: lock, owner file, temporary names, renames."""

    destination: Path

    def __init__(self, *, directory: Path, destination: Path, lock: Path, overwrite: bool, protect: Sequence[str]):
        self.destination = destination
        self.overwrite = overwrite
        self.protect = list(protect)
        self.save_id = new_save_id()
        self._dir = directory
        self._committed = False
        self._created: list[str] = []  # names this save published with no-replace renames
        self._replaced: set[str] = set()
        self._record = owner_record(self.save_id, destination)
        self._lock = _Lock(lock, self._record, destination)

    def _start(self) -> None:
        try:
            clean_leftovers(self._dir)
            self._check()
            _write_synced(self._dir / owner_name(self.save_id), json.dumps(self._record).encode())
        except BaseException:
            self._release()
            raise

    @abstractmethod
    def _check(self) -> None:
        """Check the destination (under the lock)."""

    @abstractmethod
    def _owned(self) -> set[str]:
        """The files of the checkpoint this save would replace."""

    def _release(self) -> None:
        self._lock.release()

    def check_space(self, nbytes: int) -> None:
        _check_space(self._dir, self.destination, nbytes)

    def expect(self, names: Iterable[str]) -> None:
        """Local files carry this save's id until their rename: nothing to note."""

    def commit(
        self,
        *,
        staged: Sequence[str] = (),
        marker: tuple[str, bytes] | None = None,
        extras: Mapping[str, bytes] | None = None,
    ) -> None:
        extras = dict(extras or {})
        small = ({marker[0]: marker[1]} if marker else {}) | extras
        for name, data in small.items():
            _write_synced(self._dir / temp_name(name, self.save_id), data)
        old = self._owned() if self.overwrite else set()
        new = {*staged, *small}
        protect_sources(self._dir, old | new, self.protect)
        if old:  # a save killed after its commit leaves these to the next save's cleanup
            record = self._record | {"replaces": sorted(old - new)}
            owner = self._dir / owner_name(self.save_id)
            _write_synced(self._dir / temp_name(owner.name, self.save_id), json.dumps(record).encode())
            os.replace(self._dir / temp_name(owner.name, self.save_id), owner)
        # The commit point: the marker's rename, or (no marker) the last staged file's.
        for name in [*staged, *([marker[0]] if marker else [])]:
            self._rename_into_place(name)
        self._committed = True
        for name in extras:
            self._rename_into_place(name)
        self._replaced = old - new
        _fsync_dir(self._dir)

    def _rename_into_place(self, name: str) -> None:
        _renameat2(self._dir / temp_name(name, self.save_id), self._dir / name, replace=self.overwrite)
        if not self.overwrite:
            self._created.append(name)

    def publish(self) -> None:
        if not self._committed:
            raise RuntimeError(f"nothing was committed to {self.destination}")
        try:
            for name in sorted(self._replaced):
                remove_path(self._dir / name)
            remove_path(self._dir / owner_name(self.save_id))
            _fsync_dir(self._dir)
        finally:
            self._release()

    def discard(self) -> None:
        try:
            if self._committed:
                with contextlib.suppress(OSError):  # committed: only our temporary files can remain
                    for name in listing(self._dir):
                        if name.startswith(".") and name.endswith(f".{self.save_id}.tmp"):
                            remove_path(self._dir / name)
                return
            with contextlib.suppress(OSError):
                for name in listing(self._dir):
                    if is_of_save(name, self.save_id) or name in self._created:
                        remove_path(self._dir / name)
        finally:
            self._release()
            self._after_discard()

    def _after_discard(self) -> None:
        """Called once the lock is released (a directory the save created goes away here)."""


class LocalDirStaging(_LocalStaging):
    """A checkpoint directory on a local (or shared) file system, written in place."""

    def __init__(
        self,
        destination: str | os.PathLike[str],
        *,
        overwrite: bool,
        layout: Layout = DCP_LAYOUT,
        protect: Sequence[str] = (),
    ) -> None:
        dest = Path(os.path.abspath(destination))
        _check_parent(dest)
        if os.path.lexists(dest) and not dest.exists():
            raise InvalidDestinationError(f"cannot write a checkpoint to {dest}: it is a broken symbolic link")
        if dest.exists() and not dest.is_dir():
            raise InvalidDestinationError(f"cannot write a checkpoint to {dest}: it is a file, not a directory")
        self._made = False
        if not dest.exists():
            try:
                dest.mkdir()
                self._made = True
            except FileExistsError:
                self._made = False  # another process made it: not ours to remove; the lock decides who writes
            except OSError as exc:
                raise InvalidDestinationError(f"cannot create {dest}: {exc.strerror}") from exc
        if not os.access(dest, os.W_OK | os.X_OK):
            raise InvalidDestinationError(f"cannot write {dest}: the directory is not writable")
        self.layout = layout
        try:
            super().__init__(
                directory=dest, destination=dest, lock=dest / LOCK_FILE, overwrite=overwrite, protect=protect
            )
        except BaseException:
            self._after_discard()
            raise
        self.location = WriteLocation(dest, self.save_id, private=True)
        self._start()

    def _check(self) -> None:
        names = [n for n in listing(self._dir) if n != LOCK_FILE]
        if self.layout.holds_checkpoint(self._dir, names):
            if not self.overwrite:
                raise CheckpointExistsError(
                    f"{self._dir} already holds a checkpoint; pass overwrite=True (--overwrite) to replace it"
                )
            protect_sources(self._dir, self.layout.owned(self._dir), self.protect)
        elif names:
            raise InvalidDestinationError(
                f"{self._dir} is a non-empty directory that is not a {self.layout.name}; "
                "refusing to write into it (choose an empty or new directory)"
            )

    def _owned(self) -> set[str]:
        return self.layout.owned(self._dir)

    def _after_discard(self) -> None:
        if self._made:
            with contextlib.suppress(OSError):
                self.destination.rmdir()  # only when empty: never what someone else put there


class LocalFileStaging(_LocalStaging):
    """A single-file output (``model.safetensors``, ``model.pt``): written beside, then renamed."""

    def __init__(self, destination: str | os.PathLike[str], *, overwrite: bool, protect: Sequence[str] = ()) -> None:
        dest = Path(os.path.abspath(destination))
        _check_parent(dest)
        if dest.is_dir():
            raise InvalidDestinationError(f"cannot write the file {dest}: it is a directory")
        lock = dest.parent / f".{dest.name}.lock"
        super().__init__(directory=dest.parent, destination=dest, lock=lock, overwrite=overwrite, protect=protect)
        self.location = WriteLocation(dest.parent, self.save_id, private=True)
        self._start()

    def _check(self) -> None:
        if os.path.lexists(self.destination):
            if not self.overwrite:
                raise CheckpointExistsError(
                    f"{self.destination} already exists; pass overwrite=True (--overwrite) to replace it"
                )
            protect_sources(self._dir, [self.destination.name], self.protect)

    def _owned(self) -> set[str]:
        return {self.destination.name} if self.destination.exists() else set()

    def commit(
        self,
        *,
        staged: Sequence[str] = (),
        marker: tuple[str, bytes] | None = None,
        extras: Mapping[str, bytes] | None = None,
    ) -> None:
        if self.destination.is_dir():  # re-checked: a directory may have appeared meanwhile
            raise InvalidDestinationError(f"cannot write the file {self.destination}: a directory appeared there")
        super().commit(staged=staged, marker=marker, extras=extras)


def _check_parent(destination: Path) -> None:
    parent = destination.parent
    if not parent.is_dir():
        raise InvalidDestinationError(f"cannot write {destination}: its parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidDestinationError(f"cannot write {destination}: directory {parent} is not writable")


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        # Some file systems cannot fsync a directory; the rename is atomic all the same.
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


# --- object storage ------------------------------------------------------------------------------
