"""Staging on object storage: a prefix (DCP or sharded) or a single object.

There is no rename and no lock: a save writes beside what it replaces under names carrying its
save id, uploads the marker last (the commit), and on failure deletes only the names it created
and aborts its unfinished multipart uploads. See :mod:`parallel_dcp.storage.staging`."""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from parallel_dcp.errors import (
    CheckpointExistsError,
    InvalidDestinationError,
)
from parallel_dcp.storage.location import Remote
from parallel_dcp.storage.ownership import (
    Layout,
    clean_leftovers,
    is_of_save,
    new_save_id,
    owner_name,
    owner_record,
    protect_sources,
)
from parallel_dcp.storage.protocol import Staging, WriteLocation
from parallel_dcp.storage.safe_files import FileData

__all__ = [
    "RemoteFileStaging",
    "RemoteStaging",
]


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
    try:
        uploads = fs.list_multipart_uploads(bucket)
    except Exception:  # best effort: cleanup must not hide the real failure
        return
    for upload in uploads:
        name = str(upload.get("Key", ""))
        if name.startswith(prefix) and "/" not in name[len(prefix) :] and mine(name[len(prefix) :]):
            # Each on its own: one that completed meanwhile (NoSuchUpload) leaves the others to abort.
            with contextlib.suppress(Exception):
                fs.abort_mpu(bucket, name, upload["UploadId"])


@dataclass
class RemoteStaging(Staging):
    """A checkpoint prefix on object storage, written in place (there is no rename, and no lock).

    DCP shards carry the save id, so a failed overwrite leaves the old checkpoint as it was;
    layouts with fixed shard names (Hugging Face directories) refuse to overwrite here instead.
    A failure deletes only names this save created: those carrying its id, the fixed names it
    expected that did not exist when it started, and what it uploaded itself (recorded only once
    the upload completed); never a name that was there when it started.
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
        clean_leftovers(self.destination)
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

    def _put(self, name: str, data: FileData) -> None:
        pieces = [data] if isinstance(data, bytes | bytearray | memoryview) else data
        whole = data if isinstance(data, bytes) else b"".join(pieces)  # one upload of the whole
        (self.destination / name).write_bytes(whole)
        # Recorded once the upload completed: an upload that failed replaced nothing (object
        # storage keeps the old object), so a name that existed stays the old checkpoint's.
        self._uploaded.append(name)

    def check_space(self, nbytes: int) -> None:
        """Object storage has no free-space figure to check."""

    def expect(self, names: Iterable[str]) -> None:
        self._expected |= {n for n in names if n not in self._existing}

    def commit(
        self,
        *,
        staged: Sequence[str] = (),
        marker: tuple[str, FileData] | None = None,
        extras: Mapping[str, bytes] | None = None,
    ) -> None:
        """Uploaded shards are in place already; upload the marker (the commit), then the rest."""
        extras = dict(extras or {})
        if marker is not None and not self.overwrite and (self.destination / marker[0]).exists():
            raise CheckpointExistsError(f"{self.destination / marker[0]} appeared while this save ran; not replaced")
        old = self.layout.owned(self.destination) if self.overwrite else set()
        new = {*staged, *([marker[0]] if marker else []), *extras}
        protect_sources(self.destination, old | new, self.protect)
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
        if self._committed:
            with contextlib.suppress(Exception):  # best effort: cleanup must not hide the real failure
                self.destination.remove_all([owner_name(self.save_id)])
            return
        # The unfinished uploads first, then the objects: a killed worker's last request (its
        # upload's completion, sent before it died) may reach the server after the workers were
        # reaped. Aborted first, its upload either completed before the abort, and is listed and
        # deleted below, or fails to complete. Listed first, an object that completed between the
        # listing and the abort was left behind (a shard of the save beside the old checkpoint).
        _abort_uploads(self.destination, mine)
        with contextlib.suppress(Exception):
            self.destination.remove_all(n for n in self.destination.listdir() if mine(n))

    def _mine(self, name: str) -> bool:
        if name in self._existing and not is_of_save(name, self.save_id):
            return False  # there before this save: the replaced checkpoint's, never this save's to delete
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
    # Objects beside it that belong to it (its sidecar manifest), uploaded after it at the commit.
    companions: Sequence[str] = ()

    def __post_init__(self) -> None:
        _check_bucket(self.destination)
        if self.destination.is_dir():
            raise InvalidDestinationError(f"cannot write the file {self.destination}: it is a prefix holding objects")
        for name in [self.destination.name, *self.companions]:
            if (self.destination.parent / name).exists() and not self.overwrite:
                raise CheckpointExistsError(
                    f"{self.destination.parent / name} already exists; pass overwrite=True (--overwrite) to replace it"
                )
        protect_sources(self.destination.parent, [self.destination.name, *self.companions], self.protect)
        self.location = WriteLocation(self.destination.parent, self.save_id, private=False)

    def check_space(self, nbytes: int) -> None:
        """Object storage has no free-space figure to check."""

    def expect(self, names: Iterable[str]) -> None:
        """The one name is the destination's."""

    def commit(
        self,
        *,
        staged: Sequence[str] = (),
        marker: tuple[str, FileData] | None = None,
        extras: Mapping[str, bytes] | None = None,
    ) -> None:
        """The completed upload was the commit; its sidecar manifest follows it."""
        for name, data in (extras or {}).items():
            (self.destination.parent / name).write_bytes(data)

    def publish(self) -> None:
        """Nothing to remove: the upload replaced the object."""

    def discard(self) -> None:
        _abort_uploads(self.destination.parent, lambda name: name == self.destination.name)
