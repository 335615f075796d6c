"""Read a checkpoint without trusting it: its ``.metadata``, its names, sizes and values.

DCP reads ``.metadata`` with plain ``pickle.load``, so a crafted file runs code the moment it is
opened. Every parallel_dcp reader goes through :func:`read_metadata` instead: an unpickler that
resolves only the classes a DCP metadata file is made of, and refuses anything else by name
before running it. Then every file name it holds must be a plain name inside the checkpoint,
and every offset, length and size must be possible (:class:`CorruptCheckpointError` otherwise).

Non-tensor values are stored by DCP as pickled ``BYTE_IO`` records, which torch's
``DefaultLoadPlanner.load_bytes`` unpickles with ``weights_only=False``: a hostile checkpoint
runs code through it. Every read path here uses :class:`SafeLoadPlanner` /
:func:`safe_empty_planner`, which unpickle with ``weights_only=True`` and refuse anything more
with :class:`UnsafeCheckpointError` naming the key, unless the caller passed ``trust_pickle``.

The checks of what the file holds are in storage/metadata_check.py (and storage/geometry.py).

Longer than 300 lines because the side index is chosen in ``.metadata``'s place inside its one
open (the index is bound to the bytes that open reads), and that choice says why (issue 32).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from parallel_dcp import _compat
from parallel_dcp.engine.memory import default_limit, format_bytes
from parallel_dcp.engine.sizes import format_at_least
from parallel_dcp.errors import (
    CorruptCheckpointError,
    MemoryLimitExceeded,
    ParallelDCPError,
    UnsafeCheckpointError,
    describe_keys,
)
from parallel_dcp.storage import geometry
from parallel_dcp.storage.geometry import MissingShard
from parallel_dcp.storage.location import Location, Remote, file_size, listdir, locate
from parallel_dcp.storage.metadata_check import WholeRecords, check_metadata_fields
from parallel_dcp.storage.plain_values import plain_value
from parallel_dcp.storage.safe_files import vanished
from parallel_dcp.storage.safe_reader import open_bounded
from parallel_dcp.storage.side_index_read import SideIndex, examine_index
from parallel_dcp.storage.side_index_use import NOT_ASKED, IndexUse

__all__ = [
    "METADATA_MEMORY_FACTOR",
    "SafeLoadPlanner",
    "check_metadata",
    "check_shard_sizes",
    "check_shards",
    "read_index_or_metadata",
    "read_index_or_metadata_use",
    "read_metadata",
    "read_metadata_columns",
    "reading",
    "safe_empty_planner",
    "unpickle_value",
]

# Unpickled, a .metadata takes up to ~13x its file's size (measured: tracemalloc's peak while
# unpickling DCP metadata of 600 and 9,000 keys); its checks add a little.
METADATA_MEMORY_FACTOR = 16
_READ_PIECE = 1 << 20
_SMALL = 64 << 20

_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        *_compat.METADATA_PRIVATE_NAMES["torch.distributed.checkpoint.metadata"],
    },
    "torch.distributed.checkpoint.filesystem": set(
        _compat.METADATA_PRIVATE_NAMES["torch.distributed.checkpoint.filesystem"]
    ),
    "torch.serialization": set(_compat.METADATA_PRIVATE_NAMES["torch.serialization"]),
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "slice"},
}
for _module, _names in _compat.METADATA_PRIVATE_NAMES.items():  # torch's private ones, kept in _compat
    _ALLOWED.setdefault(_module, set()).update(_names)


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"refusing to load {module}.{name} from checkpoint metadata: it is not a DCP metadata type "
            "(the file may be malicious); nothing in it was run"
        )


def read_metadata(path: str | os.PathLike[str] | Remote, *, memory_limit: int | None = None) -> Metadata:
    """Read ``<path>/.metadata`` with an allow-list unpickler, streamed from the file (never read
    whole first) once its size is admitted under ``memory_limit`` (default: the default limit).

    Raises:
        FileNotFoundError: ``path`` holds no committed checkpoint.
        MemoryLimitExceeded: unpickling a file of its size could need more than ``memory_limit``
            (nothing of it was read).
        UnsafeCheckpointError: the file names a class outside the allow-list.
        CorruptCheckpointError: the file is truncated, has bytes after its pickle, or is not a
            DCP metadata pickle.
    """
    return read_metadata_columns(path, memory_limit=memory_limit)[0]


def read_metadata_columns(
    path: str | os.PathLike[str] | Remote, *, memory_limit: int | None = None
) -> tuple[Metadata, WholeRecords]:
    """:func:`read_metadata`, and what its check found in passing (storage.metadata_check.WholeRecords)."""
    file = locate(path) / ".metadata"
    with _open_metadata(file, path) as (f, size):
        return _read_metadata(file, f, size, memory_limit)


def read_index_or_metadata(
    path: str | os.PathLike[str] | Remote, *, memory_limit: int | None = None
) -> tuple[Metadata | None, WholeRecords, SideIndex | None]:
    """The side index beside a local ``.metadata`` that describes it exactly (side_index_read.py),
    its columns and no Metadata; else as :func:`read_metadata_columns`, and no index."""
    return read_index_or_metadata_use(path, memory_limit=memory_limit)[:3]


def read_index_or_metadata_use(
    path: str | os.PathLike[str] | Remote, *, memory_limit: int | None = None
) -> tuple[Metadata | None, WholeRecords, SideIndex | None, IndexUse]:
    """:func:`read_index_or_metadata`, and which of the two the plan comes from and why
    (storage.side_index_use.IndexUse)."""
    location = locate(path)
    file = location / ".metadata"
    with _open_metadata(file, path) as (f, size):
        use = IndexUse(NOT_ASKED, "object storage: only a local checkpoint's index is read")
        if isinstance(location, Path):
            index, use = examine_index(location, f, size, memory_limit)
            if index is not None:
                return None, index.columns, index, use
        metadata, columns = _read_metadata(file, f, size, memory_limit)
        return metadata, columns, None, use


def _read_metadata(file: Location, f: BinaryIO, size: int, memory_limit: int | None) -> tuple[Metadata, WholeRecords]:
    need = size * METADATA_MEMORY_FACTOR
    # (a small file needs no look at the machine's memory: inspect reads only the checkpoint)
    limit = memory_limit if memory_limit is not None else default_limit() if need > _SMALL else need
    if need > limit:
        raise MemoryLimitExceeded(
            f"{file} has {format_bytes(need // METADATA_MEMORY_FACTOR)}; unpickling it needs up to "
            f"{format_bytes(need)}, more than the memory limit {format_bytes(limit)} (nothing of it was read): "
            f"raise --memory-limit to at least {format_at_least(need)}",
            limit=limit,
            measured=need,
            keys=[],
        )
    try:
        metadata = _SafeUnpickler(f).load()
    except (UnsafeCheckpointError, CorruptCheckpointError):
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"{file} is truncated or corrupt: {type(exc).__name__}: {exc}") from exc
    if f.read(1):  # DCP writes the pickle alone: anything after it was put there
        raise CorruptCheckpointError(f"{file} holds bytes after its pickle (not a file DCP wrote)")
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{file} does not hold DCP Metadata but {type(metadata).__name__}")
    return metadata, check_metadata(metadata, file)


def _no_checkpoint(checkpoint: object, file: Location) -> FileNotFoundError:
    """No ``.metadata`` at ``file``: an empty directory is called empty."""
    empty = file.parent.is_dir() and not listdir(file.parent)
    return FileNotFoundError(
        f"{checkpoint} is not a DCP checkpoint: "
        + ("the directory is empty" if empty else "it has no .metadata (the commit marker)")
    )


@contextlib.contextmanager
def _open_metadata(file: Any, checkpoint: object) -> Iterator[tuple[BinaryIO, int]]:
    """``.metadata`` for reading in pieces of ``_READ_PIECE`` (the unpickler asks for a few bytes at
    a time, and on object storage each unbuffered ask would be a ranged request: thousands for one
    file), and its size. A local file is opened by the one rule (storage.safe_reader): a symlink or
    a FIFO planted as ``.metadata`` is refused by name, never followed or blocked on, and the file
    is read no further than the size its open descriptor has.

    Raises:
        FileNotFoundError: there is no ``.metadata`` (no committed checkpoint).
    """
    if isinstance(file, Remote):
        if not file.is_file():
            raise _no_checkpoint(checkpoint, file)
        with file.open_read() as raw, io.BufferedReader(raw, buffer_size=_READ_PIECE) as f:
            yield f, file_size(file)
        return
    if not os.path.lexists(file):
        raise _no_checkpoint(checkpoint, file)
    try:
        stream = open_bounded(file, buffering=_READ_PIECE)
    except UnsafeCheckpointError:
        raise
    except CorruptCheckpointError:  # gone since the look: no checkpoint there now
        raise FileNotFoundError(
            f"{checkpoint} is not a DCP checkpoint: it has no .metadata (the commit marker)"
        ) from None
    with stream:
        yield stream, stream.raw.size  # type: ignore[attr-defined]


def check_metadata(metadata: Metadata, file: object) -> WholeRecords:
    """Every name plain, every size and offset possible; before anything else is read. Returns
    what the check found in passing (whole chunks and their records, as columns).

    Raises:
        CorruptCheckpointError: anything impossible, including objects of the allowed classes
            built without the fields they must have (a crafted or damaged pickle can do that).
    """
    try:
        return check_metadata_fields(metadata, file)
    except CorruptCheckpointError:
        raise
    except (AttributeError, TypeError, ValueError, OverflowError) as exc:
        raise CorruptCheckpointError(f"{file}: malformed metadata ({type(exc).__name__}: {exc})") from exc


@contextlib.contextmanager
def reading(path: object, keys: Sequence[str]) -> Iterator[None]:
    """Whatever goes wrong reading ``keys`` from ``path`` is a CorruptCheckpointError naming them
    (torch raises RuntimeError from its zip reader on a damaged record)."""
    try:
        yield
    except ParallelDCPError:
        raise
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise CorruptCheckpointError(
            f"{path}: cannot read {describe_keys(list(keys))}: {type(exc).__name__}: {first}"
        ) from exc


def unpickle_value(key: str, data: io.BytesIO, *, trust_pickle: bool = False) -> Any:
    """A non-tensor value DCP stored (a ``torch.save`` record), unpickled with ``weights_only=True``
    unless ``trust_pickle``.

    Raises:
        UnsafeCheckpointError: the value needs more than ``weights_only=True`` allows (nothing ran).
        CorruptCheckpointError: the record is not a readable ``torch.save`` record.
    """
    plain, value = plain_value(data)
    if plain:
        return value
    data.seek(0)
    try:
        return torch.load(data, map_location="cpu", weights_only=not trust_pickle)
    except pickle.UnpicklingError as exc:
        if not trust_pickle and "Weights only load failed" in str(exc) and "GLOBAL" in str(exc):
            detail = next((ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln or "Unsupported" in ln), "")
            raise UnsafeCheckpointError(
                f"the value of {key!r} needs code to run to be unpickled (weights_only=True refuses it; nothing "
                f"ran): {detail}. Only if you trust the checkpoint's origin, pass trust_pickle=True (--trust-pickle)"
            ) from None
        raise CorruptCheckpointError(f"the value of {key!r} is not a readable record: {exc}") from exc
    except Exception as exc:
        message = f"the value of {key!r} is not a readable record: {type(exc).__name__}: {exc}"
        raise CorruptCheckpointError(message) from exc


class _SafeBytes:
    """``load_bytes`` with :func:`unpickle_value` in place of ``torch.load(weights_only=False)``."""

    trust_pickle: bool = False
    flatten_state_dict: bool
    original_state_dict: Any
    mappings: Any
    state_dict: Any

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = unpickle_value(fqn, value, trust_pickle=self.trust_pickle)
        if self.flatten_state_dict:
            _compat.set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner`` with safe unpickling of non-tensor values."""

    def __init__(self, *args: Any, trust_pickle: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trust_pickle = trust_pickle


def safe_empty_planner(trust_pickle: bool = False) -> DefaultLoadPlanner:
    """DCP's planner that loads every key into an empty dict, with safe unpickling."""
    base = type(_compat.empty_state_dict_load_planner())
    planner_type = type("SafeEmptyStateDictLoadPlanner", (_SafeBytes, base), {})
    planner: DefaultLoadPlanner = planner_type()
    planner.trust_pickle = trust_pickle  # type: ignore[attr-defined]
    return planner


def check_shards(path: Location, metadata: Any, keys: list[str] | None = None) -> None:
    """:func:`storage.geometry.check_shards`, a missing shard told apart (:func:`_missing`)."""
    with _missing_told_apart(path):
        geometry.check_shards(path, metadata, keys)


def check_shard_sizes(path: Location, needed: dict[str, int]) -> None:
    """:func:`storage.geometry.check_shard_sizes`, a missing shard told apart (:func:`_missing`)."""
    with _missing_told_apart(path):
        geometry.check_shard_sizes(path, needed)


@contextlib.contextmanager
def _missing_told_apart(path: Location) -> Iterator[None]:
    try:
        yield
    except MissingShard as missing:
        raise _missing(path, missing.name) from None


def _missing(path: Location, name: str) -> CorruptCheckpointError:
    """The error for a shard that ``.metadata`` (as read) names and the folder lacks: damage, or
    another save that replaced the checkpoint since (its new ``.metadata`` names other shards,
    and the old ones are gone: a load beside a training loop's overwrites)."""
    try:
        now = {info.relative_path for info in (read_metadata(path).storage_data or {}).values()}
    except (ParallelDCPError, OSError):  # gone, or being replaced itself
        return vanished(path / name)
    if name not in now:
        return CorruptCheckpointError(
            f"{path} changed while reading: another save overwrote it after its .metadata was read "
            f"(shard {name} is gone, the new .metadata names other shards); load it again"
        )
    return CorruptCheckpointError(f"{path} is damaged: shard {name} is missing")
