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

import json
import os
import warnings
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from parallel_dcp import _compat
from parallel_dcp.chunks import Chunk, exact_storage
from parallel_dcp.errors import UnsafeCheckpointError
from parallel_dcp.formats.base import Source, entry_of
from parallel_dcp.validate import flatten_checked

__all__ = ["INDEX_NAME", "SUFFIXES", "TorchSource", "index_json", "is_torch_save", "shard_names", "write_file"]

INDEX_NAME = "pytorch_model.bin.index.json"
SUFFIXES = (".pt", ".pth", ".bin")


def is_torch_save(path: str) -> bool:
    if os.path.isdir(path):
        return os.path.exists(os.path.join(path, INDEX_NAME))
    return path.endswith(SUFFIXES)


def _shard_files(path: str) -> list[str]:
    if not os.path.isdir(path):
        return [path]
    with open(os.path.join(path, INDEX_NAME)) as f:
        names = list(dict.fromkeys(json.load(f)["weight_map"].values()))
    files = [os.path.join(path, n) for n in names]
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        raise FileNotFoundError(f"{path}: the index names shards that do not exist: {', '.join(missing)}")
    return files


def _load(file: str, *, mmap: bool, trust_pickle: bool) -> Any:
    try:
        return torch.load(file, map_location="cpu", mmap=mmap, weights_only=not trust_pickle)
    except Exception as exc:
        if not trust_pickle and "Weights only load failed" in str(exc):
            raise UnsafeCheckpointError(
                f"{file} holds objects that safe loading (weights_only=True) refuses; loading it runs the "
                "file's own pickle code. Only if you trust where it came from, pass trust_pickle=True "
                f"(--trust-pickle). First line of torch's refusal: {_first_line_after(str(exc))}"
            ) from exc
        raise


def _first_line_after(message: str) -> str:
    lines = [ln.strip() for ln in message.splitlines() if "Unsupported global" in ln or "GLOBAL" in ln]
    return lines[0] if lines else message.splitlines()[0]


@dataclass
class TorchSource(Source):
    """A torch.save file or a directory of shards with ``pytorch_model.bin.index.json``."""

    trust_pickle: bool = False
    _loaded: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)
    _legacy: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.kind = "torch"
        self.files = _shard_files(self.path)
        if self.trust_pickle:
            warnings.warn(
                f"{self.path}: trust_pickle=True runs the file's pickle code (weights_only=False)", stacklevel=3
            )
        for file in self.files:
            legacy = not zipfile.is_zipfile(file)
            if legacy:
                warnings.warn(
                    f"{file} is in torch's legacy (non-zip) format, which cannot be memory-mapped: it is "
                    "loaded whole into memory, and counts against the memory limit",
                    stacklevel=3,
                )
            obj = _load(file, mmap=not legacy, trust_pickle=self.trust_pickle)
            flat, mapping = flatten_checked(obj if isinstance(obj, dict) else {"": obj})
            if legacy:
                self._legacy[file] = flat  # workers inherit it by fork
            for key, value in flat.items():
                if key in self.entries or key in self.values:
                    raise ValueError(f"{self.path}: key {key!r} is in two shards")
                if isinstance(value, torch.Tensor):
                    self.entries[key] = entry_of(key, value, file)
                else:
                    self.values[key] = value
            if len(self.files) == 1:
                self.mapping = mapping

    def release(self) -> None:
        self._loaded.clear()

    def read_chunk(self, chunk: Chunk) -> torch.Tensor:
        """A view of the mapped file: only the chunk's pages are read (aliased, not copied, when
        the chunk is a row range)."""
        return exact_storage(chunk.of(self.read([chunk.key])[chunk.key]))

    def chunk_memory(self, chunk: Chunk) -> int:
        return 2 * chunk.nbytes(self.entries[chunk.key].dtype.itemsize)  # mapped pages (+ a copy if strided)

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        out = {}
        for key in keys:
            file = self.entries[key].file
            flat = self._legacy.get(file) or self._loaded.get(file)
            if flat is None:  # mapped in the worker on first use
                flat = self._loaded[file] = flatten_checked(_load(file, mmap=True, trust_pickle=self.trust_pickle))[0]
            out[key] = flat[key]
        return out


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["pytorch_model.bin"]
    return [f"pytorch_model-{i + 1:05d}-of-{count:05d}.bin" for i in range(count)]


def write_file(tensors: dict[str, Any], path: str, mapping: dict[str, tuple[Any, ...]] | None = None) -> None:
    """``torch.save`` the flat dict, nested again by ``mapping`` when one is given."""
    obj = _compat.unflatten_state_dict(tensors, mapping) if mapping else tensors
    torch.save(obj, path)


def index_json(weight_map: dict[str, str], total_size: int) -> str:
    return json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2) + "\n"
