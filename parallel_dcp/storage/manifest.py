"""The sidecar manifest: each file's size and xxh3-64 checksum, so ``verify`` finds what DCP cannot.

DCP stores no checksums: a flipped byte in a shard loads silently. At commit, parallel_dcp writes
``.parallel_dcp.json`` beside ``.metadata`` (stock readers ignore it)::

    {"tool": "parallel_dcp", "version": "0.1.0", "created": "...", "checksum": "xxh3_64",
     "source": {"kind": ..., "path": ..., "files": {name: {"size", "mtime_ns"}}},
     "files": {"__0_0.distcp": {"size": 123, "xxh3_64": "9f..."}, ".metadata": {...}}}

Shard checksums are computed as the bytes are written (no second read); xxh3 runs at ~10 GiB/s a
core, which still costs about a tenth of a save to /dev/shm: ``checksums=False`` (``--no-checksums``)
records sizes only (truncation is still found, flipped bytes are not).
"""

from __future__ import annotations

import datetime
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any

import xxhash

from parallel_dcp._json import loads_json
from parallel_dcp._version import __version__
from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.storage.layout import read_record
from parallel_dcp.storage.location import Location, Remote, check_name, locate
from parallel_dcp.storage.ownership import MANIFEST_FILE, METADATA_FILE
from parallel_dcp.storage.safe_reader import open_bounded

__all__ = ["MANIFEST_FILE", "FileDigest", "Hasher", "file_digest", "manifest_bytes", "read_manifest"]

ALGORITHM = "xxh3_64"
_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class FileDigest:
    """A file's size, and its checksum (None when checksums were turned off)."""

    size: int
    digest: str | None


class Hasher:
    """Running size and (unless ``checksum`` is False) checksum of bytes as they are written."""

    def __init__(self, checksum: bool = True) -> None:
        self._hash = xxhash.xxh3_64() if checksum else None
        self.size = 0

    def update(self, data: Any) -> None:
        view = memoryview(data)
        if self._hash is not None:
            self._hash.update(view)
        self.size += view.nbytes

    def result(self) -> FileDigest:
        return FileDigest(self.size, self._hash.hexdigest() if self._hash is not None else None)


def file_digest(path: str | os.PathLike[str] | Remote, *, checksum: bool = True) -> FileDigest:
    """Size and checksum of a file, read in 8 MiB pieces (only its size when ``checksum`` is False)."""
    if isinstance(path, Remote):
        if not checksum:
            return FileDigest(path.size(), None)
        hasher = Hasher()
        for piece in path.chunks():
            hasher.update(piece)
        return hasher.result()
    # by the one rule for reading (storage.safe_reader): never through a symlink, never a FIFO,
    # no further than the size the open file has
    with open_bounded(path) as f:
        if not checksum:
            return FileDigest(f.raw.size, None)  # type: ignore[attr-defined]
        hasher = Hasher()
        buffer = bytearray(_CHUNK)
        while n := f.readinto(buffer):
            hasher.update(memoryview(buffer)[:n])
    return hasher.result()


def manifest_bytes(files: dict[str, FileDigest], source: dict[str, Any], save_id: str | None = None) -> bytes:
    """The manifest document recording ``files`` (and what the output was made from).

    ``save_id`` is the save that wrote it, also recorded in its ``.metadata`` (``storage_meta``):
    a manifest whose save id differs from its ``.metadata``'s is stale, not a sign of corruption.
    """
    document = {
        "tool": "parallel_dcp",
        "version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "checksum": ALGORITHM,
        "save_id": save_id,
        "source": source,
        "files": {
            name: {"size": d.size, ALGORITHM: d.digest} if d.digest else {"size": d.size}
            for name, d in sorted(files.items())
        },
    }
    return (json.dumps(document, indent=1) + "\n").encode()


def read_manifest(
    directory: str | os.PathLike[str] | Remote, *, current_only: bool = False
) -> dict[str, FileDigest] | None:
    """The files the manifest records, or None when there is no manifest.

    Every name in it must be a plain file name inside ``directory`` (checked before anything is
    read). With ``current_only``, a manifest that belongs to another save than the directory's
    ``.metadata`` (left by a save killed between the two renames of its commit) is stale: a
    warning, and None.

    Raises:
        CorruptCheckpointError: the manifest exists but cannot be read, or names a file outside
            the checkpoint.
    """
    path = locate(directory) / MANIFEST_FILE
    if not (path.is_file() if isinstance(path, Remote) else os.path.lexists(path)):
        return None
    try:  # by the one rule: a symlink or a FIFO planted as the manifest is refused, never followed
        document = loads_json(read_record(path))
        if document.get("checksum") != ALGORITHM:
            raise ValueError(f"unknown checksum {document.get('checksum')!r}")
        files = {
            check_name(name, path): FileDigest(int(v["size"]), v.get(ALGORITHM))
            for name, v in document["files"].items()
        }
        if any(d.size < 0 or not isinstance(d.digest, (str, type(None))) for d in files.values()):
            raise ValueError("a negative size or a checksum that is not a string")
    except CorruptCheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{path} is not a readable manifest: {exc}") from exc
    if current_only and _stale(locate(directory), document.get("save_id")):
        warnings.warn(
            f"{path} belongs to another save than {locate(directory) / METADATA_FILE} (a save was stopped "
            "between its commit and the manifest's rename): it is stale and was not used",
            stacklevel=2,
        )
        return None
    return files


def _stale(directory: Location, save_id: object) -> bool:
    if not isinstance(save_id, str) or not (directory / METADATA_FILE).is_file():
        return False
    from parallel_dcp.storage.metadata import read_metadata

    meta = read_metadata(directory).storage_meta
    recorded = getattr(meta, "save_id", None)
    return isinstance(recorded, str) and recorded != save_id
