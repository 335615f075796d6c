"""torch.save files (.pt, .pth, .bin): one file, or a Hugging Face directory of ``.bin`` shards.

Zip-format files are read with ``torch.load(mmap=True, weights_only=True)``: listing unpickles
only the structure (tensor bytes stay on disk) and a worker's read maps just the pages of its
keys. Two kinds of file need the caller's say-so, never silent handling:

- the legacy (pre-1.6, non-zip) format cannot be mapped: it is loaded whole into the coordinator
  (with ``weights_only=True``) before workers are forked, with a warning; its bytes count against
  the memory limit.
- a file holding objects other than tensors and plain containers needs ``weights_only=False``,
  which runs the file's pickle: refused unless ``trust_pickle=True``.
"""

from __future__ import annotations

import os
import warnings
import weakref
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from parallel_dcp import _compat
from parallel_dcp.engine.chunks import Chunk, exact_storage, lazy_bits, resolved
from parallel_dcp.engine.memory import format_bytes
from parallel_dcp.errors import (
    CorruptCheckpointError,
    MemoryLimitExceeded,
    UnsafeCheckpointError,
)
from parallel_dcp.formats.base import FileFormat, Source, entry_of
from parallel_dcp.formats.folder_files import chosen_files
from parallel_dcp.formats.key_paths import nest
from parallel_dcp.formats.range_read import RawRange
from parallel_dcp.formats.shard_index import check_index
from parallel_dcp.formats.torch_spool import remove_if_owner, spool
from parallel_dcp.formats.validate import flatten_checked, flatten_structure
from parallel_dcp.storage.location import Location, Remote
from parallel_dcp.storage.pinned_paths import opened_for_library

__all__ = [
    "FORMAT",
    "INDEX_NAME",
    "SUFFIXES",
    "TorchSource",
    "is_torch_save",
    "read_whole",
    "shard_names",
    "write_file",
]

INDEX_NAME = "pytorch_model.bin.index.json"
SUFFIXES = (".pt", ".pth", ".bin")


LONE_NAME = "pytorch_model.bin"  # a Hugging Face directory of one shard holds it without an index


def is_torch_save(path: Location) -> bool:
    if path.is_dir():
        return (path / INDEX_NAME).is_file() or (path / LONE_NAME).is_file()
    return path.name.endswith(SUFFIXES)


# What torch.save's legacy (non-zip) format starts with: protocol 2, then its magic number.
_LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19."


def _check_torch_file(name: str, file: str) -> None:
    """A zip with a pickle inside, or the legacy format's magic: else not a torch.save file at
    all (never worth advice to turn on pickle execution). ``name``: how to open ``file`` now."""
    if zipfile.is_zipfile(name):
        return
    with open(name, "rb") as f:
        head = f.read(len(_LEGACY_MAGIC))
    if head != _LEGACY_MAGIC:
        raise CorruptCheckpointError(f"{file} is not a torch.save file (neither a zip archive nor the legacy format)")


def read_whole(file: str, *, trust_pickle: bool) -> Any:
    """The object of the torch.save file ``file``, as ``torch.load`` gives it (read whole, not mapped)."""
    return _load(file, mmap=False, trust_pickle=trust_pickle)


def _load(file: str, *, mmap: bool, trust_pickle: bool, meta: bool = False) -> Any:
    # opened by the one rule (a file swapped for a link since the listing is refused, never
    # followed), and torch reads the file opened here
    with opened_for_library(file) as name:
        _check_torch_file(name, file)
        try:
            return torch.load(name, map_location="meta" if meta else "cpu", mmap=mmap, weights_only=not trust_pickle)
        except Exception as exc:
            refused = _first_line_after(str(exc))
            if not trust_pickle and "Weights only load failed" in str(exc) and "GLOBAL" in str(exc):
                raise UnsafeCheckpointError(
                    f"{file} holds objects that safe loading (weights_only=True) refuses; loading it runs the "
                    "file's own pickle code. Only if you trust where it came from, pass trust_pickle=True "
                    f"(--trust-pickle). First line of torch's refusal: {refused}"
                ) from exc
            raise CorruptCheckpointError(
                f"{file} is not a readable torch.save file: {type(exc).__name__}: {refused}"
            ) from exc


def _first_line_after(message: str) -> str:
    lines = [ln.strip() for ln in message.splitlines() if "Unsupported global" in ln or "GLOBAL" in ln]
    return lines[0] if lines else message.splitlines()[0]


@dataclass
class TorchSource(Source):
    """A torch.save file or a directory of shards with ``pytorch_model.bin.index.json``."""

    _loaded: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)
    _legacy: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)
    _cleanup: Any = field(default=None, repr=False)
    # Keys whose tensor torch.save wrote as a lazy view (engine/chunks.lazy_bits): read resolved.
    _lazy: set[str] = field(default_factory=set, repr=False)
    # The job's memory limit: a legacy file (loaded whole) larger than it is refused before it is read.
    memory_limit: int | None = field(default=None, repr=False)
    # Every key, tensors and values, in the files' order (torch.load's): what keys() gives.
    _order: list[str] = field(default_factory=list, repr=False)
    # The type of what a file holds when it is not a mapping (a list, a tuple, a tensor, a pickled
    # module), by file: read under the key "" (as torch.load gives it, for load and inspect), and
    # never converted (jobs/top_level.py)
    top_levels: dict[str, type] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.kind = "torch"
        self.files, self.index, self.folder = chosen_files(
            self.location, INDEX_NAME, lone=LONE_NAME, folder=self.folder
        )
        if self.trust_pickle:
            warnings.warn(
                f"{self.path}: trust_pickle=True runs the file's pickle code (weights_only=False)", stacklevel=3
            )
        local = {file: file for file in self.files}
        holders: dict[str, str] = {}  # each key, and the file holding it as the index knows it (check_index)
        if isinstance(self.location, Remote):
            directory, local = spool(self.files, self.storage_options)
            self._cleanup = weakref.finalize(self, remove_if_owner, os.getpid(), directory)
        origin = {copy: file for file, copy in local.items()}
        for file in local.values():
            with opened_for_library(file) as name:  # (a FIFO or a link in its place is refused)
                _check_torch_file(name, file)
        self._refuse_legacy_over_limit(list(local.values()))
        for file in (local[f] for f in self.files):
            legacy = not zipfile.is_zipfile(file)
            if legacy:
                warnings.warn(
                    f"{file} is in torch's legacy (non-zip) format, which cannot be memory-mapped: it is "
                    "loaded whole into memory, and counts against the memory limit",
                    stacklevel=3,
                )
            obj = _load(file, mmap=not legacy, trust_pickle=self.trust_pickle)
            # (an empty mapping kept as a value: torch.load gives it back, so loads and
            # conversions to torch.save do too; other formats drop it, as DCP does. A key that is
            # not a string, an optimizer's parameter index, is kept in its path the same way: a
            # torch.save output gets it back, an output of string names refuses it, see
            # jobs/target_keys.py)
            if not isinstance(obj, dict):
                self.top_levels[origin[file]] = type(obj)
            flat, mapping = flatten_checked(_as_mapping(obj), keep_empty=True, any_keys=True)
            if legacy:
                self._legacy[file] = flat  # workers inherit it by fork
            for key, value in flat.items():
                if key in self.entries or key in self.values:
                    raise ValueError(f"{self.path}: key {key!r} is in two shards")
                holders[key] = origin[file]
                self._order.append(key)
                if isinstance(value, torch.Tensor):
                    self.entries[key] = entry_of(key, value, file)
                    if lazy_bits(value, value.dtype) is not None:
                        self._lazy.add(key)
                else:
                    self.values[key] = value
            if len(self.files) == 1:
                self.mapping = mapping
        if self.index is not None:  # (not read beside pytorch_model.bin)
            check_index(self.index, self.files, holders)

    def keys(self) -> tuple[str, ...]:
        return tuple(self._order)

    def _refuse_legacy_over_limit(self, files: list[str]) -> None:
        """Legacy files are loaded whole into this process when opened, before any plan: where
        they alone are more than the memory limit, refused before they are read (one was loaded
        6x over its limit, then refused in the write phase)."""
        legacy = [f for f in files if not zipfile.is_zipfile(f)]
        held = sum(os.path.getsize(f) for f in legacy)
        if self.memory_limit is not None and legacy and held > self.memory_limit:
            raise MemoryLimitExceeded(
                f"{self.path} is in torch's legacy (non-zip) format: it is loaded whole, holding about "
                f"{format_bytes(held)} in memory, more than the memory limit {format_bytes(self.memory_limit)}: "
                "raise --memory-limit, or save it again in torch.save's zip format (the default), which is "
                "read a piece at a time",
                limit=self.memory_limit,
                measured=held,
                keys=[],
            )

    def release(self) -> None:
        self._loaded.clear()

    def raw_ranges(self) -> dict[str, RawRange]:
        """The contiguous tensors of local zip-format files: where torch itself places each
        storage's record (a ``map_location="meta"`` load: the pickle again, no tensor bytes), each
        checked to lie inside its storage; views with gaps and legacy files are read by mapping."""
        if isinstance(self.location, Remote):
            return {}
        out: dict[str, RawRange] = {}
        for file in self.files:
            if file in self._legacy:
                continue
            obj = _load(file, mmap=False, trust_pickle=self.trust_pickle, meta=True)
            flat = flatten_structure(_as_mapping(obj), any_keys=True)[0]
            for key, value in flat.items():
                entry = self.entries.get(key)
                if not isinstance(value, torch.Tensor) or entry is None or entry.file != file or key in self._lazy:
                    continue  # (a lazy view's bytes are not its values: read, resolved)
                storage = value.untyped_storage()
                offset = _compat.checkpoint_offset(storage)
                first = value.storage_offset() * value.element_size()
                if offset is None or not value.is_contiguous() or first + entry.nbytes > storage.nbytes():
                    continue
                if (value.dtype, tuple(value.shape)) != (entry.dtype, entry.shape):
                    raise CorruptCheckpointError(f"{file}: tensor {key!r} changed while opening")
                out[key] = RawRange(file, int(offset + first))
        return out

    def close(self) -> None:
        if self._cleanup is not None:
            self._cleanup()

    def read_chunk(self, chunk: Chunk) -> torch.Tensor:
        """A view of the mapped file: only the chunk's pages are read (aliased, not copied, when
        the chunk is a row range)."""
        return exact_storage(self._resolved(chunk.key, chunk.of(self._tensor(chunk.key))))

    def chunk_memory(self, chunk: Chunk) -> int:
        return 2 * chunk.nbytes(self.entries[chunk.key].dtype.itemsize)  # mapped pages (+ a copy if strided)

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        return {key: self._resolved(key, self._tensor(key)) for key in keys}

    def _tensor(self, key: str) -> torch.Tensor:
        """``key``'s tensor as the file holds it (mapped)."""
        file = self.entries[key].file
        flat = self._legacy.get(file) or self._loaded.get(file)
        if flat is None:  # mapped in the worker on first use
            obj = _load(file, mmap=True, trust_pickle=self.trust_pickle)
            flat = self._loaded[file] = flatten_checked(_as_mapping(obj), any_keys=True)[0]
        tensor: torch.Tensor = flat[key]
        return tensor

    def _resolved(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """A lazy view's values, copied (a source on disk is charged a copy of every key)."""
        return resolved(tensor) if key in self._lazy else tensor


def _as_mapping(obj: Any) -> dict[Any, Any]:
    """What a file holds, as a state dict: a mapping as it is, anything else under the key ``""``
    (named so by every read, the workers' too)."""
    return obj if isinstance(obj, dict) else {"": obj}


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["pytorch_model.bin"]
    return [f"pytorch_model-{i + 1:05d}-of-{count:05d}.bin" for i in range(count)]


def write_file(
    tensors: dict[str, Any], path: str | IO[bytes], mapping: dict[str, tuple[Any, ...]] | None = None
) -> None:
    """``torch.save`` the flat dict (to a path or a write stream), nested again by ``mapping``
    (keys that are not strings as the source held them: formats/key_paths.py). An empty tensor
    is saved as a fresh one: read from a mapped file, it points where the next tensor's bytes
    start, and torch.save refuses two storages at one address of two dtypes."""
    tensors = {
        k: torch.empty(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) and not v.numel() else v
        for k, v in tensors.items()
    }
    obj = nest(tensors, mapping) if mapping else tensors
    torch.save(obj, path)


FORMAT = FileFormat(kind="torch", suffixes=SUFFIXES, index_name=INDEX_NAME, shard_names=shard_names, write=write_file)
