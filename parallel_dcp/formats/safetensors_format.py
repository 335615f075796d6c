"""safetensors: one file, or a Hugging Face directory (``model.safetensors.index.json`` + shards).

Read through the safetensors library (headers for listing, ``safe_open`` mmap for data); written
with ``safetensors.torch.save_file``, one shard per task, in the layout Hugging Face tools expect:
``model-00001-of-00003.safetensors`` ... plus the index's ``weight_map`` and ``total_size``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from parallel_dcp.chunks import Chunk
from parallel_dcp.formats.base import Entry, Source

__all__ = ["INDEX_NAME", "SafetensorsSource", "index_json", "is_safetensors", "shard_names", "write_shard"]

INDEX_NAME = "model.safetensors.index.json"
_SUFFIX = ".safetensors"
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
}


def is_safetensors(path: str) -> bool:
    if os.path.isdir(path):
        return os.path.exists(os.path.join(path, INDEX_NAME)) or any(n.endswith(_SUFFIX) for n in os.listdir(path))
    return path.endswith(_SUFFIX)


def _shard_files(path: str) -> list[str]:
    if not os.path.isdir(path):
        return [path]
    index = os.path.join(path, INDEX_NAME)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        names = list(dict.fromkeys(weight_map.values()))
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(_SUFFIX))
    files = [os.path.join(path, n) for n in names]
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        raise FileNotFoundError(f"{path}: the index names shards that do not exist: {', '.join(missing)}")
    return files


@dataclass
class SafetensorsSource(Source):
    """A safetensors file or sharded directory; listing reads only the JSON headers."""

    _handles: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.kind = "safetensors"
        self.files = _shard_files(self.path)
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    piece = f.get_slice(key)
                    dtype = _DTYPES.get(piece.get_dtype())
                    if dtype is None:
                        raise ValueError(
                            f"{file}: tensor {key!r} has dtype {piece.get_dtype()}, which torch cannot hold"
                        )
                    if key in self.entries:
                        raise ValueError(f"{self.path}: tensor {key!r} is in two shards")
                    self.entries[key] = Entry(key, dtype, tuple(piece.get_shape()), file)

    def release(self) -> None:
        self._handles.clear()

    def _handle(self, key: str) -> Any:
        file = self.entries[key].file
        handle = self._handles.get(file)
        if handle is None:  # opened in the worker, on first use: an mmap is never shared
            handle = self._handles[file] = safe_open(file, framework="pt")
        return handle

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        return {key: self._handle(key).get_tensor(key) for key in keys}

    def read_chunk(self, chunk: Chunk) -> torch.Tensor:
        """Only the chunk's rows are read (``get_slice``), into a tensor of their own."""
        rows = slice(chunk.start, chunk.stop)
        index = tuple(rows if d == chunk.dim else slice(None) for d in range(len(chunk.shape)))
        tensor: torch.Tensor = self._handle(chunk.key).get_slice(chunk.key)[index]
        return tensor.contiguous()

    # A read maps the file's pages (which count while the handle is open) and copies them out.
    def copied_bytes(self, key: str) -> int:
        return 2 * self.entries[key].nbytes

    def chunk_memory(self, chunk: Chunk) -> int:
        return 2 * chunk.nbytes(self.entries[chunk.key].dtype.itemsize)


def shard_names(count: int) -> list[str]:
    """Hugging Face shard names; a single shard is plain ``model.safetensors``."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}{_SUFFIX}" for i in range(count)]


def write_shard(tensors: dict[str, torch.Tensor], path: str) -> None:
    """Write one shard. Tensors that share storage are copied apart (safetensors refuses sharing)."""
    seen: set[tuple[int, int]] = set()
    ready = {}
    for key, tensor in tensors.items():
        t = tensor.contiguous()
        ident = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if ident in seen or t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone()
        seen.add(ident)
        ready[key] = t
    save_file(ready, path, metadata={"format": "pt"})


def index_json(weight_map: dict[str, str], total_size: int) -> str:
    return json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2) + "\n"
