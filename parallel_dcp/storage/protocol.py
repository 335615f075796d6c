"""The staging protocol every destination implements (see :mod:`parallel_dcp.storage.staging`)."""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallel_dcp.storage.location import Remote
from parallel_dcp.storage.ownership import is_of_save, temp_name
from parallel_dcp.storage.safe_files import FileData, open_directory, remove_name

__all__ = [
    "Staging",
    "WriteLocation",
]


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

    def clear_attempt(self, names: Iterable[str]) -> None:
        """In a worker, before a task writes: remove what a dead attempt of it left under
        ``names``, this save's names for the task's files (a retried task writes them again, and a
        local file is only ever created new). Only names of this save (``is_of_save``), by name
        relative to the directory, never followed; object storage: nothing (a put replaces)."""
        if isinstance(self.root, Remote):
            return
        ours = [name for name in names if is_of_save(name, self.save_id)]
        if not ours:
            return
        directory = open_directory(self.root)
        try:
            for name in ours:
                with contextlib.suppress(FileNotFoundError):
                    remove_name(directory, name)
        finally:
            os.close(directory)


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
    # With resume: the job record of the dead conversion this save continues (its save id is now
    # this save's); None for a fresh save.
    resumed: dict[str, Any] | None = None

    @property
    def path(self) -> Path | Remote:
        """The directory (or file) workers write into."""
        return self.location.root

    def destination_id(self) -> dict[str, Any] | None:
        """What identifies the destination whatever its path's spelling (local: the directory's
        device and inode, and the output's name in it); None where there is no such thing."""
        return None

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
        marker: tuple[str, FileData] | None = None,
        extras: Mapping[str, bytes] | None = None,
    ) -> None:
        """Publish ``staged`` files under their names, then ``marker`` (the commit: its bytes, one
        buffer or pieces written in order), then ``extras``."""

    @abstractmethod
    def publish(self) -> None:
        """After the commit: remove what the replaced checkpoint owned; release the destination."""

    @abstractmethod
    def discard(self) -> None:
        """On failure: remove exactly what this save created; release the destination."""

    def discard_keeping(self, keep: Collection[str]) -> None:
        """On failure: as :meth:`discard`, but leave the files named in ``keep`` (a conversion's
        finished tasks and their records, for ``resume=True``) and the owner record, marked
        stopped, so that the next save to the destination resumes or removes them. Where a
        destination cannot resume, the same as :meth:`discard`."""
        self.discard()
