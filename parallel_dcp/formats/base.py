"""What every format offers the pipeline: list tensors without reading data, read a key subset.

A :class:`Source` is opened once in the coordinator (which lists it, reading headers only) and
read from in forked workers. Anything a worker opens (an mmap, a file handle) is opened lazily in
that worker and never shared, so a source is safe to fork before its first :meth:`Source.read`.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from parallel_dcp.storage.location import Location, Remote, locate

if TYPE_CHECKING:
    from parallel_dcp.engine.chunks import Chunk

__all__ = ["Entry", "Source", "entry_of"]


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a source, known from headers alone.

    ``key`` is the flattened DCP name (``"model.layers.0.weight"``); ``file`` the file holding it.
    """

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str = ""

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for dim in self.shape:
            n *= dim
        return n


def entry_of(key: str, tensor: torch.Tensor, file: str = "") -> Entry:
    return Entry(key, tensor.dtype, tuple(tensor.shape), file)


@dataclass
class Source(ABC):
    """A checkpoint to read: its tensors, its other values, and how its keys nest.

    Attributes:
        path: what the user named.
        kind: ``"dcp"``, ``"safetensors"`` or ``"torch"``.
        entries: every tensor, by flattened key, in the source's order.
        values: non-tensor values (ints, strings, ...) by flattened key; they are small and read
            in the coordinator.
        mapping: DCP ``planner_data`` (flattened key -> path in the nested structure), so a DCP
            output keeps the source's nesting; empty for flat formats.
        files: the files the source consists of (for inspect and fingerprints): paths, or URLs
            for a source on object storage.
        storage_options: fsspec options for a source at a URL (see :mod:`parallel_dcp.storage.location`).
    """

    path: str
    kind: str = ""
    entries: dict[str, Entry] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    mapping: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    storage_options: dict[str, Any] | None = None

    @property
    def location(self) -> Location:
        """The source's path, or a :class:`Remote` when it is a URL."""
        return locate(self.path, self.storage_options)

    def close(self) -> None:  # noqa: B027 (a no-op is right for sources that keep nothing)
        """In the coordinator, when the job is over: drop what opening the source kept."""

    @abstractmethod
    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """Read the tensors of ``keys`` (called in a worker; each result owns or maps its bytes)."""

    def check(self, keys: Iterable[str] | None = None) -> None:  # noqa: B027 (formats that check on open)
        """Before reading: raise CorruptCheckpointError when the files ``keys`` (or all) need are
        missing or shorter than recorded."""

    def load_values(self, keys: Iterable[str]) -> None:  # noqa: B027 (values read on open)
        """In the coordinator: read the non-tensor values of ``keys`` now (so an unsafe one fails
        here, by name, not in a worker)."""

    def value_bytes(self, key: str) -> int:
        """The size of a non-tensor value (its stored record, or its bytes), for admission."""
        value = self.values.get(key)
        if isinstance(value, (bytes, bytearray, memoryview)):
            return len(value)
        if isinstance(value, str):
            return len(value.encode(errors="surrogatepass"))
        if isinstance(value, (list, tuple, dict)):
            from parallel_dcp.engine.threads import plain_value

            if plain_value(value):  # pickling plain containers runs no user code
                import pickle

                return len(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        return 0

    def copied_bytes(self, key: str) -> int:
        """Memory a worker allocates to read ``key`` (a source on disk: all its bytes)."""
        return self.entries[key].nbytes

    def transient_bytes(self, key: str) -> int:
        """The part of :meth:`copied_bytes` (and :meth:`chunk_memory`) that a read frees before
        it returns (a buffer the bytes pass through), so a task holds it for one key at a time."""
        return 0

    def read_chunk(self, chunk: Chunk) -> torch.Tensor:
        """In a worker: rows ``chunk.start:chunk.stop`` of ``chunk.key`` along ``chunk.dim``.

        This fallback reads the whole tensor; formats that can read a slice override it.
        """
        return chunk.of(self.read([chunk.key])[chunk.key])

    def chunk_memory(self, chunk: Chunk) -> int:
        """Memory a worker allocates to read and write ``chunk`` (the fallback: the whole tensor,
        plus the chunk's copy, which DCP makes of any view)."""
        entry = self.entries[chunk.key]
        return entry.nbytes + chunk.nbytes(entry.dtype.itemsize)

    def release(self) -> None:  # noqa: B027 (a no-op is right for sources that open nothing)
        """Drop what reads opened or mapped (called in the worker after each task)."""

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this source cheaply: each file's name, size and modification time."""
        stats: dict[str, Any] = {}
        for name in self.files:
            where = locate(name, self.storage_options)
            if isinstance(where, Remote):
                stats[where.name] = where.fingerprint()
            else:
                st = where.stat()
                stats[where.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        path = self.path if isinstance(self.location, Remote) else os.path.abspath(self.path)
        return {"kind": self.kind, "path": path, "files": stats}

    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())
