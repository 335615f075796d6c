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
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from parallel_dcp.errors import (
    CheckpointExistsError,
    DestinationBusyError,
    InsufficientSpaceError,
    InvalidDestinationError,
    ResumeError,
)
from parallel_dcp.storage.ownership import (
    DCP_LAYOUT,
    DONE_PREFIX,
    JOB_PREFIX,
    LOCK_FILE,
    MANIFEST_FILE,
    Layout,
    clean_leftovers,
    find_leftovers,
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
from parallel_dcp.storage.resume import IdentityCheck, read_job_record

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


def _replace_synced(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp")  # not an owner file's name: leftovers never read it
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    _write_synced(temporary, data)
    os.replace(temporary, path)


def _manifest_save_id(directory: Path) -> str | None:
    """The save id in the destination's manifest (that save committed: nothing to resume)."""
    try:
        value = json.loads((directory / MANIFEST_FILE).read_bytes()).get("save_id")
    except (ValueError, OSError, AttributeError):
        return None
    return value if isinstance(value, str) else None


class _LocalStaging(Staging):
    """What a local directory and a local file share: lock, owner file, temporary names, renames."""

    destination: Path

    def __init__(
        self,
        *,
        directory: Path,
        destination: Path,
        lock: Path,
        overwrite: bool,
        protect: Sequence[str],
        resume: IdentityCheck | None = None,
    ):
        self.destination = destination
        self.resumed = None
        self._resume = resume
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
            adopted = self._adopt() if self._resume is not None else None
            clean_leftovers(self._dir, keep=adopted)
            self._check()
            owner = self._dir / owner_name(self.save_id)
            if adopted is not None:  # the dead save's owner record becomes this process's
                _replace_synced(owner, json.dumps(self._record).encode())
            else:
                _write_synced(owner, json.dumps(self._record).encode())
        except BaseException:
            self._release()
            raise

    def _adopt(self) -> str | None:
        """Under the lock: take over the files of a dead conversion to this destination whose job
        record matches (``resume=True``); its save id becomes this save's. None when there is none.

        Raises:
            ResumeError: there is a dead conversion to this destination, but of another job
                (nothing is removed: the user decides).
        """
        assert self._resume is not None
        committed = _manifest_save_id(self._dir)
        refused: list[tuple[str, list[str]]] = []
        for leftover in find_leftovers(self._dir):
            save_id: str = leftover["save_id"]
            if leftover["running"] is not False or not leftover["resumable"] or save_id == committed:
                continue
            record = read_job_record(self._dir, save_id)
            if record is None:
                refused.append((save_id, ["its job record is damaged (it fails its checksum)"]))
                continue
            if record.get("destination") != os.fspath(self.destination):
                continue  # a neighbouring single-file output in the same directory
            reasons = self._resume(record["identity"])
            if reasons:
                refused.append((save_id, reasons))
                continue
            self.save_id = save_id
            self._record = owner_record(save_id, self.destination)
            self.location = WriteLocation(self.location.root, save_id, private=True)
            self.resumed = record
            return save_id
        if refused:
            save_id, reasons = refused[0]
            raise ResumeError(
                f"cannot resume the conversion to {self.destination} (save {save_id}): "
                + "; ".join(reasons)
                + ". Run again with the arguments it had, or without resume to start over (its files are "
                "then removed)",
                reasons=reasons,
            )
        return None

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
            for name in listing(self._dir):  # the records kept for resume, before the owner file
                if is_of_save(name, self.save_id) and name.startswith((JOB_PREFIX, DONE_PREFIX)):
                    remove_path(self._dir / name)
            remove_path(self._dir / owner_name(self.save_id))
            _fsync_dir(self._dir)
        finally:
            self._release()

    def discard_keeping(self, keep: Collection[str]) -> None:
        if self._committed or not keep:
            self.discard()
            return
        try:
            with contextlib.suppress(OSError):
                keep = {*keep, owner_name(self.save_id)}
                for name in listing(self._dir):
                    if (is_of_save(name, self.save_id) or name in self._created) and name not in keep:
                        remove_path(self._dir / name)
                # Marked stopped (no pid): the next save to this destination resumes or removes them,
                # also from this same process.
                record = self._record | {"pid": None, "start": None, "stopped": True}
                _replace_synced(self._dir / owner_name(self.save_id), json.dumps(record).encode())
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
        resume: IdentityCheck | None = None,
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
                directory=dest,
                destination=dest,
                lock=dest / LOCK_FILE,
                overwrite=overwrite,
                protect=protect,
                resume=resume,
            )
        except BaseException:
            self._after_discard()
            raise
        self.location = WriteLocation(dest, self.save_id, private=True)
        self._start()

    def _check(self) -> None:
        mine = self.save_id if self.resumed is not None else None  # an adopted save's files are ours
        names = [n for n in listing(self._dir) if n != LOCK_FILE and not (mine and is_of_save(n, mine))]
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

    def __init__(
        self,
        destination: str | os.PathLike[str],
        *,
        overwrite: bool,
        protect: Sequence[str] = (),
        resume: IdentityCheck | None = None,
    ) -> None:
        dest = Path(os.path.abspath(destination))
        _check_parent(dest)
        if dest.is_dir():
            raise InvalidDestinationError(f"cannot write the file {dest}: it is a directory")
        lock = dest.parent / f".{dest.name}.lock"
        super().__init__(
            directory=dest.parent, destination=dest, lock=lock, overwrite=overwrite, protect=protect, resume=resume
        )
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
