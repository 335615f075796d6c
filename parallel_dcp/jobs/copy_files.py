"""The files beside the weights (``config.json``, tokenizer files, ...) copied into a converted directory.

    source dir (a Hugging Face folder)  ── or ──  copy_files_from=DIR (any source)
        │  plain files at its top level, minus weights, indexes and hidden files; sizes known
        ▼
    the output's target (a sharded safetensors / torch directory) commits them beside the shards:
    each written new under this save's temporary name, renamed into place with the index and the
    manifest (which records their sizes and checksums), removed with the rest if the save fails

The files of its non-weight folders (``1_Pooling/config.json``, ...) come too, by the same rules
(:mod:`parallel_dcp.jobs.side_folders`), so a sentence-transformers folder loads as well.
So ``convert hf_dir out --to safetensors`` gives a folder ``from_pretrained`` loads. Chosen before
anything is written; a name the output writes itself (a shard, the index) is never copied over.
Files are held in memory at the commit (they are small); all of them must fit under the memory
limit, or the conversion is refused before it starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from parallel_dcp.engine.memory import format_bytes
from parallel_dcp.errors import InvalidDestinationError, plural, printable
from parallel_dcp.formats.base import Source
from parallel_dcp.jobs.side_folders import folder_files
from parallel_dcp.storage.location import Location, file_size, listdir, locate

__all__ = ["WEIGHT_SUFFIXES", "files_to_copy", "read_copies"]

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


def files_to_copy(
    source: Source,
    *,
    directory_output: bool,
    copy_files: bool,
    copy_files_from: str | os.PathLike[str] | None,
    storage_options: dict[str, Any] | None,
    limit: int,
) -> dict[str, Location]:
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
        return {}
    copies = {name: where / name for name in sorted(listdir(where)) if _copyable(name) and (where / name).is_file()}
    if isinstance(where, Path):  # and the files of its non-weight folders (1_Pooling/, ...): issue 29
        copies |= folder_files(where, _copyable)
    total = sum(file_size(path) for path in copies.values())
    if total > limit:
        raise ValueError(
            f"the {plural(len(copies), 'file')} to copy beside the weights hold {format_bytes(total)}, more than "
            f"the memory limit {format_bytes(limit)}: convert with copy_files=False (--no-copy-files) and copy them"
        )
    return copies


def read_copies(copies: dict[str, Location]) -> dict[str, bytes]:
    """The bytes of every file in ``copies``, read at the commit (their total was checked)."""
    return {name: path.read_bytes() for name, path in copies.items()}
