"""The files a recorded folder's reads open that its record does not list.

A Hugging Face folder that parallel_dcp wrote carries ``.parallel_dcp.json``, the sizes and
checksums of every file in it. A shard added afterwards and named in the index (a merge script, an
edit) is read by a conversion like the others, but no record vouches for it: the folder is no
longer the one recorded. A conversion refuses it and ``verify`` reports it (jobs/source_check.py,
jobs/verify.py), by the names found here.
"""

from __future__ import annotations

import os
from pathlib import Path

from parallel_dcp.errors import UnsafeCheckpointError
from parallel_dcp.formats import safetensors_format, torch_format
from parallel_dcp.formats.base import Source
from parallel_dcp.jobs.verify_files import Recorded, links_within
from parallel_dcp.storage.manifest import MANIFEST_FILE
from parallel_dcp.storage.safe_files import resolve_in_tree

__all__ = ["index_name", "unrecorded_files"]


def unrecorded_files(source: Source, recorded: Recorded) -> list[str]:
    """The files of a local Hugging Face folder with a record of its own (``.parallel_dcp.json``)
    that its reads open but the record does not list, by their names in the folder: a shard added
    (and named in the index) after the record was written, or an index where none was recorded;
    [] for any other source (a DCP directory's record is bound to its ``.metadata`` by save id)."""
    tree = links_within(source)
    if tree is None or recorded.record != MANIFEST_FILE or recorded.records:
        return []
    folder = Path(os.fspath(source.location))
    read = set(source.files)  # (resolved: formats/base.py shard_files)
    read.add(os.fspath(folder / index_name(source)))  # (read when the source was opened, where there is one)
    listed = {_resolved(folder / name, tree) for name in recorded.files}
    return [
        name
        for name in sorted(os.listdir(folder))
        if name not in recorded.files
        and (real := _resolved(folder / name, tree)) is not None
        and (os.fspath(real) in read or os.fspath(folder / name) in read)
        and real not in listed
    ]


def index_name(source: Source) -> str:
    """The index a sharded folder of ``source``'s format is opened by (``model.safetensors.index.json``)."""
    return safetensors_format.INDEX_NAME if source.kind == "safetensors" else torch_format.INDEX_NAME


def _resolved(path: Path, tree: Path) -> Path | None:
    """Where ``path`` leads within ``tree`` (itself, if no link); None where it leads out or nowhere."""
    try:
        return resolve_in_tree(path, tree)
    except (UnsafeCheckpointError, FileNotFoundError):
        return None
