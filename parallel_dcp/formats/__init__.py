"""Checkpoint formats: detect one, open it as a :class:`Source`; each module also writes its format.

- DCP directory: read with ``.metadata`` + ``partial_load`` per task; written by the core writer.
- safetensors file or HF sharded directory: read with ``safe_open`` (mmap); written with
  ``save_file`` per shard plus the index JSON.
- torch.save file (.pt/.pth/.bin) or HF ``.bin`` directory: read with
  ``torch.load(mmap=True, weights_only=True)``; written with ``torch.save`` per shard plus the index.
"""

from __future__ import annotations

import os

from parallel_dcp.formats.base import Entry, Source
from parallel_dcp.formats.dcp_format import DcpSource, is_dcp
from parallel_dcp.formats.safetensors_format import SafetensorsSource, is_safetensors
from parallel_dcp.formats.torch_format import TorchSource, is_torch_save

__all__ = ["FORMATS", "Entry", "Source", "detect_format", "open_source"]

FORMATS = ("dcp", "safetensors", "torch")


def detect_format(path: str | os.PathLike[str]) -> str:
    """``"dcp"``, ``"safetensors"`` or ``"torch"``, from the files at ``path``.

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: ``path`` holds none of the formats (an uncommitted DCP directory included).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file or directory: {path}")
    if is_dcp(path):
        return "dcp"
    if is_safetensors(path):
        return "safetensors"
    if is_torch_save(path):
        return "torch"
    if os.path.isdir(path) and any(n.endswith(".distcp") for n in os.listdir(path)):
        raise ValueError(f"{path} has DCP shards but no .metadata: it is not a committed checkpoint")
    raise ValueError(
        f"cannot tell the format of {path}: expected a DCP directory (.metadata), a .safetensors file or a "
        "directory of them (model.safetensors.index.json), or a torch.save file (.pt, .pth, .bin) or "
        "a directory with pytorch_model.bin.index.json"
    )


def open_source(path: str | os.PathLike[str], *, trust_pickle: bool = False) -> Source:
    """Open ``path`` for reading, listing its tensors from headers only (no tensor data read)."""
    path = os.fspath(path)
    kind = detect_format(path)
    if kind == "dcp":
        return DcpSource(path)
    if kind == "safetensors":
        return SafetensorsSource(path)
    return TorchSource(path, trust_pickle=trust_pickle)
