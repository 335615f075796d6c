"""Which files a source reads: a file, or the files the client loads from a Hugging Face style folder.

    read_folder(path)       one listing of the folder, and one read of its config.json for the
       │                    file it names (``transformers_weights``), by the one rule for a
       │                    source's small files (storage.safe_reader.read_in_tree)
       ▼
    folder_kind(...)        detect_format: the format of what the client loads from it
    chosen_files(...)       the source: the files its reads open, and the index that named them

What a folder means is the client's choice (:mod:`.folder_choice`): the file its ``config.json``
names, else the first of transformers' names that is a file, else every file of the format's
suffix. ``open_source`` hands the folder it read to detect the format on to the source it opens,
so one open lists the folder and reads its ``config.json`` once.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from parallel_dcp._json import loads_json
from parallel_dcp.errors import CorruptCheckpointError, UnsafeCheckpointError
from parallel_dcp.formats.folder_choice import (
    Choice,
    client_choice,
    client_names,
    explicit_choice,
    fallback_names,
    mixed_sets,
    named_kind,
)
from parallel_dcp.formats.shard_index import index_names
from parallel_dcp.storage.location import Location, Remote, listdir
from parallel_dcp.storage.safe_files import regular_size, resolve_in_tree, source_tree
from parallel_dcp.storage.safe_reader import read_in_tree

__all__ = ["Chosen", "Folder", "chosen_files", "files_among", "folder_kind", "read_folder"]

_CONFIG = "config.json"
_CONFIG_MAX_BYTES = 16 * 2**20  # a model's config.json: the largest known are a few hundred KB


@dataclass(frozen=True, slots=True)
class Folder:
    """A folder source as one look at it found it.

    Attributes:
        listing: its names.
        named: what its ``config.json`` gives as ``transformers_weights``, as found there (None:
            nothing, no config.json, one that cannot be read, or a folder on object storage,
            which transformers does not load from).
    """

    listing: tuple[str, ...]
    named: object = None

    def named_choice(self, path: Location) -> Choice | None:
        """The file ``config.json`` names (:func:`~.folder_choice.explicit_choice`); None where none is.

        Raises:
            CorruptCheckpointError, UnsafeCheckpointError: as ``explicit_choice``.
        """
        return None if self.named is None else explicit_choice(self.named, os.fspath(path / _CONFIG))


def read_folder(path: Location) -> Folder | None:
    """The folder at ``path`` as it is now (:class:`Folder`); None where ``path`` is no folder."""
    if not path.is_dir():
        return None
    listing = tuple(listdir(path))
    return Folder(listing, _named_weights(path, listing))


def _named_weights(path: Location, listing: tuple[str, ...]) -> object:
    """``transformers_weights`` of the ``config.json`` of a local folder, as found (transformers 5
    loads the file it names before any of its usual names; JSON null: none, as transformers takes
    it); None where there is none or it cannot be read."""
    if isinstance(path, Remote) or _CONFIG not in listing:
        return None
    try:  # by the one rule for a source's small files; one that cannot be read names nothing here
        # (a deeply nested one is a ValueError too: its real reader, the copy, says so clearly)
        config = loads_json(read_in_tree(path / _CONFIG, source_tree(path), limit=_CONFIG_MAX_BYTES))
    except UnsafeCheckpointError as refused:
        # A link out of the folder (a shared config) or no regular file: transformers follows or
        # fails on it; passed over, the folder was read as if it named nothing (review s17 F1).
        raise UnsafeCheckpointError(
            f"{refused} (config.json may name the weights transformers loads from the folder, its "
            "transformers_weights: it must be read to know which files the folder means; copy the file into "
            "the folder in place of the link)"
        ) from None
    except (ValueError, OSError):
        return None
    return config.get("transformers_weights") if isinstance(config, dict) else None


def folder_kind(path: Location, folder: Folder) -> str | None:
    """The format of what the client loads from the folder ``path``: the file its config.json
    names (a name transformers refuses included: the source refuses it by name), else the first
    of transformers' names that is a file; None where neither is (the format is told otherwise)."""
    if folder.named is not None:
        return named_kind(folder.named)
    choice = client_choice(files_among(path, client_names(folder.listing)))
    return choice.kind if choice is not None else None


def files_among(path: Location, names: Iterable[str]) -> list[str]:
    """Those of ``names`` in the folder ``path`` that are files, where they lead (a link within the
    folder's tree or out of it: checked when read), as transformers asks (``os.path.isfile``): a
    dangling link or a folder by a client's name is passed over, as the client passes it over."""
    if isinstance(path, Remote):
        return list(names)
    return [n for n in names if os.path.isfile(path / n)]


class Chosen(NamedTuple):
    """What a source reads: its files (local ones as where they lead, never a link), the index
    whose ``weight_map`` named them (None: none was read), and the folder as it was looked at."""

    files: list[str]
    index_file: Location | None
    folder: Folder | None


def chosen_files(
    path: Location, index_name: str, suffix: str | None = None, lone: str | None = None, folder: Folder | None = None
) -> Chosen:
    """The files of a single-file source, or of a folder (``folder``: as :func:`read_folder` found
    it, or None to look now): what the real client loads from it. The file its ``config.json``
    names (``transformers_weights``, a file or an index, anywhere below it); else the file named
    ``lone`` (``model.safetensors``, as Hugging Face writes a directory of one shard) before the
    shards ``index_name`` names; else (neither there) every file with ``suffix``
    (:func:`~parallel_dcp.formats.folder_choice.fallback_names`).

    Raises:
        FileNotFoundError: the index names a shard that does not exist; the file config.json names
            is not there (transformers fails on the folder too).
        CorruptCheckpointError: the index is unreadable or names a file outside the directory; a
            name transformers refuses in config.json; two sets of weights and no index.
        UnsafeCheckpointError: config.json names a file by an absolute path or with ``..``, or one
            that leads out of the folder's tree; a link out of the tree, or not a regular file.
    """
    if not path.is_dir():  # the file the user named (through any link: the user chose it)
        if isinstance(path, Remote):
            return Chosen([os.fspath(path)], None, None)
        real = os.path.realpath(path)
        if os.path.exists(real) and not stat.S_ISREG(os.stat(real).st_mode):  # (a FIFO would block the open)
            raise UnsafeCheckpointError(f"{path} is not a regular file: no checkpoint is read from it")
        return Chosen([real], None, None)
    if folder is None:
        folder = read_folder(path)
        assert folder is not None  # (a folder: just seen)
    listing = folder.listing
    index: Location | None = None
    named = folder.named_choice(path)
    if named is not None:
        chosen = _named_file(path, named.name)
        if not named.sharded:
            return Chosen([os.fspath(chosen)], None, folder)
        index = chosen  # (its shards are named relative to the folder, as transformers reads them)
        names = index_names(chosen)
    else:
        choice = client_choice(files_among(path, (n for n in listing if n in (index_name, lone))))
        if choice is not None and not choice.sharded:
            names = [choice.name]
        elif choice is not None or suffix is None:
            index = path / index_name
            names = index_names(index)
        else:
            names = fallback_names(listing, suffix)
            if (sets := mixed_sets(names)) is not None:
                raise CorruptCheckpointError(
                    f"{path} holds two sets of weights and no index that says which is the model: "
                    f"{', '.join(sets[0])} (shards whose index is not there) and {', '.join(sets[1])}; "
                    "transformers loads neither from it. Convert one of them: the file itself, or a folder "
                    "holding one set (with its index)"
                )
    missing = [n for n in names if n not in listing and ("/" not in n or not os.path.lexists(path / n))]
    if missing:
        raise FileNotFoundError(f"{path}: the index names shards that do not exist: {', '.join(missing)}")
    if isinstance(path, Remote):
        return Chosen([os.fspath(path / n) for n in names], index, folder)
    return Chosen([os.fspath(_in_tree(path / n, source_tree(path))) for n in names], index, folder)


def _named_file(folder: Location, name: str) -> Path:
    """Where the file ``name`` (relative, no ``..``: checked) that the local ``folder``'s
    config.json names leads: a regular file within the folder's tree, given as ``folder / name``
    where no link is on its way, else as where it leads (as :func:`_in_tree` gives a shard); a
    subfolder that is a link out of the tree is refused as a file link out is.

    Raises:
        UnsafeCheckpointError: it leads out of the tree, or is not a regular file.
        FileNotFoundError: nothing is there (transformers fails on such a folder too).
    """
    assert isinstance(folder, Path)  # (a folder on object storage names nothing: _named_weights)
    where = folder / name
    said = f"{folder / _CONFIG} names transformers_weights {name!r}"
    real = Path(os.path.realpath(where))
    tree = source_tree(folder)
    if os.path.commonpath([tree, real]) != os.fspath(tree):
        raise UnsafeCheckpointError(
            f"{said}, which leads out of {tree} (to {real}); refusing to follow it (nothing was read or written)"
        )
    if not os.path.lexists(real):
        leads = f" (it leads to {real})" if real != where else ""
        raise FileNotFoundError(
            f"{said}, which does not exist{leads}: transformers fails to load this folder too (nothing was "
            "read or written). Fix config.json, or convert a weights file itself"
        )
    if os.path.isdir(real):
        raise CorruptCheckpointError(
            f"{said}, which is a folder, not a weights file: transformers fails to load this folder too "
            "(nothing was read or written)"
        )
    regular_size(real)  # (a FIFO or a device: refused by name)
    return where if os.fspath(real) == os.path.abspath(where) else real


def _in_tree(file: Path, tree: Path) -> Path:
    """A shard of a local directory by the one rule for reading: a link only within the source's
    tree (a Hugging Face cache snapshot's links into ``blobs/``), given as where it leads, so every
    reader (the library's mmap, O_DIRECT, torch.load) opens a regular file that is no link, the
    same way in every io mode.

    Raises:
        UnsafeCheckpointError: a link leading out of the tree, or not a regular file (a FIFO).
    """
    target = resolve_in_tree(file, tree)
    try:
        regular_size(target)
    except UnsafeCheckpointError:
        if target == file:
            raise
        raise UnsafeCheckpointError(f"{file} leads to {target}, which is not a regular file") from None
    return target
