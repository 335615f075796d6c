"""``inspect``: what a checkpoint holds, from headers and metadata only (no tensor data read)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from parallel_dcp.errors import CorruptCheckpointError, ParallelDCPError, plural, printable
from parallel_dcp.formats import index_read, open_source, safetensors_format, torch_format
from parallel_dcp.storage.location import Location, file_size, listdir, locate
from parallel_dcp.storage.manifest import MANIFEST_FILE
from parallel_dcp.storage.ownership import METADATA_FILE, describe_owner, find_leftovers
from parallel_dcp.storage.side_index_read import index_state
from parallel_dcp.storage.side_index_use import NOT_ASKED, IndexUse

__all__ = ["describe", "describe_key_list", "inspect_checkpoint", "side_index"]

_LARGEST = 10
_INDEXES = (safetensors_format.INDEX_NAME, torch_format.INDEX_NAME)


def _size(path: Location) -> int | None:
    try:
        return file_size(path)
    except FileNotFoundError:
        return None


def _uncommitted(path: Location, names: list[str] | None, leftovers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The report of a destination that holds no committed output, only what saves left: DCP shards
    without ``.metadata``, or the files of an interrupted save of any kind (a sharded directory's
    staged shards and resume records, a single file's hidden temporary); None when there is a
    committed output to describe."""
    if names is not None:  # a directory
        if METADATA_FILE in names or (_committed_names(names) and not any(n.endswith(".distcp") for n in names)):
            return None
        files = [n for n in names if n.endswith(".distcp")]
        if not files and not leftovers:
            return None
        kind = "dcp" if files else _kind_of(n for left in leftovers for n in left["files"])
    else:  # a single file: nothing at its name, but the files of saves to it beside it
        if path.exists() or not leftovers:
            return None
        files = []
        kind = _kind_of([path.name])
    return {
        "path": str(path),
        "format": kind,
        "committed": False,
        "keys": 0,
        "tensors": 0,
        "total_bytes": 0,
        "dtypes": {},
        "largest": [],
        "key_list": [],
        "files": [{"name": n, "size": _size(path / n)} for n in files],
        "manifest": names is not None and MANIFEST_FILE in names,
        "values": [],
        "damaged": None,
        "side_index": None,
        "leftovers": leftovers,
    }


def _committed_names(names: list[str]) -> bool:
    """A marker of a committed sharded or single-shard directory (an index, or a visible shard)."""
    shard = (safetensors_format.shard_names(1)[0], torch_format.shard_names(1)[0])
    return any(n in _INDEXES or n in shard or (not n.startswith(".") and n.endswith(".safetensors")) for n in names)


def _kind_of(names: Iterable[str]) -> str:
    """The output kind the (temporary) names of a save's files tell, or "unknown"."""
    for name in names:
        base = name.removesuffix(".tmp").rsplit(".", 1)[0] if name.endswith(".tmp") else name
        if base.endswith(".distcp") or base.endswith(METADATA_FILE):
            return "dcp"
        if base.endswith(".safetensors") or base.endswith(".safetensors.index.json"):
            return "safetensors"
        if base.endswith(torch_format.SUFFIXES) or base.endswith(".bin.index.json"):
            return "torch"
    return "unknown"


def side_index(where: Location, kind: str, memory_limit: int | None = None) -> IndexUse | None:
    """Whether the DCP checkpoint at ``where`` has a side index valid for its ``.metadata``, as a
    ``load(into=)`` would find it now (None: not a DCP checkpoint, or its ``.metadata`` unreadable:
    the checkpoint's own checks say why)."""
    if kind != "dcp":
        return None
    if not isinstance(where, Path):
        return IndexUse(NOT_ASKED, "object storage: only a local checkpoint's index is read")
    try:
        return index_state(where, memory_limit)
    except (ParallelDCPError, OSError):
        return None


def _file_leftovers(path: Location) -> list[dict[str, Any]]:
    """The leftovers beside a single-file output that are of saves to it: their owner record names
    it, or (no readable record) their files carry its name. (A save killed before its temporary
    file existed left only its records, which do not.)"""
    parent = path.parent
    prefix = f".{path.name}."
    mine = os.fspath(path)
    return [
        left
        for left in find_leftovers(parent, listdir(parent))
        if left["destination"] == mine
        or (not isinstance(left["destination"], str) and any(n.startswith(prefix) for n in left["files"]))
    ]


def inspect_checkpoint(
    path: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    *,
    trust_pickle: bool = False,
    keys: str | Sequence[str] | None = None,
) -> dict[str, Any]:
    """Format, keys, bytes, dtypes, largest tensors, files and whether the checkpoint is committed.

    ``key_list`` holds every key (``keys``: only those these patterns select, as convert's
    ``keys`` select them) in the source's order, each ``{"key", "kind": "tensor"|"value",
    "dtype", "shape", "bytes"}`` (a value's dtype and shape are None; its bytes are its stored size).

    A DCP directory with shards but no ``.metadata`` is reported as ``committed: False`` (a save
    that never finished) instead of raising. A committed checkpoint whose files are missing or
    shorter than its ``.metadata`` records stays ``committed: True``, with ``damaged`` saying which
    (None when nothing is). Non-tensor values are listed with their
    stored size (``values``), never unpickled. ``leftovers`` lists files of saves that did not
    finish (their owner, whether it still runs, their files).

    Raises:
        FileNotFoundError / ValueError: nothing at ``path``, or not a known format.
        CorruptCheckpointError / UnsafeCheckpointError: a damaged or malicious ``.metadata``.
        ValueError: ``keys`` select nothing (the checkpoint's first keys are named).
    """
    from parallel_dcp.jobs.convert import select_keys

    where = locate(path, storage_options)
    names = listdir(where) if where.is_dir() else None
    leftovers = find_leftovers(where, names) if names is not None else _file_leftovers(where)
    uncommitted = _uncommitted(where, names, leftovers)
    if uncommitted is not None:
        return uncommitted
    source = open_source(path, storage_options=storage_options, trust_pickle=trust_pickle)
    damaged = None
    try:
        source.check()
    except CorruptCheckpointError as exc:
        damaged = str(exc)
    dtypes: dict[str, dict[str, int]] = {}
    for entry in source.entries.values():
        slot = dtypes.setdefault(str(entry.dtype).removeprefix("torch."), {"tensors": 0, "bytes": 0})
        slot["tensors"] += 1
        slot["bytes"] += entry.nbytes
    largest = sorted(source.entries.values(), key=lambda e: e.nbytes, reverse=True)[:_LARGEST]
    root = os.fspath(where).rstrip("/") + "/"
    files: list[dict[str, Any]] = [
        {
            "name": f.removeprefix(root) if names is not None else f.rsplit("/", 1)[-1],
            "size": _size(locate(f, storage_options)),
        }
        for f in source.files
    ]
    # A sharded directory's index is part of it (convert counts it among the files it wrote).
    # (the one read: not an index beside a model.safetensors, nor the other format's)
    files += [{"name": index.name, "size": _size(index)} for index in [index_read(source)] if index is not None]
    missing = [r["name"] for r in files if r["size"] is None]
    if damaged is None and missing:
        damaged = f"{plural(len(missing), 'file')} it names missing: {', '.join(missing)}"
    try:
        listed = select_keys(source, keys)
    finally:
        storage = _stored(source)
        source.close()
    return storage | {
        "path": os.fspath(where),
        "format": source.kind,
        "committed": True,  # its commit marker is there; ``damaged`` says whether its files hold
        "damaged": damaged,
        "keys": len(source.entries) + len([k for k in source.values if k not in source.entries]),
        "tensors": len(source.entries),
        "total_bytes": source.total_bytes(),
        "dtypes": dtypes,
        "largest": [
            {"key": e.key, "dtype": str(e.dtype).removeprefix("torch."), "shape": list(e.shape), "bytes": e.nbytes}
            for e in largest
        ],
        "files": files,
        "manifest": names is not None and MANIFEST_FILE in names,
        "values": [{"key": k, "bytes": source.value_bytes(k)} for k in source.values if k not in source.entries],
        "key_list": [_listed(source, k) for k in listed],
        "side_index": use.as_dict() if (use := side_index(where, source.kind)) is not None else None,
        "leftovers": leftovers,
    }


def _listed(source: Any, key: str) -> dict[str, Any]:
    entry = source.entries.get(key)
    if entry is None:
        return {"key": key, "kind": "value", "dtype": None, "shape": None, "bytes": source.value_bytes(key)}
    dtype = str(entry.dtype).removeprefix("torch.")
    return {"key": key, "kind": "tensor", "dtype": dtype, "shape": list(entry.shape), "bytes": entry.nbytes}


def _stored(source: Any) -> dict[str, Any]:
    """A DCP checkpoint's stored bytes beside its logical ones, from ``.metadata`` alone:
    ``stored_bytes`` (every record as stored), ``compressed`` (records stored through zstd),
    ``ratio`` (tensors' stored bytes / their logical bytes; None without tensors)."""
    metadata = getattr(source, "metadata", None)
    infos = getattr(metadata, "storage_data", None) or {}
    tensor_keys = set(source.entries)
    stored = sum(int(info.length) for info in infos.values())
    tensor_stored = sum(int(info.length) for index, info in infos.items() if index.fqn in tensor_keys)
    logical = sum(e.nbytes for e in source.entries.values())
    compressed = sum(1 for info in infos.values() if getattr(info, "transform_descriptors", None))
    if metadata is None:
        return {}
    return {
        "stored_bytes": stored,
        "compressed_records": compressed,
        "records": len(infos),
        "ratio": round(tensor_stored / logical, 4) if logical else None,
    }


def describe(info: dict[str, Any]) -> str:
    """A short human-readable summary of :func:`inspect_checkpoint`'s result."""
    from parallel_dcp.engine.memory import format_bytes

    lines = [
        f"{printable(info['path'])}: {info['format']}, {'committed' if info['committed'] else 'NOT committed'}"
        + (f", DAMAGED: {printable(info['damaged'])}" if info.get("damaged") else ""),
        f"  {plural(info['keys'], 'key')} ({plural(info['tensors'], 'tensor')}), {format_bytes(info['total_bytes'])}, "
        f"{plural(len(info['files']), 'file')}" + (", manifest" if info["manifest"] else ""),
    ]
    if info.get("compressed_records"):  # an uncompressed checkpoint stores what it holds: nothing to say
        ratio = f", stored/logical {info['ratio']:.3f}" if info["ratio"] is not None else ""
        zstd = f", {info['compressed_records']} of {info['records']} records zstd" if info["compressed_records"] else ""
        lines.append(
            f"  stored {format_bytes(info['stored_bytes'])} for {format_bytes(info['total_bytes'])}{ratio}{zstd}"
        )
    if info.get("side_index") is not None:  # what a load(into=) reads its plan from
        lines.append(f"  {printable(_index_state(info['side_index']))}")
    for dtype, slot in sorted(info["dtypes"].items(), key=lambda kv: -kv[1]["bytes"]):
        tensors = "tensor " if slot["tensors"] == 1 else "tensors"
        lines.append(f"  {dtype:<14}{slot['tensors']:>8} {tensors} {format_bytes(slot['bytes']):>12}")
    if info["largest"]:
        lines.append("  largest:")
        for e in info["largest"]:
            lines.append(f"    {printable(e['key'])}  {e['dtype']} {tuple(e['shape'])}  {format_bytes(e['bytes'])}")
    for value in info.get("values", [])[:_LARGEST]:
        lines.append(f"  value {printable(value['key'])}: {format_bytes(value['bytes'])} (not unpickled)")
    for left in info.get("leftovers", []):
        lines.append(
            f"  leftover of save {printable(str(left['save_id']))} ({describe_owner(left)}): "
            f"{plural(len(left['files']), 'file')}"
        )
    return "\n".join(lines)


def _index_state(found: dict[str, Any]) -> str:
    """:meth:`IndexUse.state` of the ``side_index`` an :func:`inspect_checkpoint` result holds."""
    return IndexUse(found["reason"], found["detail"], found["bytes"]).state()


def describe_key_list(info: dict[str, Any]) -> str:
    """One line per key of :func:`inspect_checkpoint`'s ``key_list``: name, dtype, shape, bytes
    (names escaped; a non-tensor value shows ``value`` and ``-``)."""
    rows = [
        (
            printable(e["key"]),
            e["dtype"] or "value",
            str(list(e["shape"])) if e["shape"] is not None else "-",
            str(e["bytes"]),
        )
        for e in info["key_list"]
    ]
    if not rows:
        return ""
    widths = [min(max(len(row[i]) for row in rows), 80) for i in range(3)]
    return "\n".join(
        f"{name:<{widths[0]}}  {dtype:<{widths[1]}}  {shape:<{widths[2]}}  {nbytes}"
        for name, dtype, shape, nbytes in rows
    )
