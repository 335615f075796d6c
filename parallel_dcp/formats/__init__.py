"""Checkpoint formats: detect one, open it as a :class:`Source`; each module also writes its format.

- DCP directory: read with ``.metadata`` + ``partial_load`` per task; written by the core writer.
- safetensors file or HF sharded directory: read with ``safe_open`` (mmap); written with
  ``save_file`` per shard plus the index JSON.
- torch.save file (.pt/.pth/.bin) or HF ``.bin`` directory: read with
  ``torch.load(mmap=True, weights_only=True)``; written with ``torch.save`` per shard plus the index.

A Hugging Face folder means the weights transformers loads from it (:mod:`.folder_choice`): the
file its ``config.json`` names (``transformers_weights``), else ``model.safetensors``, its index,
``pytorch_model.bin``, its index, the first there; only a folder with none of them is read by
another rule (every ``*.safetensors``, a PEFT adapter beside others not). The folder is listed and
its ``config.json`` read once an open (:mod:`.folder_files`).

Any of them may be at a URL (``s3://...``, see :mod:`parallel_dcp.storage.location`): DCP and safetensors
are then read by byte ranges; torch.save files are first copied to a local temporary directory.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from parallel_dcp.formats import safetensors_format, torch_format
from parallel_dcp.formats.base import Entry, FileFormat, Source
from parallel_dcp.formats.dcp_format import DcpSource, is_dcp
from parallel_dcp.formats.folder_files import Folder, folder_kind, read_folder
from parallel_dcp.formats.safetensors_format import SafetensorsSource, is_safetensors
from parallel_dcp.formats.torch_format import TorchSource, is_torch_save
from parallel_dcp.storage.location import Location, Remote, listdir, locate, resolved_once

__all__ = [
    "FILE_FORMATS",
    "FORMATS",
    "Detected",
    "Entry",
    "FileFormat",
    "Source",
    "detect",
    "detect_format",
    "folder_weights",
    "index_read",
    "open_source",
]

# The registry. Reading: each format's detector and source, tried in this order.
_READERS: tuple[tuple[str, Callable[[Location], bool], type[Source]], ...] = (
    ("dcp", is_dcp, DcpSource),
    ("safetensors", is_safetensors, SafetensorsSource),
    ("torch", is_torch_save, TorchSource),
)
# Writing: DCP is written by the pipeline's DCP target (parts and one commit); file formats are
# written a file at a time, as a single file or a sharded directory.
FILE_FORMATS: dict[str, FileFormat] = {f.kind: f for f in (safetensors_format.FORMAT, torch_format.FORMAT)}
FORMATS = tuple(kind for kind, _, _ in _READERS)


class Detected(NamedTuple):
    """A source's format as one look at it told (:func:`detect`), which :func:`open_source` takes
    as it is: ``kind`` (as :func:`detect_format`), ``where`` (its location, resolved once for
    reading: ``resolved_once``), ``folder`` (a Hugging Face style folder as looked at: its names
    and the file its config.json names; None for a file or a DCP directory)."""

    kind: str
    where: Location
    folder: Folder | None


def detect(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Detected:
    """The format of the source at ``path`` and what telling it looked at, for a job that decides
    by the format before it opens the source (``open_source(detected)``: no second look, so a
    folder's config.json is read once). Raises: as :func:`detect_format`."""
    where = resolved_once(locate(path, storage_options))
    kind, folder = _detected(where)
    return Detected(kind, where, folder)


def detect_format(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> str:
    """``"dcp"``, ``"safetensors"`` or ``"torch"``, from the files at ``path`` (a path or a URL).

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: ``path`` holds none of the formats (an uncommitted DCP directory included).
    """
    return _detected(locate(path, storage_options))[0]


def _detected(where: Location) -> tuple[str, Folder | None]:
    """:func:`detect_format` of ``where``, and the Hugging Face style folder it looked at to tell
    (None: a file, or a DCP directory), which the source opened from it takes as it is."""
    path = os.fspath(where)
    if not where.exists():
        _raise_unreachable(where, path)
    folder = read_folder(where) if where.is_dir() and not is_dcp(where) else None
    if folder is not None and (kind := folder_kind(where, folder)) is not None:
        return kind, folder  # what transformers loads from the folder, before any other weights in it
    for kind, holds, _ in _READERS:
        if holds(where):
            return kind, folder
    if where.is_dir() and not listdir(where):
        raise ValueError(f"cannot tell the format of {path}: the directory is empty (no checkpoint there)")
    if any(n.endswith(".distcp") for n in listdir(where)):
        raise ValueError(f"{path} has DCP shards but no .metadata: it is not a committed checkpoint")
    raise ValueError(
        f"cannot tell the format of {path}: expected a DCP directory (.metadata), a .safetensors file or a "
        "directory of them (model.safetensors.index.json), or a torch.save file (.pt, .pth, .bin) or "
        "a directory with pytorch_model.bin.index.json or pytorch_model.bin"
    )


def _raise_unreachable(where: Location, path: str) -> None:
    """Why nothing can be read at ``path``: not there, or (a local path) what ``stat`` says,
    such as a loop of symbolic links or a directory that may not be searched."""
    if isinstance(where, Path):
        try:
            os.stat(path)
        except OSError as failure:
            if failure.errno != errno.ENOENT:
                said = _STAT_FAILURES.get(failure.errno or 0, failure.strerror or str(failure))
                unreadable = OSError(f"cannot read {path}: {said}")
                unreadable.errno = failure.errno  # (in the message: words, not "[Errno 40]")
                raise unreadable from None
    raise FileNotFoundError(f"no such file or directory: {path}")


_STAT_FAILURES = {
    errno.ELOOP: "too many levels of symbolic links (a loop of links?)",
    errno.EACCES: "permission denied (a directory on the way may not be searched)",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.ENAMETOOLONG: "the name is too long",
}


def open_source(
    path: str | os.PathLike[str] | Detected,
    *,
    trust_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
    memory_limit: int | None = None,
) -> Source:
    """Open ``path`` (a path or a URL, or what :func:`detect` told of one) for reading, listing
    its tensors from headers only.

    ``trust_pickle`` lets values (DCP) and torch.save files that need ``weights_only=False`` be
    unpickled; without it they are refused with UnsafeCheckpointError (nothing runs).
    ``memory_limit``: the job's; a legacy torch.save file, loaded whole when opened, that is
    larger is refused (MemoryLimitExceeded) before it is read.
    """
    kind, where, folder = path if isinstance(path, Detected) else detect(path, storage_options)
    path = os.fspath(where)
    if kind == "torch":
        return TorchSource(
            path, storage_options=storage_options, trust_pickle=trust_pickle, memory_limit=memory_limit, folder=folder
        )
    if kind == "safetensors":
        return SafetensorsSource(path, storage_options=storage_options, trust_pickle=trust_pickle, folder=folder)
    return DcpSource(path, storage_options=storage_options, trust_pickle=trust_pickle)


def index_read(source: Source) -> Location | None:
    """The index a Hugging Face folder ``source`` was opened by (as its ``files`` were chosen:
    ``Source.index``); None where it read none: a file, a DCP directory, a folder read by its
    single ``model.safetensors`` or ``pytorch_model.bin`` (an index beside it is not read), or one
    with no index."""
    return source.index if source.kind in FILE_FORMATS else None


_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def folder_weights(source: Source) -> tuple[list[str], list[str]]:
    """The weight files and indexes of a local Hugging Face folder ``source``, by name: those its
    reads open (the file its config.json names first, by its name there: ``sub/w.safetensors``),
    and those at its top they do not (the other format's set, an older set beside
    ``model.safetensors``, an adapter), as the client leaves them too; ([], []) for any other source."""
    folder = source.location
    if source.kind not in FILE_FORMATS or isinstance(folder, Remote) or source.folder is None:
        return [], []
    index = index_read(source)
    read = {os.path.realpath(f) for f in [*source.files, *([index] if index is not None else [])]}
    names = [n for n in sorted(source.folder.listing) if not n.startswith(".") and n.endswith(_WEIGHTS)]
    opened = [n for n in names if os.path.realpath(folder / n) in read]
    below = (os.path.relpath(f, folder) for f in source.files)  # (shards an index names in a subfolder)
    opened += [n for n in below if "/" in n and not n.startswith("../")]
    named = source.folder.named_choice(folder)  # (valid: the source was opened by it)
    if named is not None and named.name not in opened:
        opened.insert(0, named.name)
    return opened, [n for n in names if n not in opened]
