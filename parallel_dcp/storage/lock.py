"""One writer per destination: an exclusive ``flock`` on a lock file in the destination's directory.

The lock file (``.parallel_dcp.lock``, or ``.<name>.lock`` beside a single-file output) may exist
already, left by an earlier save, so it cannot be created new like every other file a save writes.
It is opened instead without following a symlink (``O_NOFOLLOW``, relative to the directory's
descriptor) and used only if it is a regular file with one link: a planted symlink or hard link
is refused, so the lock record is never written into a file outside the checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pwd
import stat
from pathlib import Path
from typing import Any

from parallel_dcp._json import loads_json
from parallel_dcp.errors import DestinationBusyError, InvalidDestinationError
from parallel_dcp.storage.safe_files import plain_name

__all__ = ["DestinationLock"]


class DestinationLock:
    """An exclusive ``flock`` on ``name`` in the directory open as ``directory``, held until
    :meth:`release`; the holder's ``record`` is written inside.

    Raises:
        DestinationBusyError: another save holds it (the message names the holder).
        InvalidDestinationError: the lock file cannot be created, or is a symlink, a hard link or
            anything but a regular file (it is left as it is, and so is what it points to).
    """

    def __init__(self, directory: int, path: Path, record: dict[str, Any], destination: object) -> None:
        self._directory = directory
        self.name = plain_name(path.name)
        shown = f"the lock file {path}"
        for _ in range(20):
            fd = _open_lock(directory, self.name, shown)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise DestinationBusyError(
                    f"{destination} is being written by another save ({holder}); one writer at a time: "
                    f"wait for it to finish (its lock is {path})"
                ) from None
            if not self._same(fd):  # the previous holder removed the file between our open and our lock
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, (json.dumps(record) + "\n").encode())
            self.fd: int | None = fd
            return
        raise DestinationBusyError(f"{destination}: could not take the lock {path} (it keeps being replaced)")

    def _same(self, fd: int) -> bool:
        try:
            st = os.stat(self.name, dir_fd=self._directory, follow_symlinks=False)
        except FileNotFoundError:
            return False
        held = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if self._same(self.fd):
                os.unlink(self.name, dir_fd=self._directory)  # still locked: a waiter re-checks and retries
        os.close(self.fd)
        self.fd = None


def _open_lock(directory: int, name: str, shown: str) -> int:
    """The lock file, created if missing; refused if it is not a regular file of one link."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(name, flags, 0o644, dir_fd=directory)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InvalidDestinationError(
                f"{shown} is a symbolic link; refusing to follow it (someone else may write this directory): "
                "remove it and run again"
            ) from None
        raise InvalidDestinationError(f"cannot create {shown}: {exc.strerror}{_whose(directory, name)}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidDestinationError(f"{shown} is not a regular file; remove it and run again")
        if st.st_nlink != 1:  # a hard link to a file elsewhere: writing the record would change it
            raise InvalidDestinationError(
                f"{shown} has {st.st_nlink} links (a hard link to another file?); refusing to write it: "
                "remove it and run again"
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _whose(directory: int, name: str) -> str:
    """Where the lock file cannot be opened because another user owns it (a save of theirs, perhaps
    one that died, in a shared directory): whose it is, and who can remove it."""
    try:
        st = os.lstat(name, dir_fd=directory)
    except OSError:
        return ""
    if st.st_uid == os.geteuid():
        return ""
    try:
        owner = f"user {pwd.getpwuid(st.st_uid).pw_name} (uid {st.st_uid})"
    except KeyError:
        owner = f"uid {st.st_uid}"
    return (
        f": it belongs to {owner}, whose save to this place holds or held it (one that died leaves it); "
        "only that user or root can remove it, or write to a directory only you use"
    )


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        record = loads_json(os.pread(fd, 4096, 0))
        return f"pid {record['pid']} on host {record['host']}, save {record['save_id']}, since {record['since']}"
    return "a process that is still starting"
