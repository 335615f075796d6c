"""The one way a job opens a local file to read it, also for torch's own DCP reader.

    open_regular (safe_files)    O_NOFOLLOW | O_NONBLOCK, then fstat: a regular file, else refused
        │                        (a planted symlink is never followed, a FIFO never blocked on);
        │                        a listed source file by open_source (pinned_paths): no folder on
        │                        its way swapped for a link since either
        ▼
    BoundedFile                  pread, never past the size fstat gave at the open (a file that
        │                        grows is read as it was; one that shrinks is "truncated")
        ▼
    SafeFileSystem.create_stream torch's ``FileSystemReader`` opens every shard through this seam
                                 (stock: ``Path.open``, which follows whatever the name points to)

Every reader of a local DCP checkpoint that hands shards to torch's reader (the fallback for
pickled values and non-contiguous records, ``load(retries=)``, convert and diff of DCP sources,
:func:`parallel_dcp.partial.partial_load` through ``dcp_reader``) takes a :class:`SafeFileSystem`,
so every read path applies the same rule as the fast path's ``ShardFile``. A shard gone between
``.metadata`` and the open (another process overwrote the checkpoint) is a ``CorruptCheckpointError``
saying so, never a raw ``FileNotFoundError``.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem

from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.storage.pinned_paths import open_source, open_without_links
from parallel_dcp.storage.safe_files import open_regular, resolve_in_tree, vanished

__all__ = ["BoundedFile", "SafeFileSystem", "open_bounded", "read_in_tree", "vanished"]


class BoundedFile(io.RawIOBase):
    """A regular file open for reading by ``pread``, never past the size it had when opened.

    ``/proc`` files (regular, size 0) read as empty instead of as whatever the kernel makes up;
    a file that grows while read is read as it was at the open; one that shrinks raises.
    """

    def __init__(self, fd: int, name: str) -> None:
        super().__init__()
        self._fd = fd
        self.name = name
        self.size = os.fstat(fd).st_size
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self.size}.get(whence)
        if base is None:
            raise ValueError(f"invalid whence {whence}")
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._position = base + offset
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = min(view.nbytes, max(0, self.size - self._position))
        got = 0
        while got < want:
            n = os.preadv(self._fd, [view[got:want]], self._position + got)
            if n <= 0:
                raise CorruptCheckpointError(
                    f"{self.name} ends at byte {self._position + got}, before the {self.size} bytes it had when "
                    "opened: truncated while reading (another process changed it)"
                )
            got += n
        self._position += got
        return got

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def open_bounded(
    path: str | os.PathLike[str],
    *,
    buffering: int = io.DEFAULT_BUFFER_SIZE,
    no_links: bool = False,
    listed: bool = False,
) -> io.BufferedReader:
    """``path`` for reading by the one rule (:func:`~parallel_dcp.storage.pinned_paths.open_source`):
    a regular file, no symlink followed on its way (but a hub cache snapshot's into its blobs),
    never blocking on a FIFO, bounded by its fstat size. ``no_links``: ``path`` is a realpath
    taken earlier, and no component of it may be a symlink now
    (:func:`~parallel_dcp.storage.pinned_paths.open_without_links`). ``listed``: ``path`` is a
    source's file as its listing gave it (a link within the tree resolved to where it leads), and
    no folder on its way may have become a link since (:func:`~parallel_dcp.storage.pinned_paths.
    open_source`); by default, as :func:`~parallel_dcp.storage.safe_files.open_regular` (the
    destination's own files are read so, by the path the user gave).

    Raises:
        UnsafeCheckpointError: a symlink, a FIFO, a directory, anything not a regular file.
        CorruptCheckpointError: the file is gone (it vanished: see :func:`vanished`).
    """
    try:
        fd = open_without_links(path) if no_links else open_source(path) if listed else open_regular(None, path)
    except FileNotFoundError:
        raise vanished(os.fspath(path)) from None
    try:
        raw = BoundedFile(fd, os.fspath(path))
    except BaseException:
        os.close(fd)
        raise
    return io.BufferedReader(raw, buffer_size=buffering)


def read_in_tree(path: str | os.PathLike[str], tree: str | os.PathLike[str], *, limit: int) -> bytes:
    """The bytes of a small source file (an index, ``config.json``) by the one rule: a link only
    within ``tree`` (:func:`~parallel_dcp.storage.safe_files.resolve_in_tree`), a regular file, at
    most ``limit`` bytes by its fstat size.

    Raises:
        UnsafeCheckpointError: a link out of ``tree``, or not a regular file.
        CorruptCheckpointError: larger than ``limit``, or gone.
    """
    target = resolve_in_tree(path, tree)
    with open_bounded(target, listed=target != Path(path)) as stream:  # (a link resolved: no folder swapped since)
        size = stream.raw.size  # type: ignore[attr-defined]
        if size > limit:
            raise CorruptCheckpointError(
                f"{os.fspath(path)} has {size} bytes, more than the {limit} such a file can have"
            )
        return stream.read()


class SafeFileSystem(FileSystem):
    """torch's local ``FileSystem`` whose read streams are opened by :func:`open_bounded`."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if set(mode) - {"r", "b"}:  # torch's readers only read; a writer keeps stock's stream
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open_bounded(path) as stream:
            yield stream
