"""DCP directories as a source: ``.metadata`` lists everything; workers read their keys with
``partial_load`` straight into tensors they allocate.

Keys whose ``chunks`` are several pieces (a DTensor or ShardedTensor save, or a tensor
parallel_dcp split) are reassembled by DCP's own planner into one plain tensor.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from parallel_dcp.destination import METADATA_FILE
from parallel_dcp.formats.base import Entry, Source
from parallel_dcp.metadata_io import read_metadata
from parallel_dcp.partial import extract_metadata, partial_load

__all__ = ["DcpSource", "is_dcp", "read_keys"]


def is_dcp(path: str) -> bool:
    return os.path.isdir(path) and os.path.exists(os.path.join(path, METADATA_FILE))


def read_keys(path: str, metadata: Metadata, keys: Iterable[str], into: dict[str, Any]) -> dict[str, Any]:
    """Load ``keys`` into ``into`` (preallocated tensors are filled in place; other values are set)."""
    keys = list(keys)
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
    return partial_load(extract_metadata(keys, metadata), FileSystemReader(path), planner, state_dict=into)


@dataclass
class DcpSource(Source):
    """A committed DCP checkpoint; ``.metadata`` is read with the allow-list unpickler."""

    metadata: Metadata | None = None

    def __post_init__(self) -> None:
        self.kind = "dcp"
        self.metadata = read_metadata(self.path)
        names = {str(info.relative_path) for info in (self.metadata.storage_data or {}).values()}
        self.files = [os.path.join(self.path, METADATA_FILE), *sorted(os.path.join(self.path, n) for n in names)]
        planner_data = self.metadata.planner_data or {}
        byte_keys = []
        for key, meta in self.metadata.state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata):
                self.entries[key] = Entry(key, meta.properties.dtype, tuple(meta.size), self.path)
            else:
                byte_keys.append(key)
        if byte_keys:  # small pickled values: read once, here, with the tensors left on disk
            self.values = read_keys(self.path, self.metadata, byte_keys, {k: None for k in byte_keys})
        self.mapping = {k: tuple(planner_data.get(k, (k,))) for k in self.metadata.state_dict_metadata}

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        assert self.metadata is not None
        out = {k: torch.empty(self.entries[k].shape, dtype=self.entries[k].dtype) for k in keys}
        read_keys(self.path, self.metadata, list(out), out)
        return out
