"""The non-weight folders of a Hugging Face directory (``1_Pooling/``, ``2_Normalize/``), copied too.

    source dir ── each folder below it (not hidden), walked without following a link out ──▶
        {"1_Pooling/config.json": path, "2_Normalize/...": path}   (added to the files to copy)

sentence-transformers' ``modules.json`` names module folders, each with its own ``config.json``;
without them a converted folder does not load. The rules are those of the files beside the weights
(:mod:`parallel_dcp.jobs.copy_files`): hidden names are never copied, and weight files (of any
framework) only inside a module folder ``modules.json`` names (``2_Dense/model.safetensors``: that
module's own weights, which the conversion does not touch, copied as they are; a folder no module
names, such as a release's ``original/`` consolidated weights, keeps its weights out); a symlink is
followed only when it stays inside the source's tree, and a symlink out of it, or anything that is
not a regular file or a folder (a FIFO, a device), is refused before anything is written (the tree
is the source folder, or for a snapshot of a Hugging Face cache its repository folder, whose
``blobs/`` the snapshot's files link into). A link to a folder inside the tree is not walked (its
folder is copied where it is). The files are read at the commit by
:func:`~parallel_dcp.jobs.copy_files.read_copies` (the one rule for reading them) and written new
below the destination by :mod:`parallel_dcp.storage.side_trees`. Local sources only: object storage
has no folders to walk safely here, so a remote source's folders are not copied.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

from parallel_dcp._json import loads_json
from parallel_dcp.errors import UnsafeCheckpointError, printable
from parallel_dcp.storage.layout import MANIFEST_FILE, METADATA_FILE
from parallel_dcp.storage.pinned_paths import pinned_path
from parallel_dcp.storage.safe_files import resolve_in_tree, source_tree
from parallel_dcp.storage.safe_reader import open_bounded

__all__ = ["MAX_DEPTH", "MAX_FILES", "folder_files", "module_folders"]

MAX_DEPTH = 8  # folders below the source: deeper is not a model's side folder
MAX_FILES = 10_000  # files in all of them
_MODULES_JSON_LIMIT = 1 << 20  # bytes: a list of a few modules


def module_folders(modules_json: object) -> frozenset[str]:
    """The top-level folders sentence-transformers' ``modules.json`` names as module paths
    (``{"1_Pooling", "2_Dense"}``), read by the one rule from where the side files' choice put it
    (a pinned local path); empty for no file, a remote one, or one that is not a list of modules
    (then no folder's weights are copied, which is the rule without modules.json)."""
    if not isinstance(modules_json, Path):
        return frozenset()
    with open_bounded(modules_json, no_links=True) as stream:
        data = stream.read(_MODULES_JSON_LIMIT + 1)
    try:
        modules = loads_json(data) if len(data) <= _MODULES_JSON_LIMIT else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return frozenset()
    if not isinstance(modules, list):
        return frozenset()
    paths = (module.get("path") for module in modules if isinstance(module, dict))
    return frozenset(path.strip("/").split("/")[0] for path in paths if isinstance(path, str) and path.strip("/"))


# Top-level folders that are a training run's by-products, not the model's: the Hugging Face
# Trainer's intermediate checkpoints (``checkpoint-500/``, whole models of their own) and its
# TensorBoard logs (``runs/``). Copying them would bloat every converted model, or refuse the
# conversion on the copy limits.
def _run_folder(name: str) -> bool:
    return name == "runs" or (name.startswith("checkpoint-") and name[len("checkpoint-") :].isdigit())


def _holds_checkpoint(folder: Path) -> bool:
    """A folder that is a checkpoint of ours or a DCP one (its manifest or ``.metadata``), not a
    model's side folder: a sentence-transformers module holds neither."""
    return any(os.path.lexists(folder / name) for name in (MANIFEST_FILE, METADATA_FILE))


def _resolve(path: Path, tree: Path) -> Path | None:
    """``path`` itself, or where a symlink leads inside ``tree`` (the one rule of
    :func:`~parallel_dcp.storage.safe_files.resolve_in_tree`); None for a link to a folder inside
    the tree (not walked twice).

    Raises:
        UnsafeCheckpointError: a symlink leading out of the tree, or a loop.
    """
    if not path.is_symlink():
        return path
    real = resolve_in_tree(path, tree)
    return None if real.is_dir() else real


def folder_files(
    where: str | os.PathLike[str], copyable: Callable[[str], bool], *, weights_in: frozenset[str] = frozenset()
) -> dict[str, Path]:
    """Relative path (``"1_Pooling/config.json"``) -> where to read it, for every file to copy
    in the folders below the directory ``where`` (its top-level files are not listed here);
    ``copyable(name)`` is the rule of the files beside the weights (no hidden name, no weights).
    Below the top-level folders named in ``weights_in`` (sentence-transformers module folders:
    :func:`module_folders`) weight files are copied too; hidden names never are.

    Raises:
        UnsafeCheckpointError: a symlink out of the source, or a file that is not a regular file.
        ValueError: more than :data:`MAX_FILES` files, or folders deeper than :data:`MAX_DEPTH`.
    """
    root = Path(where)
    tree = source_tree(root)
    found: dict[str, Path] = {}

    def walk(folder: Path, prefix: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise ValueError(
                f"{printable(str(folder))} is more than {MAX_DEPTH} folders deep: not a model's side folder; "
                "convert with --no-copy-files and copy it yourself"
            )
        in_module = prefix.split("/")[0] in weights_in
        for name in sorted(os.listdir(folder)):
            allowed = copyable(name) or (in_module and not name.startswith("."))
            if not allowed or (not prefix and not os.path.isdir(folder / name)):
                continue  # a top-level file: parallel_dcp.jobs.copy_files chooses those
            if not prefix and _run_folder(name):
                continue  # a training run's checkpoint or logs, not a module of the model
            path = _resolve(folder / name, tree)
            if path is None:
                continue
            mode = os.stat(path, follow_symlinks=False).st_mode
            relative = f"{prefix}/{name}" if prefix else name
            if stat.S_ISDIR(mode):
                if _holds_checkpoint(path):
                    continue  # an output written into the source (convert src src/out): copied again, it nests
                walk(path, relative, depth + 1)
            elif stat.S_ISREG(mode):
                found[relative] = pinned_path(path, tree)  # read at the commit with no link on its way
                if len(found) > MAX_FILES:
                    raise ValueError(
                        f"the folders of {printable(str(root))} hold more than {MAX_FILES} files: convert with "
                        "--no-copy-files and copy them yourself"
                    )
            else:
                raise UnsafeCheckpointError(
                    f"{printable(str(folder / name))} is not a regular file (a FIFO, socket or device); refusing "
                    "to copy it (nothing was written)"
                )

    walk(root, "", 0)
    return found
