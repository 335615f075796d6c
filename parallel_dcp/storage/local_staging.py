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
import errno
import json
import os
import stat
import warnings
from abc import abstractmethod
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from parallel_dcp._json import loads_json
from parallel_dcp.errors import (
    CheckpointExistsError,
    InsufficientSpaceError,
    InvalidDestinationError,
    ResumeError,
)
from parallel_dcp.storage.local_destination import (
    check_local_directory,
    check_local_file,
    refuse_foreign,
    why_not_writable,
)
from parallel_dcp.storage.location import check_name
from parallel_dcp.storage.lock import DestinationLock
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
    new_save_id,
    owner_name,
    owner_record,
    owner_uid,
    protect_sources,
    temp_name,
    written_by_us,
)
from parallel_dcp.storage.protocol import Staging, WriteLocation
from parallel_dcp.storage.resume import IdentityCheck, job_name, read_job_record
from parallel_dcp.storage.safe_files import (
    FileData,
    open_directory,
    read_small,
    remove_name,
    rename_name,
    replace_new,
    sync_directory,
    write_new,
)
from parallel_dcp.storage.side_index import INDEX_FILE
from parallel_dcp.storage.side_trees import is_directory, merge_tree, remove_tree, split_trees, write_tree

__all__ = [
    "LocalDirStaging",
    "LocalFileStaging",
    "free_bytes",
]


def _manifest_save_id(directory: Path) -> str | None:
    """The save id in the destination's manifest (that save committed: nothing to resume)."""
    try:
        value = loads_json(read_small(directory / MANIFEST_FILE, 64 * 2**20)).get("save_id")
    except (ValueError, OSError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _owned_by(path: Path) -> str:
    """Whose ``path`` is, said for a refusal: ``belongs to uid 1001, not to you (uid 1000)``."""
    return f"belongs to uid {owner_uid(path)}, not to you (uid {os.geteuid()})"


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
        # Every file this save creates, renames or removes is named relative to this descriptor
        # (see parallel_dcp.storage.safe_files): no name in the directory is ever followed.
        self._fd: int | None = _open_destination(directory)
        self._committed = False
        self._created: list[str] = []  # names this save published with no-replace renames
        self._replaced: set[str] = set()
        self._record = owner_record(self.save_id, destination)
        try:
            self._lock = DestinationLock(self._fd, lock, self._record, destination)
        except BaseException:
            self._close()
            raise

    def _start(self) -> None:
        try:
            adopted = self._adopt() if self._resume is not None else None
            clean_leftovers(self._dir, keep=adopted, destination=self.destination)
            self._check()
            owner = owner_name(self.save_id)
            if adopted is not None:  # the dead save's owner record becomes this process's
                replace_new(self.fd, owner, json.dumps(self._record).encode())
            else:
                write_new(self.fd, owner, json.dumps(self._record).encode())
        except BaseException:
            self._release()
            raise

    def _adopt(self) -> str | None:
        """Under the lock: take over the files of a dead conversion to this destination whose job
        record matches (``resume=True``); its save id becomes this save's. None when there is none.

        Only this user's records are adopted (:func:`~parallel_dcp.storage.layout.written_by_us`):
        another user's files never become this user's checkpoint.

        Raises:
            ResumeError: there is a dead conversion to this destination, but of another job, or
                another user's (nothing is removed: the user decides).
        """
        assert self._resume is not None
        committed = _manifest_save_id(self._dir)
        refused: list[tuple[str, list[str], int | str | None]] = []  # save id, reasons, another user's uid
        for leftover in find_leftovers(self._dir):
            save_id: str = leftover["save_id"]
            if leftover["running"] is not False or not leftover["resumable"] or save_id == committed:
                continue
            record = read_job_record(self._dir, save_id)
            if record is None:
                refused.append((save_id, ["its job record is damaged (it fails its checksum)"], None))
                continue
            if not self._same_output(record):
                continue  # a neighbouring single-file output in the same directory
            mine = (owner_name(save_id), job_name(save_id), *leftover["files"])
            theirs = [n for n in mine if not written_by_us(self._dir / n)]
            if theirs:
                uid = owner_uid(self._dir / theirs[0])
                refused.append((save_id, [f"{self._dir / theirs[0]} {_owned_by(self._dir / theirs[0])}"], uid))
                continue
            reasons = self._resume(record["identity"])
            if reasons:
                refused.append((save_id, reasons, None))
                continue
            self.save_id = save_id
            self._record = owner_record(save_id, self.destination)
            self.location = WriteLocation(self.location.root, save_id, private=True)
            self.resumed = record
            return save_id
        if refused:
            save_id, reasons, other = refused[0]
            raise ResumeError(
                f"cannot resume the conversion to {self.destination} (save {save_id}): "
                + "; ".join(reasons)
                + (
                    ". Another user's records and files are never adopted nor removed, so only their owner can "
                    f"clear this: convert to another destination, or have uid {other} resume that conversion or "
                    "remove its files, then run again"
                    if other is not None
                    else ". Run again with the arguments it had, or without resume to start over (its files are "
                    "then removed)"
                ),
                reasons=reasons,
            )
        return None

    @abstractmethod
    def _check(self) -> None:
        """Check the destination (under the lock)."""

    @abstractmethod
    def _owned(self) -> set[str]:
        """The files of the checkpoint this save would replace."""

    @property
    def fd(self) -> int:
        """The destination directory's descriptor (open from the start to the release)."""
        if self._fd is None:
            raise RuntimeError(f"{self.destination} was released already")
        return self._fd

    def _release(self) -> None:
        try:
            self._lock.release()
        finally:
            self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _remove(self, name: str) -> None:
        if is_directory(self.fd, name):  # a copied folder of this save (never followed if a link)
            remove_tree(self.fd, name)
        else:
            remove_name(self.fd, name)

    def _names(self) -> list[str]:
        """The names in the destination directory (the one this save holds open, whatever its path
        now resolves to)."""
        return sorted(os.listdir(self.fd))

    def _output_name(self) -> str | None:
        """The output's name in the directory (a single file's), or None for the directory itself."""
        return None

    def destination_id(self) -> dict[str, Any]:
        """Which output this is, independent of how its path is spelled: the directory's device and
        inode, and the output's name in it (None: the directory itself)."""
        st = os.fstat(self.fd)
        return {"device": st.st_dev, "inode": st.st_ino, "name": self._output_name()}

    def _same_output(self, record: Mapping[str, Any]) -> bool:
        """True when a job record found in this directory is of this output: by device, inode and
        name when the record has them, else by where its destination path leads now (a symlinked
        parent or another spelling is the same directory)."""
        recorded = record.get("destination_id")
        if isinstance(recorded, dict):
            return recorded == self.destination_id()
        spelled = record.get("destination")
        if not isinstance(spelled, str):
            return False
        try:
            if self._output_name() is None:
                return os.path.samefile(spelled, self._dir)
            return Path(spelled).name == self._output_name() and os.path.samefile(Path(spelled).parent, self._dir)
        except OSError:
            return False

    def check_space(self, nbytes: int) -> None:
        _check_space(self._dir, self.destination, nbytes)

    def expect(self, names: Iterable[str]) -> None:
        """Local files carry this save's id until their rename: nothing to note."""

    def commit(
        self,
        *,
        staged: Sequence[str] = (),
        marker: tuple[str, FileData] | None = None,
        extras: Mapping[str, bytes] | None = None,
    ) -> None:
        # Folders copied beside the files (names with a "/") are written whole under a temporary
        # name and renamed into place with the other extras (see storage.side_trees).
        extras, trees = split_trees(extras or {})
        small: dict[str, FileData] = ({marker[0]: marker[1]} if marker else {}) | dict(extras)
        if self.resumed is not None:  # a save killed inside its commit left these (its own id): made anew
            for name in [*small, *trees]:
                self._remove(temp_name(name, self.save_id))
        for name, data in small.items():
            write_new(self.fd, temp_name(name, self.save_id), data)
        for name, files in trees.items():
            write_tree(self.fd, temp_name(name, self.save_id), files)
        old = self._owned() if self.overwrite else set()
        new = {*staged, *small, *trees}
        # (a copied folder's files too: each replaces its namesake in a folder already there)
        protect_sources(self._dir, old | new | {f"{t}/{p}" for t, files in trees.items() for p in files}, self.protect)
        if old:  # a save killed after its commit leaves these to the next save's cleanup
            record = self._record | {"replaces": sorted(old - new)}
            owner = owner_name(self.save_id)
            write_new(self.fd, temp_name(owner, self.save_id), json.dumps(record).encode())
            rename_name(self.fd, temp_name(owner, self.save_id), owner, replace=True)
        # The side index before the marker: a committed checkpoint has the index written with its
        # .metadata or none (an old one left by an overwrite no longer matches its hash).
        early = [INDEX_FILE] if INDEX_FILE in extras else []
        # The commit point: the marker's rename, or (no marker) the last staged file's.
        for name in [*staged, *early, *([marker[0]] if marker else [])]:
            self._rename_into_place(name)
        self._committed = True
        # The manifest last: a save killed before its rename has no manifest saying it is whole
        # (so a manifest present means the copied folders are in place too).
        for name in extras:
            if name not in (MANIFEST_FILE, INDEX_FILE):
                self._rename_into_place(name)
        for name in trees:
            self._tree_into_place(name)
        if MANIFEST_FILE in extras:
            self._rename_into_place(MANIFEST_FILE)
        self._replaced = old - new
        sync_directory(self.fd)

    def _tree_into_place(self, name: str) -> None:
        """Rename a copied folder into place. With overwrite, into a folder already there file by
        file: each copied file replaces its namesake, and the folder's other files are kept
        (they are no checkpoint's: a release's ``original/consolidated.00.pth``)."""
        if self.overwrite and is_directory(self.fd, name):
            merge_tree(self.fd, temp_name(name, self.save_id), name)
            return
        if self.overwrite:
            remove_name(self.fd, name)  # a file or a symlink there: removed itself, never followed
        rename_name(self.fd, temp_name(name, self.save_id), name, replace=False)
        if not self.overwrite:
            self._created.append(name)

    def _rename_into_place(self, name: str) -> None:
        rename_name(self.fd, temp_name(name, self.save_id), name, replace=self.overwrite)
        if not self.overwrite:
            self._created.append(name)

    def publish(self) -> None:
        if not self._committed:
            raise RuntimeError(f"nothing was committed to {self.destination}")
        if self._fd is None:
            return  # published already
        try:
            for name in sorted(self._replaced):
                self._remove(name)
            for name in self._names():  # the records kept for resume, before the owner file
                if is_of_save(name, self.save_id) and name.startswith((JOB_PREFIX, DONE_PREFIX)):
                    self._remove(name)
            self._remove(owner_name(self.save_id))
            sync_directory(self.fd)
        finally:
            self._release()

    def discard_keeping(self, keep: Collection[str]) -> None:
        if self._committed or not keep:
            self.discard()
            return
        if self._fd is None:
            return  # released already
        try:
            with contextlib.suppress(OSError):
                keep = {*keep, owner_name(self.save_id)}
                for name in self._names():
                    if (is_of_save(name, self.save_id) or name in self._created) and name not in keep:
                        self._remove(name)
                # Marked stopped (no pid): the next save to this destination resumes or removes them,
                # also from this same process.
                record = self._record | {"pid": None, "start": None, "stopped": True}
                replace_new(self.fd, owner_name(self.save_id), json.dumps(record).encode())
        finally:
            self._release()

    def discard(self) -> None:
        if self._fd is None:
            return  # released already
        try:
            if self._committed:
                with contextlib.suppress(OSError):  # committed: only our temporary files can remain
                    for name in self._names():
                        if name.startswith(".") and name.endswith(f".{self.save_id}.tmp"):
                            self._remove(name)
                return
            with contextlib.suppress(OSError):
                for name in self._names():
                    if is_of_save(name, self.save_id) or name in self._created:
                        self._remove(name)
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
        check_local_directory(dest)
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
            raise InvalidDestinationError(f"cannot write {dest}: {why_not_writable(dest, 'the directory')}")
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
        names = [n for n in self._names() if n != LOCK_FILE and not (mine and is_of_save(n, mine))]
        if self.layout.holds_checkpoint(self._dir, names):
            if not self.overwrite:
                raise CheckpointExistsError(
                    f"{self._dir} already holds a checkpoint; pass overwrite=True (--overwrite) to replace it"
                )
            protect_sources(self._dir, self.layout.owned(self._dir), self.protect)
            check_replaceable(self._dir, [n for n in self.layout.fixed if n in names])
            kept = self.layout.kept_of_others(self._dir)
            if kept:
                warnings.warn(
                    f"{self._dir}: {len(kept)} file{'s' if len(kept) > 1 else ''} of the checkpoint being replaced "
                    f"{'are' if len(kept) > 1 else 'is'} not yours ({', '.join(kept[:3])}"
                    f"{f' and {len(kept) - 3} more' if len(kept) > 3 else ''}, or the record naming them is "
                    "another user's): kept beside the new checkpoint, never deleted on another user's behalf; "
                    "their owner (or root) can remove them",
                    stacklevel=2,
                )
        else:
            refuse_foreign(self._dir, names, self.layout)

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
        companions: Sequence[str] = (),
    ) -> None:
        dest = Path(os.path.abspath(destination))
        check_local_file(dest)
        self.companions = [check_name(name, dest.parent) for name in companions]
        lock = dest.parent / f".{dest.name}.lock"
        super().__init__(
            directory=dest.parent, destination=dest, lock=lock, overwrite=overwrite, protect=protect, resume=resume
        )
        self.location = WriteLocation(dest.parent, self.save_id, private=True)
        self._start()

    def _check(self) -> None:
        for name in [self.destination.name, *self.companions]:
            if os.path.lexists(self._dir / name):
                if not self.overwrite:
                    what = "" if name == self.destination.name else f" (it belongs with {self.destination.name})"
                    raise CheckpointExistsError(
                        f"{self._dir / name} already exists{what}; pass overwrite=True (--overwrite) to replace it"
                    )
                protect_sources(self._dir, [name], self.protect)
                check_replaceable(self._dir, [name])

    def _owned(self) -> set[str]:
        owned = {self.destination.name} if self.destination.exists() else set()
        return owned | {name for name in self.companions if os.path.lexists(self._dir / name)}

    def _output_name(self) -> str | None:
        return self.destination.name

    def commit(
        self,
        *,
        staged: Sequence[str] = (),
        marker: tuple[str, FileData] | None = None,
        extras: Mapping[str, bytes] | None = None,
    ) -> None:
        if self.destination.is_dir():  # re-checked: a directory may have appeared meanwhile
            raise InvalidDestinationError(f"cannot write the file {self.destination}: a directory appeared there")
        super().commit(staged=staged, marker=marker, extras=extras)


def check_replaceable(directory: Path, names: Sequence[str]) -> None:
    """Before anything is written: an overwrite can replace ``names`` in ``directory``. In a sticky
    directory (``/scratch``, ``/tmp``) that someone else owns, only a file's owner (or root) may
    rename over it or remove it: another user's checkpoint there failed at the commit, after all
    the work, with a bare "Operation not permitted".

    Raises:
        InvalidDestinationError: a name another user owns in such a directory."""
    me = os.geteuid()
    try:
        st = os.stat(directory)
    except OSError:
        return
    if me == 0 or not st.st_mode & stat.S_ISVTX or st.st_uid == me:
        return
    for name in names:
        try:
            owner = os.lstat(directory / name).st_uid
        except OSError:
            continue
        if owner != me:
            raise InvalidDestinationError(
                f"cannot replace {directory / name}: it belongs to uid {owner}, and in {directory} (a sticky "
                "directory you do not own) only a file's owner may replace it; nothing was written. Ask its owner "
                "to remove it, or write elsewhere"
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


def _open_destination(directory: Path) -> int:
    try:
        return open_directory(directory)
    except OSError as exc:
        raise InvalidDestinationError(f"cannot open the directory {directory}: {exc.strerror}") from exc


# --- object storage ------------------------------------------------------------------------------
