"""torch.save files on object storage, copied to a local temporary directory before they are read
(a torch.save file's tensors can only be mapped from a local file)."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from typing import Any

from parallel_dcp.errors import InsufficientSpaceError
from parallel_dcp.storage.local_staging import free_bytes
from parallel_dcp.storage.location import Remote

__all__ = ["remove_if_owner", "spool"]


def spool(files: list[str], options: dict[str, Any] | None) -> tuple[str, dict[str, str]]:
    """Copy torch.save files from object storage to a local directory, in 8 MiB pieces.

    A torch.save file is a pickle whose tensors can only be mapped (and so read a key at a time)
    from a local file; the copy goes to disk, never whole into memory.

    Raises:
        InsufficientSpaceError: the temporary directory's file system cannot hold the files.
    """
    remotes = [Remote(f, options or {}) for f in files]
    directory = tempfile.mkdtemp(prefix="parallel_dcp-source-")
    need = sum(r.size() for r in remotes)
    free = free_bytes(directory)
    if free is not None and free < need:
        shutil.rmtree(directory, ignore_errors=True)
        raise InsufficientSpaceError(
            errno.ENOSPC,
            f"reading {files[0]} needs a local copy of {need} bytes ({need / 2**30:.2f} GiB; torch.save files "
            f"cannot be read by ranges) and {directory} has {free} bytes free: point TMPDIR at a larger disk",
        )
    local = {}
    try:
        for i, remote in enumerate(remotes):
            local[remote.url] = os.path.join(directory, f"{i}-{remote.name}")
            with open(local[remote.url], "wb") as out:
                for piece in remote.chunks():
                    out.write(piece)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory, local


def remove_if_owner(owner: int, directory: str) -> None:
    if os.getpid() == owner:  # a forked worker that exits must not delete the coordinator's copy
        shutil.rmtree(directory, ignore_errors=True)
