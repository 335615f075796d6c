"""What a checkpoint owns, who is writing it, and what a dead save left behind.

Names: this save's id is in every file it creates (``__<task>_<save id>_0.distcp``, temporary
names ``.<name>.<save id>.tmp``, its owner record ``.parallel_dcp.owner.<save id>``). A
:class:`Layout` says which files a checkpoint of one kind owns (what an overwrite replaces); owner
records let the next save to a destination find and remove the files of a save whose process is
gone (:func:`find_leftovers`). The protocol that uses them: :mod:`parallel_dcp.storage.staging`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallel_dcp.errors import (
    CorruptCheckpointError,
    InvalidDestinationError,
)
from parallel_dcp.storage.location import Location, Remote, check_name
from parallel_dcp.storage.safe_files import read_small

__all__ = [
    "DCP_LAYOUT",
    "LOCK_FILE",
    "MANIFEST_FILE",
    "METADATA_FILE",
    "Layout",
    "clean_leftovers",
    "find_leftovers",
    "is_checkpoint",
    "is_dcp_shard_name",
    "is_of_save",
    "listing",
    "new_save_id",
    "owner_name",
    "owner_record",
    "protect_sources",
    "remove_path",
    "sharded_layout",
    "temp_name",
]


METADATA_FILE = ".metadata"
MANIFEST_FILE = ".parallel_dcp.json"
LOCK_FILE = ".parallel_dcp.lock"
_OWNER_PREFIX = ".parallel_dcp.owner."
# The records a conversion keeps for resume=True (see parallel_dcp.storage.resume).
JOB_PREFIX = ".parallel_dcp.job."
DONE_PREFIX = ".parallel_dcp.done."


def new_save_id() -> str:
    return uuid.uuid4().hex[:12]


def temp_name(name: str, save_id: str) -> str:
    """The hidden name a file of this save is written under before its rename into ``name``."""
    return f".{name}.{save_id}.tmp"


def is_of_save(name: str, save_id: str) -> bool:
    """True for the names a save with this id writes (shards, temporary files, its owner file,
    the records kept for resume)."""
    return (
        (name.startswith("__") and f"_{save_id}_" in name and name.endswith(".distcp"))
        or (name.startswith(".") and name.endswith(f".{save_id}.tmp"))
        or name == owner_name(save_id)
        or name in (f"{JOB_PREFIX}{save_id}", f"{JOB_PREFIX}{save_id}.tmp")
        or name.startswith(f"{DONE_PREFIX}{save_id}.")
    )


def owner_name(save_id: str) -> str:
    return f"{_OWNER_PREFIX}{save_id}"


@dataclass(frozen=True, slots=True)
class Layout:
    """How a checkpoint directory of one format looks: what marks it, and what it owns."""

    name: str
    markers: tuple[str, ...]
    owned_names: Callable[[Location, list[str]], set[str]]
    fixed_names: bool

    def holds_checkpoint(self, where: Location, names: list[str] | None = None) -> bool:
        names = listing(where) if names is None else names
        return any(marker in names for marker in self.markers)

    def owned(self, where: Location) -> set[str]:
        """The files the checkpoint at ``where`` owns (empty when there is none); each a plain name."""
        names = listing(where)
        if not self.holds_checkpoint(where, names):
            return set()
        return {check_name(n, where) for n in self.owned_names(where, names)}


# The names a checkpoint's shards can have, by layout. A name that ``.metadata`` or an index
# mentions is the checkpoint's only if it also has such a name: what an overwrite deletes is decided
# by the rule, never by a file in the destination alone (a damaged or crafted ``.metadata`` naming
# ``train_state.json`` as a shard must not get it deleted).
# DCP: ``__<rank>_<n>.distcp`` (FileSystemWriter) and ``__<task>_<save id>_<n>.distcp`` (ours).
_DCP_SHARD = re.compile(r"__[0-9]+_[0-9A-Za-z_]+\.distcp")


def is_dcp_shard_name(name: str) -> bool:
    """True for a name a DCP writer gives its shard files."""
    return _DCP_SHARD.fullmatch(name) is not None


def _shard_name_rule(suffixes: tuple[str, ...]) -> Callable[[str], bool]:
    """A Hugging Face shard name: visible, with the format's suffix."""
    return lambda name: not name.startswith(".") and name.endswith(suffixes) and "/" not in name


def _dcp_owned(where: Location, names: list[str]) -> set[str]:
    from parallel_dcp.storage.metadata import read_metadata  # metadata_io reads through this module's names

    metadata = read_metadata(where)
    mentioned = {str(info.relative_path) for info in (metadata.storage_data or {}).values()}
    shards = {name for name in mentioned if is_dcp_shard_name(name)}
    return {METADATA_FILE, *shards, *([MANIFEST_FILE] if MANIFEST_FILE in names else [])}


DCP_LAYOUT = Layout("DCP checkpoint", (METADATA_FILE,), _dcp_owned, fixed_names=False)


def sharded_layout(kind: str, index_name: str, single: str, suffixes: tuple[str, ...] | None = None) -> Layout:
    """The layout of a Hugging Face style directory: ``index_name`` names its shards, and of those
    only names with one of ``suffixes`` (default: ``single``'s) are the checkpoint's."""
    is_shard = _shard_name_rule(suffixes or (os.path.splitext(single)[1],))

    def owned(where: Location, names: list[str]) -> set[str]:
        found = {n for n in (index_name, single, MANIFEST_FILE) if n in names}
        if index_name in names:
            try:
                shards = json.loads(_read_record(where / index_name))["weight_map"].values()
                mentioned = {check_name(n, where / index_name) for n in shards}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CorruptCheckpointError(f"{where / index_name} is not a readable index: {exc}") from exc
            found |= {n for n in mentioned if is_shard(n)}
        return found

    return Layout(f"{kind} checkpoint directory", (index_name, single), owned, fixed_names=True)


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a directory holding a committed DCP checkpoint (``.metadata``)."""
    return Path(path, METADATA_FILE).is_file()


# --- small helpers over a local Path or a Remote -------------------------------------------------


def listing(where: Location) -> list[str]:
    if isinstance(where, Remote):
        return where.listdir()
    return sorted(os.listdir(where)) if where.is_dir() else []


def remove_path(where: Location) -> None:
    if isinstance(where, Remote):
        where.remove()
    else:
        with contextlib.suppress(FileNotFoundError):
            if where.is_dir() and not where.is_symlink():
                return  # never a directory: a checkpoint's files are plain files
            where.unlink()


def _process_start(pid: int) -> float | None:
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def owner_record(save_id: str, destination: Location) -> dict[str, Any]:
    """Who writes: enough for a later save to tell whether this one is still running."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "start": _process_start(os.getpid()),
        "save_id": save_id,
        "destination": os.fspath(destination),
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _owner_alive(record: Mapping[str, Any]) -> bool | None:
    """True/False for an owner on this host; None when it ran elsewhere (it cannot be told)."""
    if record.get("host") != socket.gethostname():
        return None
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    start = _process_start(pid)
    return start is not None and (record.get("start") is None or abs(start - float(record["start"])) < 1.0)


def find_leftovers(where: Location, names: list[str] | None = None) -> list[dict[str, Any]]:
    """The saves that left files at ``where``: owner, whether it still runs, and its files.

    Files named by the committed checkpoint are never listed, whatever their name.
    """
    names = listing(where) if names is None else names
    live: set[str] = set()
    if METADATA_FILE in names:
        with contextlib.suppress(Exception):  # a damaged .metadata protects nothing, and is reported elsewhere
            live = DCP_LAYOUT.owned(where)
    found = []
    for name in names:
        if not name.startswith(_OWNER_PREFIX):
            continue
        save_id = name[len(_OWNER_PREFIX) :]
        try:
            record = json.loads(_read_record(where / name))
            if not isinstance(record, dict):
                raise ValueError("not an object")
        except (ValueError, OSError):  # UnsafeCheckpointError (a planted symlink or FIFO) is a ValueError
            record = {"save_id": save_id}
        files = [n for n in names if is_of_save(n, save_id) and n not in live]
        replaces = record.get("replaces")
        if isinstance(replaces, list):  # a save killed after its commit: the old checkpoint's shards
            for old in replaces:
                if isinstance(old, str) and _replaceable(old) and old in names and old not in live and old not in files:
                    with contextlib.suppress(CorruptCheckpointError):
                        files.append(check_name(old, where))
        if MANIFEST_FILE in names and MANIFEST_FILE not in live and _manifest_save_id(where) == save_id:
            files.append(MANIFEST_FILE)  # killed between the manifest and .metadata of a new checkpoint
        found.append(
            {
                "save_id": save_id,
                "host": record.get("host"),
                "pid": record.get("pid"),
                "running": _owner_alive(record),
                "files": sorted(files),
                # A conversion that kept records for resume=True, and how many of its tasks finished.
                "resumable": f"{JOB_PREFIX}{save_id}" in files,
                "tasks_done": sum(1 for n in files if n.startswith(DONE_PREFIX) and not n.endswith(".tmp")),
            }
        )
    return found


def _replaceable(name: str) -> bool:
    """A name an owner record's ``replaces`` may list: one some layout gives a checkpoint's files.
    An owner record is a file in the destination, so it may be crafted: ``replaces`` listing
    ``train_state.json`` must not get it deleted."""
    return (
        name in (METADATA_FILE, MANIFEST_FILE)
        or is_dcp_shard_name(name)
        or _shard_name_rule((".safetensors", ".bin", ".pt", ".pth", ".index.json"))(name)
    )


def _read_record(path: Location) -> bytes:
    """A small file a save wrote (owner record, manifest): local ones never through a symlink or
    from a FIFO (which would block)."""
    if isinstance(path, Remote):
        return path.read_bytes()
    return read_small(path, 64 * 2**20)


def _manifest_save_id(where: Location) -> str | None:
    try:
        value = json.loads(_read_record(where / MANIFEST_FILE)).get("save_id")
    except (ValueError, OSError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def clean_leftovers(where: Location, keep: str | None = None) -> None:
    """Remove the files of saves to ``where`` whose owner process is gone (one warning each), but
    those of save ``keep`` (the one a resumed conversion continues)."""
    for leftover in find_leftovers(where):
        if leftover["running"] is not False or leftover["save_id"] == keep:
            continue
        for name in leftover["files"]:
            remove_path(where / name)
        remove_path(where / owner_name(leftover["save_id"]))
        warnings.warn(
            f"{where}: removed {len(leftover['files'])} leftover files of save {leftover['save_id']} "
            f"(pid {leftover['pid']} on {leftover['host']}, no longer running)"
            + (
                f"; it was a conversion with {leftover['tasks_done']} finished tasks, which "
                "convert(..., resume=True) (--resume) would have kept"
                if leftover["resumable"] and leftover["tasks_done"]
                else ""
            ),
            stacklevel=4,
        )


def protect_sources(where: Location, names: Iterable[str], protect: Sequence[str]) -> None:
    """Refuse to replace or delete a file that is one of the job's source files."""
    if isinstance(where, Remote):
        urls = {p.rstrip("/") for p in protect}
        for name in names:
            if (where / name).url.rstrip("/") in urls:
                raise InvalidDestinationError(f"refusing to replace {where / name}: it is a file of the source")
        return
    sources: set[tuple[int, int]] = set()
    for p in protect:  # by inode: a link or another spelling of the same file is the same file
        with contextlib.suppress(OSError):
            st = os.stat(p)
            sources.add((st.st_dev, st.st_ino))
    for name in names:
        try:
            st = os.stat(where / name)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in sources:
            raise InvalidDestinationError(f"refusing to replace or delete {where / name}: it is a file of the source")


# --- the protocol ----------------------------------------------------------------------------
