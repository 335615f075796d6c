"""What a conversion leaves behind so that ``resume=True`` can finish it: sealed, durable records.

In the destination, beside the files of the save (all named with its save id, so leftovers
cleanup and ``discard`` treat them as the save's own)::

    .parallel_dcp.job.<save id>          the job: what it converts (its identity) and its plan
    .parallel_dcp.done.<save id>.<task>  one per finished task: its files' names, sizes, xxh3

Each record is a JSON document with a ``seal``: the xxh3-64 of the document's canonical JSON
without it. A record is written to a temporary name, fsynced, renamed, and its directory fsynced,
so after a crash it is either whole or absent; one that fails its seal, or does not parse, is
ignored (its task is redone). A record is a claim, never proof: on resume every file a record
names is hashed again and compared, and every name in it must be a plain name inside the
destination (refused otherwise: a record may be hostile). A record and the files it names count
only when this user wrote them (:func:`~parallel_dcp.storage.layout.written_by_us`).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from parallel_dcp._json import loads_json
from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.storage.layout import is_ours, written_by_us
from parallel_dcp.storage.location import check_name
from parallel_dcp.storage.manifest import ALGORITHM, FileDigest
from parallel_dcp.storage.ownership import DONE_PREFIX, JOB_PREFIX
from parallel_dcp.storage.safe_files import (
    open_directory,
    open_regular,
    remove_name,
    rename_name,
    sync_directory,
    write_new,
)

__all__ = [
    "DONE_PREFIX",
    "JOB_PREFIX",
    "RECORD_VERSION",
    "IdentityCheck",
    "digest_entry",
    "digest_of",
    "done_name",
    "job_name",
    "read_job_record",
    "read_sealed",
    "remove_record",
    "verify_file",
    "write_job_record",
    "write_sealed",
]

RECORD_VERSION = 1
# A record larger than this is not one we wrote (a task's record holds a few hundred bytes a key).
_MAX_RECORD_BYTES = 256 * 2**20
_MAX_SIZE = 2**62
# Each re-hashing thread's read buffer (jobs/resume.py runs 4): 4 MiB in all, not 32, before any
# worker starts under the limit.
_CHUNK = 2**20


def job_name(save_id: str) -> str:
    return f"{JOB_PREFIX}{save_id}"


def done_name(save_id: str, task: int) -> str:
    return f"{DONE_PREFIX}{save_id}.{task}"


def _canonical(document: dict[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _seal(document: dict[str, Any]) -> str:
    return xxhash.xxh3_64_hexdigest(_canonical(document))


def write_sealed(directory: Path, name: str, document: dict[str, Any]) -> None:
    """Write ``document`` with its seal as ``directory/name``, durably: the file is created new
    (never written through a name someone planted), fsynced before its rename into place, the
    directory after (so a record is whole or absent after a crash)."""
    data = _canonical(document | {"seal": _seal(document)})
    fd = open_directory(directory)
    try:
        temporary = f"{name}.tmp"
        remove_name(fd, temporary)  # a stale one (a task redone), or a planted symlink: unlinked itself
        write_new(fd, temporary, data)
        rename_name(fd, temporary, name, replace=True)
        sync_directory(fd)
    finally:
        os.close(fd)


def read_sealed(directory: Path, name: str) -> dict[str, Any] | None:
    """The document in ``directory/name`` if it is a regular file whose seal matches; else None."""
    try:
        fd = open_regular(None, directory / check_name(name, directory))  # a FIFO planted there never blocks
    except (OSError, CorruptCheckpointError):
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_RECORD_BYTES:
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(_MAX_RECORD_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        document = loads_json(data)
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    seal = document.pop("seal", None)
    if not isinstance(seal, str) or seal != _seal(document):
        return None
    return document


def remove_record(directory: Path, name: str) -> None:
    """Remove a record or a file it names, if this user's (another user's is left as it is)."""
    path = directory / check_name(name, directory)
    with contextlib.suppress(FileNotFoundError):
        if written_by_us(path):
            os.unlink(path)


def digest_of(entry: object) -> FileDigest | None:
    """A record's ``{"size": n, "xxh3_64": hex}`` entry, or None when it is not one (or has no checksum)."""
    if not isinstance(entry, dict):
        return None
    size, digest = entry.get("size"), entry.get(ALGORITHM)
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= _MAX_SIZE:
        return None
    if not isinstance(digest, str) or len(digest) != 16 or any(c not in "0123456789abcdef" for c in digest):
        return None
    return FileDigest(size, digest)


def digest_entry(digest: FileDigest) -> dict[str, Any]:
    return {"size": digest.size, ALGORITHM: digest.digest}


def verify_file(directory: Path, name: str, expected: FileDigest) -> bool:
    """True when ``directory/name`` is a regular file (not a link) of this user's, of ``expected``'s
    size and xxh3."""
    try:
        fd = open_regular(None, directory / check_name(name, directory))  # a FIFO planted there never blocks
    except (OSError, CorruptCheckpointError):
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not is_ours(st) or st.st_size != expected.size:
            return False
        hasher = xxhash.xxh3_64()
        # Mapped, not from the heap: freed 8 MiB bytearrays stayed in the threads' malloc arenas,
        # and the re-hashing threads' 32 MiB were charged to the resumed job as held memory (a
        # resume under 40 MiB refused a task its fresh run had fitted).
        with mmap.mmap(-1, _CHUNK) as buffer, os.fdopen(os.dup(fd), "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                hasher.update(memoryview(buffer)[:n])
        return hasher.hexdigest() == expected.digest
    except OSError:
        return False
    finally:
        os.close(fd)


# Given a job record's ``identity``, the reasons it is not the job being run now (none: resume it).
IdentityCheck = Callable[[dict[str, Any]], list[str]]


def write_job_record(
    directory: Path,
    save_id: str,
    destination: str,
    identity: dict[str, Any],
    plan: dict[str, Any],
    destination_id: dict[str, Any] | None = None,
) -> None:
    """Record the job a save runs (before its first task), for a later ``resume=True``.

    ``destination_id`` (the staging's :meth:`~parallel_dcp.storage.protocol.Staging.destination_id`)
    is how a resume finds its output again, however the path is spelled then."""
    document = {
        "version": RECORD_VERSION,
        "save_id": save_id,
        "destination": destination,
        "identity": identity,
        "plan": plan,
    }
    if destination_id is not None:
        document["destination_id"] = destination_id
    write_sealed(directory, job_name(save_id), document)


def read_job_record(directory: Path, save_id: str) -> dict[str, Any] | None:
    """The job record of save ``save_id``: sealed, of this version and this save; else None."""
    document = read_sealed(directory, job_name(save_id))
    if document is None or document.get("version") != RECORD_VERSION or document.get("save_id") != save_id:
        return None
    if not isinstance(document.get("identity"), dict) or not isinstance(document.get("plan"), dict):
        return None
    return document
