"""``inspect``: what a checkpoint holds, from headers and metadata only (no tensor data read)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from parallel_dcp.destination import METADATA_FILE
from parallel_dcp.formats import detect_format, open_source
from parallel_dcp.manifest import MANIFEST_FILE

__all__ = ["describe", "inspect_checkpoint"]

_LARGEST = 10


def _uncommitted_dcp(path: Path) -> dict[str, Any] | None:
    if path.is_dir() and not (path / METADATA_FILE).exists():
        shards = sorted(p for p in path.iterdir() if p.name.endswith(".distcp"))
        if shards:
            return {
                "path": str(path),
                "format": "dcp",
                "committed": False,
                "keys": 0,
                "tensors": 0,
                "total_bytes": 0,
                "dtypes": {},
                "largest": [],
                "files": [{"name": p.name, "size": p.stat().st_size} for p in shards],
                "manifest": (path / MANIFEST_FILE).exists(),
            }
    return None


def inspect_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Format, keys, bytes, dtypes, largest tensors, files and whether the checkpoint is committed.

    A DCP directory with shards but no ``.metadata`` is reported as ``committed: False`` (a save
    that never finished) instead of raising.

    Raises:
        FileNotFoundError / ValueError: nothing at ``path``, or not a known format.
        CorruptCheckpointError / UnsafeCheckpointError: a damaged or malicious ``.metadata``.
    """
    uncommitted = _uncommitted_dcp(Path(path))
    if uncommitted is not None:
        return uncommitted
    detect_format(path)
    source = open_source(path)
    dtypes: dict[str, dict[str, int]] = {}
    for entry in source.entries.values():
        slot = dtypes.setdefault(str(entry.dtype).removeprefix("torch."), {"tensors": 0, "bytes": 0})
        slot["tensors"] += 1
        slot["bytes"] += entry.nbytes
    largest = sorted(source.entries.values(), key=lambda e: e.nbytes, reverse=True)[:_LARGEST]
    files: list[dict[str, Any]] = [
        {
            "name": os.path.relpath(f, path) if Path(path).is_dir() else os.path.basename(f),
            "size": os.path.getsize(f) if os.path.exists(f) else None,
        }
        for f in source.files
    ]
    return {
        "path": os.fspath(path),
        "format": source.kind,
        "committed": all(r["size"] is not None for r in files),
        "keys": len(source.entries) + len([k for k in source.values if k not in source.entries]),
        "tensors": len(source.entries),
        "total_bytes": source.total_bytes(),
        "dtypes": dtypes,
        "largest": [
            {"key": e.key, "dtype": str(e.dtype).removeprefix("torch."), "shape": list(e.shape), "bytes": e.nbytes}
            for e in largest
        ],
        "files": files,
        "manifest": Path(path).is_dir() and (Path(path) / MANIFEST_FILE).exists(),
    }


def describe(info: dict[str, Any]) -> str:
    """A short human-readable summary of :func:`inspect_checkpoint`'s result."""
    from parallel_dcp.memory import format_bytes

    lines = [
        f"{info['path']}: {info['format']}, {'committed' if info['committed'] else 'NOT committed'}",
        f"  {info['keys']} keys ({info['tensors']} tensors), {format_bytes(info['total_bytes'])}, "
        f"{len(info['files'])} files" + (", manifest" if info["manifest"] else ""),
    ]
    for dtype, slot in sorted(info["dtypes"].items(), key=lambda kv: -kv[1]["bytes"]):
        lines.append(f"  {dtype:<14}{slot['tensors']:>8} tensors {format_bytes(slot['bytes']):>12}")
    if info["largest"]:
        lines.append("  largest:")
        for e in info["largest"]:
            lines.append(f"    {e['key']}  {e['dtype']} {tuple(e['shape'])}  {format_bytes(e['bytes'])}")
    return "\n".join(lines)
