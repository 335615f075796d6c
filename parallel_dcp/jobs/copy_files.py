"""The files beside the weights (``config.json``, tokenizer files, ...) copied into a converted directory.

    source dir (a Hugging Face folder)  ── or ──  copy_files_from=DIR (any source)
        │  plain files at its top level, minus weights, indexes and hidden files; sizes known
        │  (those the folder's own record lists: checked against it, jobs/side_file_checks.py)
        ▼
    the output's target (a sharded safetensors / torch directory) commits them beside the shards:
    each written new under this save's temporary name, renamed into place with the index and the
    manifest (which records their sizes and checksums), removed with the rest if the save fails;
    a recorded one read with other bytes than recorded is refused there (read_copies)

The files of its non-weight folders (``1_Pooling/config.json``, ...) come too, by the same rules
(:mod:`parallel_dcp.jobs.side_folders`), so a sentence-transformers folder loads as well.
So ``convert hf_dir out --to safetensors`` gives a folder ``from_pretrained`` loads. Chosen before
anything is written; a name the output writes itself (a shard, the index) is never copied over.
Files are held in memory at the commit (they are small); all of them must fit under the memory
limit, or the conversion is refused before it starts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from parallel_dcp.engine.memory import format_bytes
from parallel_dcp.errors import InvalidDestinationError, UnsafeCheckpointError, plural, printable
from parallel_dcp.formats.base import Source
from parallel_dcp.jobs.side_file_checks import RecordedCopy, side_file_records
from parallel_dcp.jobs.side_folders import folder_files, module_folders
from parallel_dcp.storage.location import Location, Remote, file_size, listdir, locate
from parallel_dcp.storage.ownership import new_save_id, temp_name
from parallel_dcp.storage.pinned_paths import pinned_path
from parallel_dcp.storage.safe_files import regular_size, resolve_in_tree, source_tree
from parallel_dcp.storage.safe_reader import open_bounded
from parallel_dcp.storage.side_trees import check_merge

__all__ = ["WEIGHT_SUFFIXES", "Copies", "check_no_clash", "files_to_copy", "read_copies"]

_NAME_MAX = 255  # bytes in a file name (Linux, and most file systems)

# Files that hold weights (of this or another framework) or index them: never copied, as the
# converted directory has its own weights and index.
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".gguf",
    ".onnx",
    ".distcp",
    ".index.json",
)


def _copyable(name: str) -> bool:
    return not name.startswith(".") and not name.endswith(WEIGHT_SUFFIXES)


class Copies(dict[str, Location]):
    """Name -> where to read it, for every file to copy into the output, and (``sizes``) each
    one's size when it was chosen: what the memory limit was checked against, and the most its
    read at the commit takes; the folder they were chosen from (``folder``), and (``recorded``)
    those its record lists, found as recorded before the job ran (jobs/side_file_checks.py): the
    bytes read for the commit must be those too."""

    def __init__(self, folder: Location | None = None) -> None:
        super().__init__()
        self.sizes: dict[str, int] = {}
        self.folder = folder
        self.recorded: dict[str, RecordedCopy] = {}
        self.modules: frozenset[str] = frozenset()

    def would_copy(self, name: str) -> bool:
        """Whether a file ``name`` of the folder (``1_Pooling/config.json`` below it) is one the copy
        takes where it is there: no hidden part, and no weights but a module folder's."""
        parts = name.split("/")
        if any(part.startswith(".") for part in parts):
            return False
        return not name.endswith(WEIGHT_SUFFIXES) or (len(parts) > 1 and parts[0] in self.modules)


def files_to_copy(
    source: Source,
    *,
    directory_output: bool,
    copy_files: bool,
    copy_files_from: str | os.PathLike[str] | None,
    storage_options: dict[str, Any] | None,
    limit: int,
) -> Copies:
    """Name -> where to read it, for every file to copy into the output (empty: nothing to copy).

    A Hugging Face directory source (safetensors or torch shards) gives its own files when
    ``copy_files`` and the output is a directory; ``copy_files_from`` gives that directory's files
    for any source (and needs a directory output).

    Raises:
        InvalidDestinationError: ``copy_files_from`` with an output that is not a sharded directory.
        ValueError: ``copy_files_from`` is not a directory, or the files hold more than ``limit``
            bytes (they are held in memory at the commit).
    """
    if copy_files_from is not None:
        if not directory_output:
            raise InvalidDestinationError(
                "copy_files_from= (--copy-files-from) copies files into a sharded directory output: "
                "--to safetensors or torch, and a destination without a file suffix"
            )
        where = locate(copy_files_from, storage_options)
        if not where.is_dir():
            raise ValueError(f"copy_files_from= (--copy-files-from): {printable(os.fspath(where))} is not a directory")
    elif copy_files and directory_output and source.kind != "dcp" and source.location.is_dir():
        where = source.location
    else:
        return Copies()
    copies = Copies(where)
    sizes = copies.sizes
    tree = None if isinstance(where, Remote) else source_tree(where)
    for name in sorted(listdir(where)):
        if not _copyable(name):
            continue
        found = _side_file(where / name, tree)
        if found is not None:
            _check_name_length(name)
            copies[name], sizes[name] = found
    if isinstance(where, Path):  # and the files of its non-weight folders (1_Pooling/, ...): issue 29
        modules = copies.modules = module_folders(copies.get("modules.json"))
        for name, path in folder_files(where, _copyable, weights_in=modules).items():
            _check_name_length(name.split("/")[0])  # the folder is written under a temporary name
            copies[name], sizes[name] = path, regular_size(path)
    total = sum(sizes.values())
    if total > limit:
        raise ValueError(
            f"the {plural(len(copies), 'file')} to copy beside the weights hold {format_bytes(total)}, more than "
            f"the memory limit {format_bytes(limit)}: convert with copy_files=False (--no-copy-files) and copy them"
        )
    return copies


def checked_copies(
    source: Source,
    *,
    directory_output: bool,
    copy_files: bool,
    copy_files_from: str | os.PathLike[str] | None,
    storage_options: dict[str, Any] | None,
    limit: int,
    check: bool,
) -> Copies:
    """:func:`files_to_copy`, and with ``check`` (the job's source checks) those its folder's record
    lists checked against it before any task runs (jobs/side_file_checks.py): one rule for a
    conversion and for the first pass over several sources."""
    copies = files_to_copy(
        source,
        directory_output=directory_output,
        copy_files=copy_files,
        copy_files_from=copy_files_from,
        storage_options=storage_options,
        limit=limit,
    )
    if check and copies.folder is not None:
        copies.recorded = side_file_records(
            copies, copies.folder, own_source=copy_files_from is None, would_copy=copies.would_copy
        )
    return copies


def _side_file(path: Location, tree: Path | None) -> tuple[Location, int] | None:
    """(where to read it, its size) for a file to copy; None for what is not a file (a directory).

    A local name follows the one rule for reading (storage.safe_files): a symlink only within the
    source's tree (a Hugging Face cache snapshot's links into ``blobs/``), read where it leads;
    regular files only, sized by fstat, never through a link out of the tree (``/etc/passwd``,
    ``/proc/self/environ``: a /proc file would also count 0 bytes against the limit).

    Raises:
        UnsafeCheckpointError: a symlink leading out of the tree, a FIFO, a socket, a device.
    """
    if tree is None:  # object storage: no links, no special files
        assert isinstance(path, Remote)
        return (path, file_size(path)) if path.is_file() else None
    assert isinstance(path, Path)
    target = resolve_in_tree(path, tree)
    if target.is_dir():
        return None
    try:
        size = regular_size(target)
    except UnsafeCheckpointError:
        if target == path:
            raise
        raise UnsafeCheckpointError(f"{path} leads to {target}, which is not a regular file") from None
    return pinned_path(target, tree), size  # read at the commit with no link on its way


def _check_name_length(name: str) -> None:
    """A name the commit can write: each file is first written under a temporary name carrying the
    save's id (``.NAME.<id>.tmp``), which must fit the file system's 255-byte limit."""
    longest = len(os.fsencode(temp_name(name, "0" * len(new_save_id()))))
    if longest > _NAME_MAX:
        raise InvalidDestinationError(
            f"the side file {printable(name[:40])}... ({len(os.fsencode(name))} bytes) has a name too long to "
            f"copy: the commit writes it under a temporary name of {longest} bytes, more than the {_NAME_MAX} "
            "a file name can have; rename it, or convert with copy_files=False (--no-copy-files)"
        )


def read_copies(copies: Copies, names: Iterable[str] | None = None) -> dict[str, bytes]:
    """The bytes of every file in ``copies`` (or of ``names`` among them), read at the commit
    (their total was checked against the memory limit when they were chosen).

    Local files are opened by the one rule again (a file swapped for a symlink or a FIFO since it
    was chosen is refused, and so is a folder on its way swapped for a link: each local path is
    the realpath taken when it was chosen, walked without following any link) and read no further
    than the size it had when it was chosen. A file its folder's record lists, found as recorded
    before the job ran, must still be (:meth:`~parallel_dcp.jobs.side_file_checks.RecordedCopy.check`).

    Raises:
        ValueError: a file grew since it was chosen (its new bytes were never counted).
        SourceChecksumError: a recorded file (not documentation) has other bytes than recorded now.
    """
    found = {}
    for name in copies if names is None else names:
        path, chosen = copies[name], copies.sizes.get(name)
        if isinstance(path, Remote):
            if chosen is None:
                found[name] = path.read_bytes()
            elif chosen == 0:  # (a ranged read of an empty object is refused by S3: 416)
                found[name] = b"" if path.size() == 0 else b"\0"
            else:
                found[name] = path.read_bytes(0, chosen + 1)
        else:
            with open_bounded(path, no_links=True) as stream:  # chosen as a realpath: a link now is a swap
                found[name] = stream.read() if chosen is None else stream.read(chosen + 1)
        if chosen is not None and len(found[name]) > chosen:
            raise ValueError(
                f"{printable(os.fspath(path))}, a file to copy beside the weights, grew past the "
                f"{format_bytes(chosen)} it held when the job chose it: it changed while the job ran; "
                "nothing was committed (run it again once it is whole)"
            )
        if (recorded := copies.recorded.get(name)) is not None:
            recorded.check(found[name])  # (the bytes the output gets: a rewrite since the check is refused)
    return found


def check_no_clash(copies: Copies, written: Iterable[str], *, overwriting: Location | None = None) -> None:
    """Refuse a copied folder named like a file the output writes itself (``config.json/`` beside a
    preset's or a quantized output's config.json), before anything is written: both would take one
    name in the destination. ``overwriting``: the local destination an overwrite merges the copied
    folders into (storage/side_trees.py), whose folders and files must not stand where the copies'
    files and folders go.

    Raises:
        InvalidDestinationError: naming the folder and the file.
    """
    if isinstance(overwriting, Path):
        check_merge(overwriting, [name for name in copies if "/" in name])
    folders = {name.split("/")[0] for name in copies if "/" in name}
    for name in sorted(folders & set(written)):
        raise InvalidDestinationError(
            f"the folder {printable(name)!r} to copy beside the weights has the name of a file the output writes "
            f"({printable(name)}); rename it, or convert with copy_files=False (--no-copy-files) (nothing was written)"
        )
