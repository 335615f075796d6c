"""Read a checkpoint's ``.metadata`` without trusting it.

DCP reads ``.metadata`` with plain ``pickle.load``, so a crafted file runs code the moment it is
opened. Every parallel_dcp reader goes through :func:`read_metadata` instead: an unpickler that
resolves only the classes a DCP metadata file is made of, and refuses anything else by name
before running it.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from parallel_dcp.errors import CorruptCheckpointError, UnsafeCheckpointError
from parallel_dcp.storage.location import Remote, locate

__all__ = ["read_metadata"]

_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "slice"},
}


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


def read_metadata(path: str | os.PathLike[str] | Remote) -> Metadata:
    """Read ``<path>/.metadata`` with an allow-list unpickler.

    Raises:
        FileNotFoundError: ``path`` holds no committed checkpoint.
        UnsafeCheckpointError: the file names a class outside the allow-list.
        CorruptCheckpointError: the file is truncated or not a DCP metadata pickle.
    """
    file = locate(path) / ".metadata"
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a DCP checkpoint: it has no .metadata (the commit marker)")
    with io.BytesIO(file.read_bytes()) as f:
        try:
            metadata = _SafeUnpickler(f).load()
        except UnsafeCheckpointError:
            raise
        except Exception as exc:
            raise CorruptCheckpointError(f"{file} is truncated or corrupt: {type(exc).__name__}: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{file} does not hold DCP Metadata but {type(metadata).__name__}")
    return metadata
