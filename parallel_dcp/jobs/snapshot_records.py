"""The records a Hugging Face cache snapshot holds beside its links: whose file they are.

    models--X/
      blobs/<sha-a>                      the file's bytes (no record beside it: blobs are named by hash)
      blobs/<sha-b>                      its record's bytes
      snapshots/<rev>/model.pt           -> ../../blobs/<sha-a>
      snapshots/<rev>/model.pt.manifest.json -> ../../blobs/<sha-b>

A file named through a link is checked against the record of the file the link leads to, and a
plain sidecar beside the link's own name is not used: it was written for whatever file that name
held then (``ln -sf step2000.pt latest.pt`` over a file we once wrote leaves it beside another
file; jobs/verify_files.py record_beside_link). A snapshot is different: its folder is named for
the one revision whose files it holds, and the cache writes every one of them, the record among
them, as a link into the repository's ``blobs/``. A record there that is such a link was written
with that revision, for the file of that name: it is the file's record, read where it leads by the
rule that reads the file (a link only within the repository's folder). A plain file in a snapshot
is none of the cache's: it is not used, as beside any other link.
"""

from __future__ import annotations

import os
from pathlib import Path

from parallel_dcp.errors import UnsafeCheckpointError
from parallel_dcp.storage.location import Location
from parallel_dcp.storage.manifest import MANIFEST_FILE, FileDigest, read_manifest, sidecar_name
from parallel_dcp.storage.safe_files import resolve_in_tree, source_tree

__all__ = ["snapshot_record", "snapshot_sidecar", "snapshot_tree"]


def snapshot_tree(name: Path, read: Path) -> Path | None:
    """The Hugging Face cache repository folder (``models--X/``) when ``name`` is a file of one of
    its snapshots, a link within it leading to ``read`` (the file the job reads); None for any
    other name."""
    tree = source_tree(name.parent)
    if tree == Path(os.path.realpath(name.parent)) or not name.is_symlink():
        return None  # (not in a snapshot)
    try:
        return tree if resolve_in_tree(name, tree) == read else None
    except (UnsafeCheckpointError, FileNotFoundError):
        return None


def snapshot_sidecar(name: Path, read: Path) -> FileDigest | None:
    """The checksum that the sidecar beside ``name``, a file of a Hugging Face cache snapshot
    leading to ``read``, records for it, where that sidecar is one of the snapshot's files (a link
    within the repository's folder, read where it leads); None where ``name`` is no such file, or
    the sidecar is missing or a plain file (put there since: not used).

    Raises:
        CorruptCheckpointError: the sidecar cannot be read (a link out of the repository's folder,
            to a blob that is gone, or a record of another file).
    """
    tree = snapshot_tree(name, read)
    if tree is None or not (name.parent / sidecar_name(name.name)).is_symlink():
        return None
    files = read_manifest(name.parent, of_file=name.name, tree=tree)
    return files[name.name] if files is not None else None


def snapshot_record(named: Location, read: Path, kind: str) -> tuple[FileDigest, str] | None:
    """A single file of a Hugging Face cache snapshot named by its link (``snapshots/<rev>/model.pt``,
    leading to ``read``, ``blobs/<sha>``, beside which no record lies): the checksum the snapshot
    records for it beside the name, and where (its sidecar ``model.pt.manifest.json``; else, a
    shard named alone, its entry in the snapshot folder's ``.parallel_dcp.json``); None where the
    name is no such link or the snapshot records nothing for it (a safetensors file's own record
    is in its header: read by the caller)."""
    name = Path(os.path.abspath(named))
    if (tree := snapshot_tree(name, read)) is None:
        return None
    if kind != "safetensors" and (digest := snapshot_sidecar(name, read)) is not None:
        return digest, sidecar_name(name.name)
    files = read_manifest(name.parent, current_only=True, tree=tree)
    if files is None or name.name not in files:
        return None
    return files[name.name], MANIFEST_FILE
