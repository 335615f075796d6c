"""What a checkpoint owns, who is writing it, and what a dead save left behind.

Names: this save's id is in every file it creates (``__<task>_<save id>_0.distcp``, temporary
names ``.<name>.<save id>.tmp``, its owner record ``.parallel_dcp.owner.<save id>``). A
:class:`~parallel_dcp.storage.layout.Layout` says which files a checkpoint of one kind owns (what
an overwrite replaces); owner
records let the next save to a destination find and remove the files of a save whose process is
gone (:func:`find_leftovers`). The protocol that uses them: :mod:`parallel_dcp.storage.staging`.

Longer than 300 lines because owner records, the leftovers they find, and how a leftover's owner
is described (in inspect and in the cleanup's warning) are one job.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
import uuid
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from parallel_dcp._json import loads_json
from parallel_dcp.errors import (
    CorruptCheckpointError,
    InvalidDestinationError,
    plural,
    printable,
)
from parallel_dcp.storage.layout import (
    DCP_LAYOUT,
    MANIFEST_FILE,
    METADATA_FILE,
    Layout,
    committed_names,
    is_dcp_shard_name,
    listing,
    read_record,
    replaceable_name,
    sharded_layout,
    written_by_us,
)
from parallel_dcp.storage.location import Location, Remote, check_name
from parallel_dcp.storage.side_index import INDEX_FILE
from parallel_dcp.storage.side_index_read import index_save_id
from parallel_dcp.storage.side_trees import remove_tree

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
    "is_save_id",
    "listing",
    "new_save_id",
    "others_leftovers",
    "owner_name",
    "owner_record",
    "owner_uid",
    "protect_sources",
    "remove_path",
    "sharded_layout",
    "temp_name",
    "written_by_us",
]


LOCK_FILE = ".parallel_dcp.lock"
_OWNER_PREFIX = ".parallel_dcp.owner."
# The records a conversion keeps for resume=True (see parallel_dcp.storage.resume).
JOB_PREFIX = ".parallel_dcp.job."
DONE_PREFIX = ".parallel_dcp.done."


def new_save_id() -> str:
    return uuid.uuid4().hex[:12]


# The only ids a save has (new_save_id): a record naming anything else was not written by a save,
# and acts on nothing (an empty or short id would otherwise match other saves' names).
_SAVE_ID = re.compile(r"[0-9a-f]{12}")


def is_save_id(save_id: object) -> bool:
    """True for an id :func:`new_save_id` can give."""
    return isinstance(save_id, str) and _SAVE_ID.fullmatch(save_id) is not None


def temp_name(name: str, save_id: str) -> str:
    """The hidden name a file of this save is written under before its rename into ``name``."""
    return f".{name}.{save_id}.tmp"


def is_of_save(name: str, save_id: str) -> bool:
    """True for the names a save with this id writes (shards, temporary files, its owner file,
    the records kept for resume): exactly the shapes our writer gives, for a full save id, never a
    substring of another name."""
    if not is_save_id(save_id):
        return False
    return (
        re.fullmatch(rf"__[0-9]+_{save_id}_[0-9]+\.distcp", name) is not None
        or (name.startswith(".") and name.endswith(f".{save_id}.tmp") and len(name) > len(save_id) + 6)
        or name == owner_name(save_id)
        or name in (f"{JOB_PREFIX}{save_id}", f"{JOB_PREFIX}{save_id}.tmp")
        or name.startswith(f"{DONE_PREFIX}{save_id}.")
    )


def owner_name(save_id: str) -> str:
    return f"{_OWNER_PREFIX}{save_id}"


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a directory holding a committed DCP checkpoint (``.metadata``)."""
    return Path(path, METADATA_FILE).is_file()


# --- small helpers over a local Path or a Remote -------------------------------------------------


def remove_path(where: Location) -> None:
    if isinstance(where, Remote):
        where.remove()
    else:
        with contextlib.suppress(FileNotFoundError):
            if where.is_dir() and not where.is_symlink():
                if where.name.startswith(".") and where.name.endswith(".tmp"):
                    _remove_temporary_folder(where)  # a copied folder a dead save left (side_trees)
                return  # never another directory: a checkpoint's files are plain files
            where.unlink()


def _remove_temporary_folder(where: Path) -> None:
    """Remove a save's temporary folder, following no link (a swap meanwhile is left alone)."""
    with contextlib.suppress(OSError):
        parent = os.open(where.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            remove_tree(parent, where.name)
        finally:
            os.close(parent)


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


def describe_owner(leftover: Mapping[str, Any]) -> str:
    """Who left a leftover, in words, saying only what its record knows: ``pid 81 on vm, gone``,
    ``stopped on vm`` (a conversion that failed and kept its finished tasks), ``owner unknown``."""
    host, pid = leftover.get("host"), leftover.get("pid")
    where = f" on {printable(host)}" if isinstance(host, str) and host else ""
    if leftover.get("stopped"):
        return f"stopped{where}"
    if not isinstance(host, str) and not isinstance(pid, int):
        return "owner unknown: its record cannot be read"
    who = f"pid {pid}{where}" if isinstance(pid, int) and pid > 0 else f"owner unknown{where}"
    state = {True: "still running", False: "gone", None: "on another host"}[leftover.get("running")]
    return f"{who}, {state}"


def find_leftovers(where: Location, names: list[str] | None = None) -> list[dict[str, Any]]:
    """The saves that left files at ``where``: owner, whether it still runs, and its files.

    Files named by the committed checkpoint are never listed, whatever their name.
    """
    names = listing(where) if names is None else names
    live = committed_names(where, names)
    found = []
    for name in names:
        if not name.startswith(_OWNER_PREFIX):
            continue
        save_id = name[len(_OWNER_PREFIX) :]
        if not is_save_id(save_id):
            continue  # not a record a save writes: it acts on nothing
        try:
            record = loads_json(read_record(where / name))
            if not isinstance(record, dict):
                raise ValueError("not an object")
        except (ValueError, OSError):  # UnsafeCheckpointError (a planted symlink or FIFO) is a ValueError
            record = {"save_id": save_id}
        files = [n for n in names if is_of_save(n, save_id) and n not in live]
        replaces = record.get("replaces")
        if isinstance(replaces, list) and written_by_us(where / name):
            # a save killed after its commit: the old checkpoint's shards, none that a committed
            # checkpoint (of any layout) names, and only this user's
            for old in replaces:
                if (
                    isinstance(old, str)
                    and replaceable_name(old)
                    and old in names
                    and old not in live
                    and old not in files
                    and written_by_us(where / old)
                ):
                    with contextlib.suppress(CorruptCheckpointError):
                        files.append(check_name(old, where))
        if MANIFEST_FILE in names and MANIFEST_FILE not in live and _manifest_save_id(where) == save_id:
            files.append(MANIFEST_FILE)  # killed between the manifest and .metadata of a new checkpoint
        if (
            INDEX_FILE in names
            and INDEX_FILE not in live
            and not isinstance(where, Remote)
            and index_save_id(where / INDEX_FILE) == save_id
        ):
            files.append(INDEX_FILE)  # killed between the side index and .metadata of a new checkpoint
        found.append(
            {
                "save_id": save_id,
                "destination": record.get("destination"),
                "host": record.get("host"),
                "pid": record.get("pid"),
                "stopped": record.get("stopped") is True,
                "running": _owner_alive(record),
                "files": sorted(files),
                # A conversion that kept records for resume=True, and how many of its tasks finished.
                "resumable": f"{JOB_PREFIX}{save_id}" in files,
                "tasks_done": sum(1 for n in files if n.startswith(DONE_PREFIX) and not n.endswith(".tmp")),
            }
        )
    return found


def _manifest_save_id(where: Location) -> str | None:
    try:
        value = loads_json(read_record(where / MANIFEST_FILE)).get("save_id")
    except (ValueError, OSError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def clean_leftovers(where: Location, keep: str | None = None, destination: Location | None = None) -> None:
    """Remove the files of saves to ``where`` whose owner process is gone (one warning each), but
    those of save ``keep`` (the one a resumed conversion continues), and, given this save's
    ``destination``, a resumable conversion's to another one (a neighbouring file of the same
    directory: a save to ``dir/a.pt`` removed the finished tasks of a dead one to ``dir/b.pt``).
    Only this user's records and files (:func:`written_by_us`): another user's are left as they are."""
    for leftover in find_leftovers(where):
        if leftover["running"] is not False or leftover["save_id"] == keep:
            continue
        if not written_by_us(where / owner_name(leftover["save_id"])):
            continue  # another user's save (a shared directory): not ours to judge or remove
        other = leftover["destination"]
        if (
            destination is not None
            and leftover["resumable"]
            and isinstance(other, str)
            and other != os.fspath(destination)
        ):
            continue  # its own next run resumes or removes it
        files = [name for name in leftover["files"] if written_by_us(where / name)]
        for name in files:
            remove_path(where / name)
        remove_path(where / owner_name(leftover["save_id"]))
        warnings.warn(
            f"{where}: removed {plural(len(files), 'leftover file')} of save {leftover['save_id']} "
            f"({describe_owner(leftover)})"
            + (
                f"; it was a conversion with {plural(leftover['tasks_done'], 'finished task')}, which "
                "convert(..., resume=True) (--resume) would have kept"
                if leftover["resumable"] and leftover["tasks_done"]
                else ""
            ),
            stacklevel=4,
        )


def others_leftovers(where: Location, names: list[str]) -> str | None:
    """What another user's saves that did not finish left among ``names`` (files a save left and
    :func:`clean_leftovers` never removes: they are not this user's), said for a refusal to write
    beside them: ``the files uid 1001's conversion (save 0123456789ab, stopped on vm) left: 7
    files``; None when there are none."""
    parts = []
    for leftover in find_leftovers(where, names):
        owner = owner_name(leftover["save_id"])
        if written_by_us(where / owner) or leftover["running"] is True:
            continue
        kind = "conversion" if leftover["resumable"] else "save"
        count = plural(len(leftover["files"]) + 1, "file")
        parts.append(
            f"the files uid {owner_uid(where / owner)}'s {kind} (save {leftover['save_id']}, "
            f"{describe_owner(leftover)}) left: {count}"
        )
    return "; ".join(parts) or None


def owner_uid(path: Location) -> int | str:
    """The uid that owns ``path`` (``"unknown"`` when it cannot be read)."""
    try:
        return os.lstat(path).st_uid
    except OSError:
        return "unknown"


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
