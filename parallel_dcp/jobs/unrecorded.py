"""The files a recorded folder's reads open that its record does not list, and what checks them.

A Hugging Face folder that parallel_dcp wrote carries ``.parallel_dcp.json``, the sizes and
checksums of every file in it. A file added afterwards that a conversion reads is not damage of
what was recorded: the hub's safetensors bot (or our own ``convert F F/model.safetensors``) puts a
``model.safetensors`` beside recorded ``.bin`` shards, and the job reads that one (formats/__init__.py
picks the format). So a file the record does not list is checked against its own record where it
carries one (a safetensors header's checksum, a torch.save sidecar: :func:`with_own_records`), and
with none it is read unchecked, named in a SourceNotCheckedWarning (``verify``: a warning, not a
problem). A change to a file the record does list (the recorded index, naming an added shard) stays
a refusal: jobs/source_check.py.
"""

from __future__ import annotations

import os
from pathlib import Path

from parallel_dcp.errors import UnsafeCheckpointError
from parallel_dcp.formats import index_read as folder_index_read
from parallel_dcp.formats import safetensors_format, torch_format
from parallel_dcp.formats.base import Source
from parallel_dcp.jobs.verify_files import Recorded, add_record, links_within, own_record
from parallel_dcp.storage.manifest import MANIFEST_FILE
from parallel_dcp.storage.safe_files import resolve_in_tree

__all__ = ["index_name", "index_read", "unrecorded_files", "with_own_records"]


def unrecorded_files(source: Source, recorded: Recorded) -> list[str]:
    """The files of a local Hugging Face folder with a record of its own (``.parallel_dcp.json``)
    that its reads open but the record does not list, by their names in the folder: a shard added
    (and named in the index) after the record was written, or an index where none was recorded;
    [] for any other source (a DCP directory's record is bound to its ``.metadata`` by save id)."""
    tree = links_within(source)
    if tree is None or recorded.record != MANIFEST_FILE or recorded.records:
        return []
    folder = Path(os.fspath(source.location))
    read = set(source.files)  # (resolved: formats/folder_files.py chosen_files)
    if index_read(source):  # (read when the source was opened)
        read.add(os.fspath(folder / index_name(source)))
    listed = {_resolved(folder / name, tree) for name in recorded.files}
    named = source.folder.named_choice(folder) if source.folder is not None else None
    below = [named.name] if named is not None and "/" in named.name else []  # (in a subfolder: sub/w.safetensors)
    return [
        name
        for name in [*sorted(os.listdir(folder)), *below]
        if name not in recorded.files
        and (real := _resolved(folder / name, tree)) is not None
        and (os.fspath(real) in read or os.fspath(folder / name) in read)
        and real not in listed
    ]


def with_own_records(source: Source, recorded: Recorded) -> tuple[Recorded, list[str]]:
    """``recorded`` (a folder's ``.parallel_dcp.json``) with the own records of the files the job
    reads that it does not list (:func:`unrecorded_files`) added, and the names of those that carry
    none (read unchecked). ``recorded`` itself is left as it is."""
    added = unrecorded_files(source, recorded)
    if not added:
        return recorded, []
    tree = links_within(source)
    assert tree is not None  # (unrecorded_files found files: a local folder)
    folder = Path(os.fspath(source.location))
    merged = Recorded(
        recorded.directory, dict(recorded.files), recorded.record, dict(recorded.starts), list(recorded.problems)
    )
    unchecked = []
    for name in added:
        real = _resolved(folder / name, tree)
        own = own_record(source.kind, folder, name, real) if real is not None and name != index_name(source) else None
        if own is None:
            unchecked.append(name)
        else:
            add_record(merged, name, own)
    return merged, unchecked


def index_name(source: Source) -> str:
    """The index a sharded folder of ``source`` is opened by, by its name in the folder: the one
    its config.json names (``transformers_weights``), else its format's (``model.safetensors.index.json``)."""
    named = source.folder.named_choice(source.location) if source.folder is not None else None
    if named is not None and named.sharded:
        return named.name
    return safetensors_format.INDEX_NAME if source.kind == "safetensors" else torch_format.INDEX_NAME


def index_read(source: Source) -> bool:
    """Whether opening a local Hugging Face folder read its index (not where the job reads the
    lone ``model.safetensors`` or ``pytorch_model.bin`` beside it, as transformers does: the one
    choice, formats/folder_choice.py)."""
    return links_within(source) is not None and folder_index_read(source) is not None


def _resolved(path: Path, tree: Path) -> Path | None:
    """Where ``path`` leads within ``tree`` (itself, if no link); None where it leads out or nowhere."""
    try:
        return resolve_in_tree(path, tree)
    except (UnsafeCheckpointError, FileNotFoundError):
        return None
