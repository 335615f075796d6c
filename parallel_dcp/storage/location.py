"""Where checkpoints live: a local path, or a URL on object storage through fsspec.

    "ckpt/step-1000"           Local   (os, mmap, staging directory + atomic rename)
    "s3://bucket/ckpt/step-1"  Remote  (fsspec; s3fs for S3, any fsspec protocol otherwise)

:func:`locate` gives a ``Path`` or a :class:`Remote`; both answer ``/ name``, ``name``,
``exists()``, ``is_file()``, ``is_dir()`` and ``read_bytes()``, and :func:`listdir` and
:func:`file_size` cover the rest, so readers treat both alike.

A :class:`Remote` is the URL plus the fsspec storage options (``endpoint_url``, ``region``...);
credentials come from the standard environment (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``,
``~/.aws/config``) as s3fs reads them. It is plain data: each process opens its own filesystem
object on first use, because an async filesystem (s3fs) is not fork-safe once its event loop runs.

Uploads go through bounded buffers: a file is sent in parts of :func:`part_size` bytes (a
multipart upload), never held whole, and a failed write aborts its upload, so a half-written
object never appears. Reads fetch exactly the byte ranges asked for (no read-ahead cache).

Longer than 300 lines because local paths and fsspec URLs behind one interface, including DCP's
file-system adapter for URLs and bounded multipart uploads.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import time
from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader

from parallel_dcp import _compat
from parallel_dcp.storage.safe_reader import SafeFileSystem

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = [
    "CLIENT_MEMORY",
    "MIN_PART_BYTES",
    "Location",
    "Remote",
    "RemoteFileSystem",
    "check_name",
    "clients_opened_since",
    "dcp_reader",
    "file_size",
    "is_url",
    "listdir",
    "locate",
    "new_file_mode",
    "part_size",
    "resolved_once",
    "same_place",
    "upload_memory",
]

MIN_PART_BYTES = 8 * 2**20
# What a process's filesystem object holds once it has connected: botocore's session and S3
# service model, aiohttp's session and its event loop thread (measured: ~14 MiB for s3fs).
CLIENT_MEMORY = 16 * 2**20
# S3 allows 10,000 parts per upload; parts grow with the file so that a file never needs more.
_MAX_PARTS = 9000
_READ_BYTES = 8 * 2**20

# (pid, protocol, options and AWS environment) -> the filesystem this process opened, and when.
_FILESYSTEMS: dict[tuple[int, str, str], AbstractFileSystem] = {}
_OPENED_AT: dict[tuple[int, str, str], float] = {}


def _plain(name: object) -> TypeGuard[str]:
    """Whether ``name`` is a plain file name: no path separator, not ``.`` or ``..``, no NUL."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and not os.path.isabs(name)
    )


def check_name(name: object, where: object) -> str:
    """``name`` if it is a plain file name inside a checkpoint directory; else CorruptCheckpointError.

    Names read from a checkpoint (``relative_path`` in ``.metadata``, the manifest's entries, an
    index's ``weight_map``) are hostile: ``../other/__0_0.distcp``, ``/etc/hostname`` or
    ``/proc/self/pagemap`` would make a reader leave the checkpoint. A plain name has no path
    separator, is not ``.`` or ``..``, and holds no NUL.
    """
    from parallel_dcp.errors import CorruptCheckpointError

    if not _plain(name):
        raise CorruptCheckpointError(
            f"{where} names the file {name!r}, which is not a plain file name inside the checkpoint "
            "(refused before reading anything: the checkpoint may be malicious)"
        )
    return name


def check_relative_name(name: object, where: object) -> str:
    """``name`` if it is a path below a folder, each of its parts a plain name
    (:func:`check_name`: ``sub/model-00001-of-00002.safetensors``); else CorruptCheckpointError.
    (A local Hugging Face index's shard names: transformers joins each to the model folder.)"""
    from parallel_dcp.errors import CorruptCheckpointError

    if isinstance(name, str) and all(_plain(part) for part in name.split("/")):
        return name
    raise CorruptCheckpointError(
        f"{where} names the file {name!r}, which is not a path inside the checkpoint's folder (an absolute name, "
        "one with '..', or an empty part; refused before reading anything: the checkpoint may be malicious)"
    )


def is_url(path: object) -> bool:
    """True for ``"<protocol>://..."`` strings other than ``file://`` (those are local paths)."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def same_place(a: Location, b: Location) -> bool:
    """``a`` and ``b`` name one place (a local path through any link; a URL by its spelling)."""
    if isinstance(a, Remote) or isinstance(b, Remote):
        return str(a).rstrip("/") == str(b).rstrip("/")
    return a.resolve() == b.resolve()


def locate(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Location:
    """A :class:`Remote` for a URL, else the local ``Path`` (``file://`` removed)."""
    if isinstance(path, Remote):
        return path
    if is_url(path):
        _import_protocol(str(path))
        return Remote(str(path), dict(storage_options or {}))
    return Path(os.fspath(path).removeprefix("file://"))


def _import_protocol(url: str) -> None:
    """Import the filesystem for ``url``'s protocol now, before a job measures its memory (its
    code is no more the job's memory than torch's is), and say clearly what is missing."""
    from fsspec.registry import get_filesystem_class

    protocol = url.split("://", 1)[0]
    try:
        get_filesystem_class(protocol)
    except ImportError as exc:
        hint = " (pip install '.[s3]' in a checkout, or pip install s3fs)" if protocol in ("s3", "s3a") else ""
        raise ValueError(f"cannot open {url}: the {protocol}:// filesystem is not installed{hint}: {exc}") from exc
    except ValueError as exc:
        raise ValueError(f"cannot open {url}: unknown protocol {protocol!r} ({exc})") from exc


def clients_opened_since(moment: float, locations: Iterable[object]) -> int:
    """How many filesystem objects (each ``CLIENT_MEMORY``) this process opens for the Remote
    ``locations`` at or after ``moment`` (``time.monotonic()``): those opened since, and those it
    has still to open; one per protocol, options and AWS environment. What a job's coordinator
    holds of its own connections, where it opened them itself (a first job on that storage)."""
    keys = {location._client_key() for location in locations if isinstance(location, Remote)}
    return sum(1 for key in keys if _OPENED_AT.get(key, moment) >= moment)


def part_size(expected_bytes: int) -> int:
    """The upload part size for a file of about ``expected_bytes``: 8 MiB, more for huge files."""
    return max(MIN_PART_BYTES, math.ceil(expected_bytes / _MAX_PARTS / 2**20) * 2**20)


def upload_memory(expected_bytes: int) -> int:
    """Memory one upload stream may hold (measured with s3fs: 20-25 MiB for 8 MiB parts): up to
    two parts buffered, the part being sent and the HTTP client's copy of it; a file smaller than
    a part is sent in one request, from its buffer and one copy."""
    return min(4 * part_size(expected_bytes), 3 * expected_bytes + 2**20)


@dataclass(frozen=True)
class Remote:
    """A file or prefix on object storage; ``str()`` gives the URL back."""

    url: str
    options: dict[str, Any] = field(default_factory=dict, compare=False)

    def __str__(self) -> str:
        return self.url

    def __fspath__(self) -> str:  # lets messages and os.fspath() show the URL
        return self.url

    @property
    def fs(self) -> AbstractFileSystem:
        """This process's filesystem object for the URL's protocol and options."""
        from fsspec.core import url_to_fs

        key = self._client_key()
        fs = _FILESYSTEMS.get(key)
        if fs is None:
            fs = _FILESYSTEMS[key] = url_to_fs(self.url, skip_instance_cache=True, **self.options)[0]
            _OPENED_AT[key] = time.monotonic()
        return fs

    def _client_key(self) -> tuple[int, str, str]:
        # The AWS_* environment (credentials, endpoint, profile) is part of what a client is.
        environment = sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))
        options = json.dumps([self.options, environment], sort_keys=True, default=str)
        return os.getpid(), self.url.split("://", 1)[0], hashlib.sha256(options.encode()).hexdigest()

    @property
    def key(self) -> str:
        """The path inside the filesystem (``bucket/prefix``), as fsspec calls take it."""
        return _compat.strip_protocol(self.fs, self.url).rstrip("/")

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> Remote:
        return Remote(self.url.rstrip("/").rsplit("/", 1)[0], self.options)

    def __truediv__(self, name: str) -> Remote:
        return Remote(f"{self.url.rstrip('/')}/{name}", self.options)

    def exists(self) -> bool:
        return bool(self.fs.exists(self.key))

    def is_file(self) -> bool:
        return bool(self.fs.isfile(self.key))

    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.key))

    def listdir(self) -> list[str]:
        """Names directly under this prefix ([] when there are none)."""
        try:
            found = self.fs.ls(self.key, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(str(p).rstrip("/").rsplit("/", 1)[-1] for p in found if str(p).rstrip("/") != self.key)

    def size(self) -> int:
        return int(self.fs.size(self.key))

    def fingerprint(self) -> dict[str, Any]:
        """Size and version tag (ETag or modification time), to tell a changed object."""
        info = self.fs.info(self.key)
        return {"size": int(info.get("size") or 0), "etag": str(info.get("ETag") or info.get("mtime") or "")}

    def read_bytes(self, start: int | None = None, end: int | None = None) -> bytes:
        """The whole object, or bytes ``start:end`` of it (one ranged request)."""
        return bytes(self.fs.cat_file(self.key, start=start, end=end))

    def read_into(self, start: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the object's bytes from ``start`` on, a bounded range at a time."""
        done = 0
        while done < buffer.nbytes:
            stop = min(buffer.nbytes, done + _READ_BYTES)
            data = self.fs.cat_file(self.key, start=start + done, end=start + stop)
            if len(data) != stop - done:
                raise EOFError(f"{self.url} ends before byte {start + stop}")
            buffer[done:stop] = data
            done = stop

    def open_read(self) -> Any:
        """A seekable binary stream whose reads fetch exactly the ranges asked for."""
        return self.fs.open(self.key, "rb", cache_type="none", block_size=MIN_PART_BYTES)

    def chunks(self) -> Iterable[bytes]:
        """The object's bytes in pieces of 8 MiB (for checksums)."""
        with self.open_read() as stream:
            while piece := stream.read(_READ_BYTES):
                yield piece

    def write_bytes(self, data: bytes) -> None:
        """Upload a small object in one request (it appears whole or not at all)."""
        self.fs.pipe_file(self.key, data)

    @contextlib.contextmanager
    def open_write(self, expected_bytes: int = 0) -> Generator[io.RawIOBase, None, None]:
        """A write stream that uploads in parts; on an exception the upload is aborted."""
        stream = self.fs.open(self.key, "wb", block_size=part_size(expected_bytes))
        bounded = _BoundedWrites(stream, part_size(expected_bytes))
        try:
            yield bounded  # type: ignore[misc]
        except BaseException:
            with contextlib.suppress(Exception):
                stream.discard()  # abort the multipart upload: no object appears
            raise
        stream.close()

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.key)

    def remove_all(self, names: Iterable[str]) -> None:
        keys = [f"{self.key}/{n}" for n in names]
        if keys:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(keys)


Location = Path | Remote


def resolved_once(where: Location) -> Location:
    """A local folder named through a symlink (a training run's ``latest -> step-100/``, or a
    ``..`` after one), as the folder it leads to now; anything else as given. A reading job takes
    its source through this once, so every read it makes (each worker's shard opens, the record,
    the side files) is in the checkpoint its plan was made from, though the link is repointed
    while it runs (a trainer's ``ln -sfn step-200 latest``): never one result mixing two saves.
    (A single file's name is resolved once where its files are listed: formats/folder_files.py.)"""
    if isinstance(where, Path) and where.is_dir():
        real = Path(os.path.realpath(where))
        if real != Path(os.path.abspath(where)):
            return real
    return where


class _BoundedWrites:
    """Hands a stream at most one part at a time: fsspec buffers every byte given to one write()
    call before it uploads, so one 10 GiB tensor would otherwise sit in memory twice."""

    def __init__(self, stream: Any, piece: int) -> None:
        self._stream = stream
        self._piece = piece

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, self._piece):
            self._stream.write(view[start : start + self._piece])
        return view.nbytes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class RemoteFileSystem(FileSystemBase):
    """DCP's storage interface (``FileSystemWriter``/``FileSystemReader``) over a :class:`Remote`.

    Paths are URLs. Writes are bounded multipart uploads; reads fetch exact ranges. There is no
    rename: a commit on object storage uploads ``.metadata`` last instead (see ``destination``).
    """

    def __init__(self, options: Mapping[str, Any] | None = None, expected_bytes: int = 0) -> None:
        self.options = dict(options or {})
        self.expected_bytes = expected_bytes

    def _remote(self, path: str | os.PathLike[str]) -> Remote:
        return Remote(os.fspath(path), self.options)

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        remote = self._remote(path)
        if "w" in mode:
            with remote.open_write(self.expected_bytes) as stream:
                yield stream  # type: ignore[misc]
        else:
            with remote.open_read() as stream:
                yield stream

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return f"{os.fspath(path).rstrip('/')}/{suffix}"

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        raise NotImplementedError("object storage has no rename: parallel_dcp commits by uploading .metadata last")

    def init_path(self, path: str | os.PathLike[str]) -> str:
        return os.fspath(path)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """Object storage has no directories: a prefix exists once an object is under it."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_url(os.fspath(checkpoint_id))

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return self._remote(path).exists()

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self._remote(path).remove()

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        remote = self._remote(path)
        return [(remote / name).url for name in remote.listdir()]


def dcp_reader(location: str | os.PathLike[str] | Remote) -> FileSystemReader:
    """DCP's ``FileSystemReader`` for a local directory or a checkpoint on object storage. A local
    directory is resolved once (its realpath): its shards are opened by that path, no link
    followed on the way (storage/pinned_paths.open_source)."""
    if not isinstance(location, Remote):
        local = FileSystemReader(os.path.realpath(location))
        local.fs = SafeFileSystem()  # shards opened by the one rule, never through a planted symlink
        return local
    reader = FileSystemReader(location.url)
    reader.fs = RemoteFileSystem(location.options)  # type: ignore[assignment]
    reader.path = location.url
    return reader


def new_file_mode() -> int:
    """The mode a new file gets from this process's umask (``0o644`` under the usual ``022``).

    Read from ``/proc/self/status``: setting the umask to read it back would briefly change it for
    every thread of the process.
    """
    # Without /proc (or its Umask line), fall back to reading it by setting it.
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def listdir(where: Location) -> list[str]:
    """Names in a directory or under a prefix ([] when it is neither)."""
    if isinstance(where, Remote):
        return where.listdir()
    return sorted(os.listdir(where)) if where.is_dir() else []


def file_size(where: Location) -> int:
    """The size of a file or object; FileNotFoundError when there is none."""
    return where.size() if isinstance(where, Remote) else where.stat().st_size
