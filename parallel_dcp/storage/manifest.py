"""The sidecar manifest: each file's size and xxh3-64 checksum, so ``verify`` finds what DCP cannot.

DCP stores no checksums: a flipped byte in a shard loads silently. At commit, parallel_dcp writes
``.parallel_dcp.json`` beside ``.metadata`` (stock readers ignore it)::

    {"tool": "parallel_dcp", "version": "0.1.0", "created": "...", "checksum": "xxh3_64",
     "source": {"kind": ..., "path": ..., "files": {name: {"size", "mtime_ns"}}},
     "files": {"__0_0.distcp": {"size": 123, "xxh3_64": "9f..."}, ".metadata": {...}},
     "folder_files": {"1_Pooling/config.json": {...}}}      (files of folders copied beside it)

Shard checksums are computed as the bytes are written (no second read); xxh3 runs at ~10 GiB/s a
core, which still costs about a tenth of a save to /dev/shm: ``checksums=False`` (``--no-checksums``)
records sizes only (truncation is still found, flipped bytes are not).

Single-file outputs carry the same record: a torch.save file in a sidecar ``NAME.manifest.json``
(:func:`sidecar_name`, the same document recording the one file), a safetensors file inside its
own header's ``__metadata__`` (:data:`EMBEDDED_KEY`: stock readers ignore it; the checksum cannot
cover the header that holds it, so it covers the tensor index and the data section separately,
see :func:`embedded_record`).
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
from parallel_dcp.errors import CorruptCheckpointError, SourceNotCheckedWarning
from parallel_dcp.storage.layout import read_record
from parallel_dcp.storage.location import Location, Remote, check_name, locate
from parallel_dcp.storage.ownership import MANIFEST_FILE, METADATA_FILE
from parallel_dcp.storage.safe_files import hub_cache_repo
from parallel_dcp.storage.safe_reader import open_bounded, read_in_tree

__all__ = [
    "EMBEDDED_KEY",
    "FOLDER_FILES_KEY",
    "MANIFEST_FILE",
    "FileDigest",
    "Hasher",
    "check_folder_name",
    "embedded_record",
    "file_digest",
    "manifest_bytes",
    "read_embedded",
    "read_manifest",
    "sidecar_name",
]

ALGORITHM = "xxh3_64"
_CHUNK = 8 * 1024 * 1024
# The ``__metadata__`` entry of a safetensors file that holds its checksums (a JSON string: the
# format allows string values only).
EMBEDDED_KEY = "parallel_dcp"
_SIDECAR_SUFFIX = ".manifest.json"
# The manifest's record of the files in folders copied beside the output (a key of its own: a
# reader that knows only ``files`` keeps reading plain names there).
FOLDER_FILES_KEY = "folder_files"
_RECORD_MAX_BYTES = 64 * 2**20  # (as storage.layout.read_record: no save writes a larger one)


def sidecar_name(name: str) -> str:
    """The manifest beside a single-file output that cannot hold its own (``model.pt.manifest.json``)."""
    return name + _SIDECAR_SUFFIX


@dataclass(frozen=True, slots=True)
class FileDigest:
    """A file's size, and its checksum (None when checksums were turned off)."""

    size: int
    digest: str | None

    def __reduce__(self) -> tuple[Any, ...]:
        return (FileDigest, (self.size, self.digest))  # (as formats/lean.py LeanPart: not through copyreg)


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


def file_digest(
    path: str | os.PathLike[str] | Remote, *, checksum: bool = True, start: int = 0, no_links: bool = False
) -> FileDigest:
    """Size and checksum of a file (from byte ``start`` on: a safetensors file's data section),
    read in 8 MiB pieces (only its size when ``checksum`` is False). ``no_links``: ``path`` is a
    realpath, and no component of it may be a symlink (a file in a folder of the output)."""
    if isinstance(path, Remote):
        total = path.size()
        if not checksum:
            return FileDigest(max(0, total - start), None)
        hasher = Hasher()
        pieces = (
            path.chunks()
            if start == 0
            else (path.read_bytes(first, min(total, first + _CHUNK)) for first in range(start, total, _CHUNK))
        )
        for piece in pieces:
            hasher.update(piece)
        return hasher.result()
    # by the one rule for reading (storage.safe_reader): never through a symlink, never a FIFO,
    # no further than the size the open file has
    with open_bounded(path, no_links=no_links) as f:
        if not checksum:
            return FileDigest(max(0, f.raw.size - start), None)  # type: ignore[attr-defined]
        hasher = Hasher()
        f.seek(start)
        buffer = bytearray(_CHUNK)
        while n := f.readinto(buffer):
            hasher.update(memoryview(buffer)[:n])
    return hasher.result()


def _digest_entry(digest: FileDigest) -> dict[str, Any]:
    return {"size": digest.size, ALGORITHM: digest.digest} if digest.digest else {"size": digest.size}


def _parse_digest(entry: Any) -> FileDigest:
    digest = FileDigest(int(entry["size"]), entry.get(ALGORITHM))
    if digest.size < 0 or not isinstance(digest.digest, (str, type(None))):
        raise ValueError("a negative size or a checksum that is not a string")
    return digest


def embedded_record(index: FileDigest, data: FileDigest) -> str:
    """The checksums a safetensors file carries in its own header: of its tensor index (the
    header's canonical JSON without ``__metadata__``: names, dtypes, shapes, offsets) and of its
    data section (every byte after the header)."""
    document = {
        "tool": "parallel_dcp",
        "version": __version__,
        "checksum": ALGORITHM,
        "index": _digest_entry(index),
        "data": _digest_entry(data),
    }
    return json.dumps(document, separators=(",", ":"))


def read_embedded(metadata: Any, where: object) -> tuple[FileDigest, FileDigest] | None:
    """(index, data) digests from a safetensors header's ``__metadata__``; None when it has none.

    Raises:
        CorruptCheckpointError: the record is there but cannot be read.
    """
    if not isinstance(metadata, dict) or EMBEDDED_KEY not in metadata:
        return None
    try:
        document = loads_json(metadata[EMBEDDED_KEY])
        if document.get("checksum") != ALGORITHM:
            raise ValueError(f"unknown checksum {document.get('checksum')!r}")
        return _parse_digest(document["index"]), _parse_digest(document["data"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{where}: the checksums in its header are not readable: {exc}") from exc


def manifest_bytes(
    files: dict[str, FileDigest],
    source: dict[str, Any],
    save_id: str | None = None,
    folder_files: dict[str, FileDigest] | None = None,
) -> bytes:
    """The manifest document recording ``files`` (and what the output was made from).

    ``save_id`` is the save that wrote it, also recorded in its ``.metadata`` (``storage_meta``):
    a manifest whose save id differs from its ``.metadata``'s is stale, not a sign of corruption.
    ``folder_files``: files in folders copied beside the output (``1_Pooling/config.json``),
    recorded under a key of their own, so a reader that knows only plain names (an older
    parallel_dcp) still reads ``files`` as before.
    """
    document = {
        "tool": "parallel_dcp",
        "version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "checksum": ALGORITHM,
        "save_id": save_id,
        "source": source,
        "files": {name: _digest_entry(d) for name, d in sorted(files.items())},
    }
    if folder_files:
        document[FOLDER_FILES_KEY] = {name: _digest_entry(d) for name, d in sorted(folder_files.items())}
    return (json.dumps(document, indent=1) + "\n").encode()


def check_folder_name(name: object, where: object) -> str:
    """``name`` if it is a relative path of plain names (``1_Pooling/config.json``); else
    CorruptCheckpointError (each component as :func:`~parallel_dcp.storage.location.check_name`)."""
    if not isinstance(name, str) or "/" not in name:
        raise CorruptCheckpointError(f"{where} records {name!r} among the folders' files, which is not in a folder")
    for part in name.split("/"):
        check_name(part, where)
    return name


def read_manifest(
    directory: str | os.PathLike[str] | Remote,
    *,
    current_only: bool = False,
    of_file: str | None = None,
    tree: str | os.PathLike[str] | None = None,
    warn_stale: bool = True,
) -> dict[str, FileDigest] | None:
    """The files the manifest records, or None when there is no manifest.

    Every name in it must be a plain file name inside ``directory`` (checked before anything is
    read). ``of_file``: read the sidecar manifest of that single file instead (it must record
    that file and nothing else). With ``current_only``, a manifest that belongs to another save than the directory's
    ``.metadata`` (left by a save killed between the two renames of its commit) is stale: None,
    and (``warn_stale``) a warning; ``verify`` reports it instead.

    ``tree``: the tree within which the source's files may be links that its reads follow
    (a Hugging Face cache snapshot's files, this record among them, link into the repository's
    ``blobs/``): the record is read by the same rule as those files (a link only within ``tree``,
    then a regular file); None: never through a link, as a DCP directory's files are read.

    Raises:
        CorruptCheckpointError: the manifest exists but cannot be read, or names a file outside
            the checkpoint (UnsafeCheckpointError: a link, or one leading out of ``tree``).
    """
    path = locate(directory) / (sidecar_name(of_file) if of_file is not None else MANIFEST_FILE)
    if not (path.is_file() if isinstance(path, Remote) else os.path.lexists(path)):
        return None
    try:  # by the one rule: a symlink (out of ``tree``) or a FIFO planted as the manifest is refused, never followed
        raw = read_record(path) if tree is None else read_in_tree(path, tree, limit=_RECORD_MAX_BYTES)
        document = loads_json(raw)
        if document.get("checksum") != ALGORITHM:
            raise ValueError(f"unknown checksum {document.get('checksum')!r}")
        files = {check_name(name, path): _parse_digest(v) for name, v in document["files"].items()}
        if of_file is None:  # files in copied folders, each opened later without following a link
            folders = document.get(FOLDER_FILES_KEY, {})
            files |= {check_folder_name(name, path): _parse_digest(v) for name, v in folders.items()}
        if of_file is not None and set(files) != {of_file}:
            raise ValueError(f"it records {sorted(files)}, not {of_file} alone")
    except CorruptCheckpointError:
        raise
    except FileNotFoundError as exc:  # (a link within the tree to nothing: resolve_in_tree names both)
        why = (
            "a file of the cache deleted, or a download that did not finish: download it again"
            if tree is not None and hub_cache_repo(tree)
            else "the file it led to was moved or deleted: restore it there, or remove the link"
        )
        raise CorruptCheckpointError(f"{exc} ({why})") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{path} is not a readable manifest: {exc}") from exc
    if current_only and of_file is None and _stale(locate(directory), document.get("save_id")):
        if warn_stale:
            warnings.warn(
                f"{path} belongs to another save than {locate(directory) / METADATA_FILE} (a save was stopped "
                "between its commit and the manifest's rename): it is stale and was not used",
                SourceNotCheckedWarning,
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
