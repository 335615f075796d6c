"""Where a job writes and how it commits: one protocol, implemented once per kind of destination.

What a checkpoint owns (and so what an overwrite replaces; every other file stays byte-identical):

- a DCP directory: its ``.metadata``, the shard files that ``.metadata`` names, its manifest;
- a sharded safetensors / torch directory: its shards (the index's ``weight_map``), its index and
  its manifest; without an index, its single shard (``model.safetensors``, ``pytorch_model.bin``);
- a single-file output: that file.

The protocol (:class:`Staging`), the same for a local directory, a local file, a prefix on object
storage and an object::

    stage        check the destination; take the lock (local); note this save as the owner
    location     where workers write: the destination itself, under names carrying this save's
                 id (``__<task>_<save id>_0.distcp``; fixed names as ``.<name>.<save id>.tmp``)
    check_space  fail before writing when the file system cannot hold the output
    commit       staged files renamed into place, then the marker (``.metadata`` / the index)
                 in one atomic rename (local: ``renameat2(RENAME_NOREPLACE)`` unless overwrite;
                 object storage: one upload), then the manifest. The commit point is the marker.
    publish      only now remove the files the *replaced* checkpoint owned; release the lock
    discard      on failure: remove exactly the files this save created; release the lock; a
                 destination directory the save created is removed again if it is empty

A crash at any instant leaves the old checkpoint (its ``.metadata`` names only its own shards,
which are removed only after the new ``.metadata`` is in place) or the new one, never a mix. The
manifest is renamed right after the marker; a crash in between leaves the new checkpoint beside
the old manifest, which ``verify`` recognises as stale by its save id (not as corruption).
Sharded Hugging Face directories have fixed shard names: between the first shard's rename and the
index's, the directory holds new shards beside the old index (a short, documented window).

Leftovers: each save writes an owner file (host, pid, process start time, save id). The next save
to the same destination removes the files of a save whose owner is gone (dead pid on this host),
with a warning; ``inspect`` lists them.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import socket
import time
import uuid
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parallel_dcp.errors import (
    CheckpointExistsError,
    CorruptCheckpointError,
    DestinationBusyError,
    InsufficientSpaceError,
    InvalidDestinationError,
)
from parallel_dcp.storage.location import Location, Remote, check_name

__all__ = [
    "DCP_LAYOUT",
    "LOCK_FILE",
    "Layout",
    "LocalDirStaging",
    "LocalFileStaging",
    "RemoteFileStaging",
    "RemoteStaging",
    "Staging",
    "WriteLocation",
    "find_leftovers",
    "is_checkpoint",
    "stage_directory",
    "stage_file",
]

METADATA_FILE = ".metadata"
MANIFEST_FILE = ".parallel_dcp.json"
LOCK_FILE = ".parallel_dcp.lock"
_OWNER_PREFIX = ".parallel_dcp.owner."
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def new_save_id() -> str:
    return uuid.uuid4().hex[:12]


def temp_name(name: str, save_id: str) -> str:
    """The hidden name a file of this save is written under before its rename into ``name``."""
    return f".{name}.{save_id}.tmp"


def is_of_save(name: str, save_id: str) -> bool:
    """True for the names a save with this id writes (shards, temporary files, its owner file)."""
    return (
        (name.startswith("__") and f"_{save_id}_" in name and name.endswith(".distcp"))
        or (name.startswith(".") and name.endswith(f".{save_id}.tmp"))
        or name == owner_name(save_id)
    )


def owner_name(save_id: str) -> str:
    return f"{_OWNER_PREFIX}{save_id}"


@dataclass(frozen=True, slots=True)
class WriteLocation:
    """Where workers write (plain data: it travels to workers and to the ranks of a distributed job).

    ``root`` is the destination directory (or, for a single file, its parent). ``private``: files
    with fixed names are written under a hidden temporary name and renamed at the commit.
    """

    root: Path | Remote
    save_id: str
    private: bool

    def file(self, name: str) -> Path | Remote:
        return self.root / (temp_name(name, self.save_id) if self.private else name)


@dataclass(frozen=True, slots=True)
class Layout:
    """How a checkpoint directory of one format looks: what marks it, and what it owns."""

    name: str
    markers: tuple[str, ...]
    owned_names: Callable[[Location, list[str]], set[str]]
    fixed_names: bool

    def holds_checkpoint(self, where: Location, names: list[str] | None = None) -> bool:
        names = _names(where) if names is None else names
        return any(marker in names for marker in self.markers)

    def owned(self, where: Location) -> set[str]:
        """The files the checkpoint at ``where`` owns (empty when there is none); each a plain name."""
        names = _names(where)
        if not self.holds_checkpoint(where, names):
            return set()
        return {check_name(n, where) for n in self.owned_names(where, names)}


def _dcp_owned(where: Location, names: list[str]) -> set[str]:
    from parallel_dcp.storage.metadata import read_metadata  # metadata_io reads through this module's names

    metadata = read_metadata(where)
    shards = {str(info.relative_path) for info in (metadata.storage_data or {}).values()}
    return {METADATA_FILE, *shards, *([MANIFEST_FILE] if MANIFEST_FILE in names else [])}


DCP_LAYOUT = Layout("DCP checkpoint", (METADATA_FILE,), _dcp_owned, fixed_names=False)


def sharded_layout(kind: str, index_name: str, single: str) -> Layout:
    """The layout of a Hugging Face style directory: ``index_name`` names its shards."""

    def owned(where: Location, names: list[str]) -> set[str]:
        found = {n for n in (index_name, single, MANIFEST_FILE) if n in names}
        if index_name in names:
            try:
                shards = json.loads((where / index_name).read_bytes())["weight_map"].values()
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CorruptCheckpointError(f"{where / index_name} is not a readable index: {exc}") from exc
            found |= {check_name(n, where / index_name) for n in shards}
        return found

    return Layout(f"{kind} checkpoint directory", (index_name, single), owned, fixed_names=True)


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a directory holding a committed DCP checkpoint (``.metadata``)."""
    return Path(path, METADATA_FILE).is_file()


# --- small helpers over a local Path or a Remote -------------------------------------------------


def _names(where: Location) -> list[str]:
    if isinstance(where, Remote):
        return where.listdir()
    return sorted(os.listdir(where)) if where.is_dir() else []


def _remove(where: Location) -> None:
    if isinstance(where, Remote):
        where.remove()
    else:
        with contextlib.suppress(FileNotFoundError):
            if where.is_dir() and not where.is_symlink():
                return  # never a directory: a checkpoint's files are plain files
            where.unlink()


def _process_start(pid: int) -> float | None:
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def owner_record(save_id: str, destination: Location) -> dict[str, Any]:
    """Who writes: enough for a later save to tell whether this one is still running."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "start": _process_start(os.getpid()),
        "save_id": save_id,
        "destination": os.fspath(destination),
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _owner_alive(record: Mapping[str, Any]) -> bool | None:
    """True/False for an owner on this host; None when it ran elsewhere (it cannot be told)."""
    if record.get("host") != socket.gethostname():
        return None
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    start = _process_start(pid)
    return start is not None and (record.get("start") is None or abs(start - float(record["start"])) < 1.0)


def find_leftovers(where: Location, names: list[str] | None = None) -> list[dict[str, Any]]:
    """The saves that left files at ``where``: owner, whether it still runs, and its files.

    Files named by the committed checkpoint are never listed, whatever their name.
    """
    names = _names(where) if names is None else names
    live: set[str] = set()
    if METADATA_FILE in names:
        with contextlib.suppress(Exception):  # a damaged .metadata protects nothing, and is reported elsewhere
            live = DCP_LAYOUT.owned(where)
    found = []
    for name in names:
        if not name.startswith(_OWNER_PREFIX):
            continue
        save_id = name[len(_OWNER_PREFIX) :]
        try:
            record = json.loads((where / name).read_bytes())
            if not isinstance(record, dict):
                raise ValueError("not an object")
        except (ValueError, OSError):
            record = {"save_id": save_id}
        files = [n for n in names if is_of_save(n, save_id) and n not in live]
        replaces = record.get("replaces")
        if isinstance(replaces, list):  # a save killed after its commit: the old checkpoint's shards
            for old in replaces:
                if isinstance(old, str) and old in names and old not in live and old not in files:
                    with contextlib.suppress(CorruptCheckpointError):
                        files.append(check_name(old, where))
        if MANIFEST_FILE in names and MANIFEST_FILE not in live and _manifest_save_id(where) == save_id:
            files.append(MANIFEST_FILE)  # killed between the manifest and .metadata of a new checkpoint
        found.append(
            {
                "save_id": save_id,
                "host": record.get("host"),
                "pid": record.get("pid"),
                "running": _owner_alive(record),
                "files": sorted(files),
            }
        )
    return found


def _manifest_save_id(where: Location) -> str | None:
    try:
        value = json.loads((where / MANIFEST_FILE).read_bytes()).get("save_id")
    except (ValueError, OSError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _clean_leftovers(where: Location) -> None:
    """Remove the files of saves to ``where`` whose owner process is gone (one warning each)."""
    for leftover in find_leftovers(where):
        if leftover["running"] is not False:
            continue
        for name in leftover["files"]:
            _remove(where / name)
        _remove(where / owner_name(leftover["save_id"]))
        warnings.warn(
            f"{where}: removed {len(leftover['files'])} leftover files of save {leftover['save_id']} "
            f"(pid {leftover['pid']} on {leftover['host']}, no longer running)",
            stacklevel=4,
        )


def _protect(where: Location, names: Iterable[str], protect: Sequence[str]) -> None:
    """Refuse to replace or delete a file that is one of the job's source files."""
    if isinstance(where, Remote):
        urls = {p.rstrip("/") for p in protect}
        for name in names:
            if (where / name).url.rstrip("/") in urls:
                raise InvalidDestinationError(f"refusing to replace {where / name}: it is a file of the source")
        return
    sources: set[tuple[int, int]] = set()
    for p in protect:  # by inode: a link or another spelling of the same file is the same file
        with contextlib.suppress(OSError):
            st = os.stat(p)
            sources.add((st.st_dev, st.st_ino))
    for name in names:
        try:
            st = os.stat(where / name)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in sources:
            raise InvalidDestinationError(f"refusing to replace or delete {where / name}: it is a file of the source")


# --- the protocol ----------------------------------------------------------------------------


def stage_directory(where: Path | Remote, *, overwrite: bool, layout: Layout, protect: Sequence[str] = ()) -> Staging:
    """Take hold of a checkpoint directory (a local path or a prefix on object storage)."""
    if isinstance(where, Remote):
        return RemoteStaging(where, overwrite=overwrite, layout=layout, protect=protect)
    return LocalDirStaging(where, overwrite=overwrite, layout=layout, protect=protect)


def stage_file(where: Path | Remote, *, overwrite: bool, protect: Sequence[str] = ()) -> Staging:
    """Take hold of a single-file output (a local path or an object)."""
    if isinstance(where, Remote):
        return RemoteFileStaging(where, overwrite=overwrite, protect=protect)
    return LocalFileStaging(where, overwrite=overwrite, protect=protect)


class Staging(ABC):
    """One save's hold on its destination; see the module docstring for the protocol.

    Raises (on creation, before any write):
        CheckpointExistsError: a checkpoint is there and ``overwrite`` is False.
        DestinationBusyError: another save holds the destination's lock (local destinations).
        InvalidDestinationError: a file where a directory is wanted (or the reverse), a
            non-empty directory that is not a checkpoint of this kind, a missing or unwritable
            parent, an unreachable bucket.
    """

    destination: Path | Remote
    location: WriteLocation
    save_id: str

    @property
    def path(self) -> Path | Remote:
        """The directory (or file) workers write into."""
        return self.location.root

    @abstractmethod
    def check_space(self, nbytes: int) -> None:
        """Fail before writing if the destination cannot hold ``nbytes`` more."""

    @abstractmethod
    def expect(self, names: Iterable[str]) -> None:
        """Note the fixed names this save will create (for :meth:`discard` on object storage)."""

    @abstractmethod
    def commit(
        self,
        *,
        staged: Sequence[str] = (),
        marker: tuple[str, bytes] | None = None,
        extras: Mapping[str, bytes] | None = None,
    ) -> None:
        """Publish ``staged`` files under their names, then ``marker`` (the commit), then ``extras``."""

    @abstractmethod
    def publish(self) -> None:
        """After the commit: remove what the replaced checkpoint owned; release the destination."""

    @abstractmethod
    def discard(self) -> None:
        """On failure: remove exactly what this save created; release the destination."""


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
            _clean_leftovers(self._dir)
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
        _protect(self._dir, old | new, self.protect)
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
                _remove(self._dir / name)
            _remove(self._dir / owner_name(self.save_id))
            _fsync_dir(self._dir)
        finally:
            self._release()

    def discard(self) -> None:
        try:
            if self._committed:
                with contextlib.suppress(OSError):  # committed: only our temporary files can remain
                    for name in _names(self._dir):
                        if name.startswith(".") and name.endswith(f".{self.save_id}.tmp"):
                            _remove(self._dir / name)
                return
            with contextlib.suppress(OSError):
                for name in _names(self._dir):
                    if is_of_save(name, self.save_id) or name in self._created:
                        _remove(self._dir / name)
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
                pass  # another process made it: the lock decides who writes
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
        names = [n for n in _names(self._dir) if n != LOCK_FILE]
        if self.layout.holds_checkpoint(self._dir, names):
            if not self.overwrite:
                raise CheckpointExistsError(
                    f"{self._dir} already holds a checkpoint; pass overwrite=True (--overwrite) to replace it"
                )
            _protect(self._dir, self.layout.owned(self._dir), self.protect)
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
            _protect(self._dir, [self.destination.name], self.protect)

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


@dataclass
class RemoteStaging(Staging):
    """A checkpoint prefix on object storage, written in place (there is no rename, and no lock).

    DCP shards carry the save id, so a failed overwrite leaves the old checkpoint as it was;
    layouts with fixed shard names (Hugging Face directories) refuse to overwrite here instead.
    A failure deletes only names this save created: those carrying its id, the fixed names it
    expected that did not exist when it started, and what it uploaded itself.
    """

    destination: Remote
    overwrite: bool
    layout: Layout
    protect: Sequence[str] = ()
    save_id: str = field(default_factory=new_save_id)
    _existing: set[str] = field(default_factory=set)
    _expected: set[str] = field(default_factory=set)
    _uploaded: list[str] = field(default_factory=list)
    _replaced: set[str] = field(default_factory=set)
    _committed: bool = False

    def __post_init__(self) -> None:
        _check_bucket(self.destination)
        if self.destination.is_file():
            raise InvalidDestinationError(
                f"cannot write a checkpoint to {self.destination}: it is an object, not a prefix"
            )
        _clean_leftovers(self.destination)
        names = self.destination.listdir()
        holds = self.layout.holds_checkpoint(self.destination, names)
        if holds and not self.overwrite:
            raise CheckpointExistsError(
                f"{self.destination} already holds a checkpoint; pass overwrite=True (--overwrite) to replace it"
            )
        if names and not holds:
            raise InvalidDestinationError(
                f"{self.destination} holds objects that are not a {self.layout.name} ({', '.join(names[:5])}); "
                "refusing to write into it (choose an empty or new prefix)"
            )
        if holds and self.layout.fixed_names:
            raise InvalidDestinationError(
                f"cannot overwrite the {self.layout.name} at {self.destination}: on object storage its shards "
                "would be replaced in place, so a failure would leave neither checkpoint; delete it first or "
                "write to a new prefix"
            )
        self._existing = set(names)
        self.location = WriteLocation(self.destination, self.save_id, private=False)
        record = owner_record(self.save_id, self.destination)
        self._put(owner_name(self.save_id), json.dumps(record).encode())

    def _put(self, name: str, data: bytes) -> None:
        self._uploaded.append(name)
        (self.destination / name).write_bytes(data)

    def check_space(self, nbytes: int) -> None:
        """Object storage has no free-space figure to check."""

    def expect(self, names: Iterable[str]) -> None:
        self._expected |= {n for n in names if n not in self._existing}

    def commit(
        self,
        *,
        staged: Sequence[str] = (),
        marker: tuple[str, bytes] | None = None,
        extras: Mapping[str, bytes] | None = None,
    ) -> None:
        """Uploaded shards are in place already; upload the marker (the commit), then the rest."""
        extras = dict(extras or {})
        if marker is not None and not self.overwrite and (self.destination / marker[0]).exists():
            raise CheckpointExistsError(f"{self.destination / marker[0]} appeared while this save ran; not replaced")
        old = self.layout.owned(self.destination) if self.overwrite else set()
        new = {*staged, *([marker[0]] if marker else []), *extras}
        _protect(self.destination, old | new, self.protect)
        if marker is not None:
            self._put(*marker)
        self._committed = True
        for name, data in extras.items():
            self._put(name, data)
        self._replaced = old - new

    def publish(self) -> None:
        if not self._committed:
            raise RuntimeError(f"nothing was committed to {self.destination}")
        try:
            self.destination.remove_all([*sorted(self._replaced), owner_name(self.save_id)])
        except Exception as exc:  # the new checkpoint is committed: leftovers only cost space
            warnings.warn(f"{self.destination}: could not delete the replaced files: {exc}", stacklevel=2)

    def discard(self) -> None:
        mine = self._mine
        with contextlib.suppress(Exception):  # best effort: cleanup must not hide the real failure
            if self._committed:
                self.destination.remove_all([owner_name(self.save_id)])
                return
            self.destination.remove_all(n for n in self.destination.listdir() if mine(n))
        _abort_uploads(self.destination, mine)

    def _mine(self, name: str) -> bool:
        return is_of_save(name, self.save_id) or name in self._expected or name in self._uploaded


@dataclass
class RemoteFileStaging(Staging):
    """A single-file output on object storage. It is uploaded straight to its name: an object
    appears only when its (multipart) upload completes, so readers see the old one or the new.
    """

    destination: Remote
    overwrite: bool
    protect: Sequence[str] = ()
    save_id: str = field(default_factory=new_save_id)

    def __post_init__(self) -> None:
        _check_bucket(self.destination)
        if self.destination.is_dir():
            raise InvalidDestinationError(f"cannot write the file {self.destination}: it is a prefix holding objects")
        if self.destination.exists() and not self.overwrite:
            raise CheckpointExistsError(
                f"{self.destination} already exists; pass overwrite=True (--overwrite) to replace it"
            )
        _protect(self.destination.parent, [self.destination.name], self.protect)
        self.location = WriteLocation(self.destination.parent, self.save_id, private=False)

    def check_space(self, nbytes: int) -> None:
        """Object storage has no free-space figure to check."""

    def expect(self, names: Iterable[str]) -> None:
        """The one name is the destination's."""

    def commit(
        self,
        *,
        staged: Sequence[str] = (),
        marker: tuple[str, bytes] | None = None,
        extras: Mapping[str, bytes] | None = None,
    ) -> None:
        """The completed upload was the commit."""

    def publish(self) -> None:
        """Nothing to remove: the upload replaced the object."""

    def discard(self) -> None:
        _abort_uploads(self.destination.parent, lambda name: name == self.destination.name)
