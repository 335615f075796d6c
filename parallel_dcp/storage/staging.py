"""Where a job writes and how it commits: one protocol, implemented once per kind of destination.

What a checkpoint owns (and so what an overwrite replaces; every other file stays byte-identical):

- a DCP directory: its ``.metadata``, the shard files that ``.metadata`` names, its manifest;
- a sharded safetensors / torch directory: its shards (the index's ``weight_map``), its index and
  its manifest; without an index, its single shard (``model.safetensors``, ``pytorch_model.bin``);
- a single-file output: that file, and its sidecar manifest (``model.pt.manifest.json``) if any.

The protocol (:class:`Staging`), the same for a local directory, a local file, a prefix on object
storage and an object::

    stage        check the destination; take the lock (local); note this save as the owner
    location     where workers write: the destination itself, under names carrying this save's
                 id (``__<task>_<save id>_0.distcp``; fixed names as ``.<name>.<save id>.tmp``)
    check_space  fail before writing when the file system cannot hold the output
    commit       staged files renamed into place, then the marker (``.metadata`` / the index)
                 in one atomic rename (local: ``renameat2(RENAME_NOREPLACE)`` unless overwrite;
                 object storage: one upload), then the manifest. The commit point is the marker.
    publish      only now remove the files the *replaced* checkpoint owned; release the lock
    discard      on failure: remove exactly the files this save created; release the lock; a
                 destination directory the save created is removed again if it is empty

A crash at any instant leaves the old checkpoint (its ``.metadata`` names only its own shards,
which are removed only after the new ``.metadata`` is in place) or the new one, never a mix. The
manifest is renamed right after the marker; a crash in between leaves the new checkpoint beside
the old manifest, which ``verify`` recognises as stale by its save id (not as corruption).
Sharded Hugging Face directories have fixed shard names: between the first shard's rename and the
index's, the directory holds new shards beside the old index (a short, documented window).

Leftovers: each save writes an owner file (host, pid, process start time, save id). The next save
to the same destination removes the files of a save whose owner is gone (dead pid on this host),
with a warning; ``inspect`` lists them.

Resume (local destinations): a conversion also writes sealed records of its job and of each
finished task (:mod:`parallel_dcp.storage.resume`); when it fails while its tasks run it calls
``discard_keeping`` (its finished tasks stay, its owner record is marked stopped). A later stage
with ``resume`` adopts such a dead save (its save id becomes the new save's) when its job record
matches, instead of removing it; ``publish`` removes the records.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from parallel_dcp.errors import ResumeError
from parallel_dcp.storage.local_destination import check_local_contents, check_local_directory, check_local_file
from parallel_dcp.storage.local_staging import LocalDirStaging, LocalFileStaging
from parallel_dcp.storage.location import Remote
from parallel_dcp.storage.ownership import Layout
from parallel_dcp.storage.protocol import Staging
from parallel_dcp.storage.remote_staging import RemoteFileStaging, RemoteStaging
from parallel_dcp.storage.resume import IdentityCheck

__all__ = ["check_directory", "check_file", "stage_directory", "stage_file"]


def stage_directory(
    where: Path | Remote,
    *,
    overwrite: bool,
    layout: Layout,
    protect: Sequence[str] = (),
    resume: IdentityCheck | None = None,
) -> Staging:
    """Take hold of a checkpoint directory (a local path or a prefix on object storage).

    ``resume``: continue the dead conversion to this destination whose job record it accepts
    (local destinations only; see :mod:`parallel_dcp.storage.resume`)."""
    if isinstance(where, Remote):
        _no_remote_resume(where, resume)
        return RemoteStaging(where, overwrite=overwrite, layout=layout, protect=protect)
    return LocalDirStaging(where, overwrite=overwrite, layout=layout, protect=protect, resume=resume)


def stage_file(
    where: Path | Remote,
    *,
    overwrite: bool,
    protect: Sequence[str] = (),
    resume: IdentityCheck | None = None,
    companions: Sequence[str] = (),
) -> Staging:
    """Take hold of a single-file output (a local path or an object).

    ``companions``: names beside it that belong to it (its sidecar manifest): refused like the
    file itself when they exist and ``overwrite`` is False, replaced with it otherwise."""
    if isinstance(where, Remote):
        _no_remote_resume(where, resume)
        return RemoteFileStaging(where, overwrite=overwrite, protect=protect, companions=companions)
    return LocalFileStaging(where, overwrite=overwrite, protect=protect, resume=resume, companions=companions)


def check_directory(where: Path | Remote, *, layout: Layout) -> None:
    """What :func:`stage_directory` refuses of a local destination before writing, checked
    without taking hold of it and writing nothing (a dry run's check; object storage: nothing)."""
    if not isinstance(where, Remote):
        dest = Path(os.path.abspath(where))
        check_local_directory(dest)
        check_local_contents(dest, layout)


def check_file(where: Path | Remote) -> None:
    """What :func:`stage_file` refuses of a local destination before writing, checked without
    taking hold of it and writing nothing (a dry run's check; object storage: nothing)."""
    if not isinstance(where, Remote):
        check_local_file(Path(os.path.abspath(where)))


def _no_remote_resume(where: Remote, resume: IdentityCheck | None) -> None:
    if resume is not None:
        raise ResumeError(
            f"resume is supported for local destinations only, not {where} (object storage has no "
            "durable per-task records here); run without resume to convert from the start"
        )
