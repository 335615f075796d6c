"""What every format offers the pipeline: list tensors without reading data, read a key subset;
and, for file-based formats, how to write one (:class:`FileFormat`).

A :class:`Source` is opened once in the coordinator (which lists it, reading headers only) and
read from in forked workers. Anything a worker opens (an mmap, a file handle) is opened lazily in
that worker and never shared, so a source is safe to fork before its first :meth:`Source.read`.
Which files a source reads (a file, or what the client loads from a folder): :mod:`.folder_files`.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.storage.location import Location, Remote, locate

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import TensorProperties

    from parallel_dcp.engine.chunks import Chunk
    from parallel_dcp.formats.folder_files import Folder
    from parallel_dcp.formats.range_read import RawRange

__all__ = [
    "MAX_ELEMENTS",
    "Entry",
    "FileFormat",
    "Source",
    "entry_of",
    "index_json",
]


# Dimensions (zero ones counted as one) multiply to less than this in any tensor torch can make.
MAX_ELEMENTS = 1 << 62


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a source, known from headers alone.

    ``key`` is the flattened DCP name (``"model.layers.0.weight"``); ``file`` the file holding it.
    """

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str = ""

    def __post_init__(self) -> None:
        # A zero-size tensor passes every byte-count check whatever its other dimensions; torch
        # cannot make one whose strides overflow int64 (it raised a bare RuntimeError in load).
        strides = 1
        for dim in self.shape:
            strides *= max(dim, 1)
        if strides >= MAX_ELEMENTS:
            raise CorruptCheckpointError(
                f"{self.file or 'the source'}: tensor {self.key!r} has the impossible shape {list(self.shape)} "
                "(its dimensions multiply past what torch can index; nothing was read or written)"
            )

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
        trust_pickle: unpickle values that need more than ``weights_only=True`` (runs their code;
            formats that pickle nothing ignore it).
        storage_options: fsspec options for a source at a URL (see :mod:`parallel_dcp.storage.location`).
        header_metadata: the free-form string metadata the source's files carry (safetensors'
            ``__metadata__``, without parallel_dcp's own checksums), which an output of the same
            format carries on (see :func:`parallel_dcp.formats.safetensors_format.header_metadata`).
        folder: a folder source as one look found it (its names, the file its config.json names:
            :class:`~parallel_dcp.formats.folder_files.Folder`), so opening it lists it and reads
            its config.json once: given by ``open_source`` (which looked to detect the format),
            else taken when the source opens; None for a file, and for formats that keep none.
        index: the index a sharded folder's files were chosen by (the client's, or the one its
            config.json names); None where none was read (a file, a folder read by its single
            ``model.safetensors``, one with no index).
    """

    path: str
    kind: str = ""
    entries: dict[str, Entry] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    mapping: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    storage_options: dict[str, Any] | None = None
    trust_pickle: bool = False
    header_metadata: dict[str, str] = field(default_factory=dict)
    folder: Folder | None = field(default=None, repr=False)
    index: Location | None = field(default=None, repr=False)

    @property
    def location(self) -> Location:
        """The source's path, or a :class:`Remote` when it is a URL."""
        return locate(self.path, self.storage_options)

    def keys(self) -> tuple[str, ...]:
        """Every key, tensors and other values, in the source's order (a format that interleaves
        them overrides this: the default lists the tensors first)."""
        entries = self.entries
        return (*entries, *(key for key in self.values if key not in entries))

    def stated_properties(self) -> Callable[[str], TensorProperties | None] | None:
        """Where the source states each tensor's ``TensorProperties`` (a DCP checkpoint's
        ``.metadata``: ``requires_grad``, ``pin_memory``): a lookup by key (None for a key it states
        nothing of), which a DCP output records instead of the read tensor's own. None: the source
        states none (a DCP output records the tensors' own, as ``dcp.save`` does)."""
        return None

    def close(self) -> None:  # noqa: B027 (a no-op is right for sources that keep nothing)
        """In the coordinator, when the job is over: drop what opening the source kept."""

    @abstractmethod
    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """Read the tensors of ``keys`` (called in a worker; each result owns or maps its bytes)."""

    def raw_ranges(self) -> dict[str, RawRange]:
        """Tensors stored as their own row-major bytes, and where (others: :meth:`read`)."""
        return {}

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

    def plain_tensors(self) -> bool:
        """True when every tensor read from this source is a plain CPU tensor (files always are;
        an in-memory state dict may hold DTensors), so DCP outputs take the lean path."""
        return True

    def copied_bytes(self, key: str) -> int:
        """Memory a worker allocates to read ``key`` (a source on disk: all its bytes)."""
        return self.entries[key].nbytes

    def tensor_sizes(self) -> dict[str, tuple[int, int]]:
        """``(Entry.nbytes, copied_bytes)`` per tensor where opening the source measured them in its
        one pass over the keys (an in-memory state dict); else empty: a job sizes each key itself."""
        return {}

    def transient_bytes(self, key: str) -> int:
        """The part of :meth:`copied_bytes` (and :meth:`chunk_memory`) that a read frees before
        it returns (a buffer the bytes pass through), so a task holds it for one key at a time."""
        return 0

    def read_chunk(self, chunk: Chunk) -> torch.Tensor:
        """In a worker: rows ``chunk.start:chunk.stop`` of ``chunk.key`` along ``chunk.dim``.

        This fallback reads the whole tensor; formats that can read a slice override it.
        """
        return chunk.of(self.read([chunk.key])[chunk.key])

    def split_alignment(self, key: str, dim: int) -> int:
        """Chunks of ``key`` split along ``dim`` start at multiples of this (1: anywhere; a
        block-quantized weight: its block size, so each chunk reads only its own blocks)."""
        return 1

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


@dataclass(frozen=True, slots=True)
class FileFormat:
    """How a file-based format writes: what the pipeline needs to produce a single file or a
    sharded Hugging Face style directory of it (registered in :mod:`parallel_dcp.formats`).

    Attributes:
        kind: the name users give it (``--to``).
        suffixes: a destination ending in one of these is a single file of this format.
        index_name: the index JSON of a sharded directory (``weight_map``, ``total_size``).
        shard_names: the file names of ``n`` shards (one shard: the format's single-file name).
        write: writes a flat dict of tensors (and, for formats that keep nesting, values nested
            again by the mapping) to a path or a write stream.
        tensors_only: the format holds tensors only (no ints, strings, ...).
        dtypes: the tensor dtypes it can hold (None: every one torch has).
        reserved_keys: names it keeps for itself (safetensors: ``__metadata__``).
        write_verifiable: for a format whose file can hold its own checksums (safetensors: in its
            header), writes a single-file output with them (``checksums=False``: sizes only);
            None: a single file of this format gets a sidecar manifest instead.
        carries_metadata: its files hold free-form string metadata (safetensors' ``__metadata__``):
            ``write`` and ``write_verifiable`` take a source's (``Source.header_metadata``) as
            ``metadata=`` and carry it on.
    """

    kind: str
    suffixes: tuple[str, ...]
    index_name: str
    shard_names: Callable[[int], list[str]]
    write: Callable[[dict[str, Any], Any, dict[str, tuple[Any, ...]] | None], None]
    tensors_only: bool = False
    dtypes: frozenset[torch.dtype] | None = None
    reserved_keys: frozenset[str] = frozenset()
    write_verifiable: Callable[..., None] | None = None
    carries_metadata: bool = False


def index_json(weight_map: dict[str, str], total_size: int) -> str:
    """A sharded directory's index, as Hugging Face writes it."""
    return json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2) + "\n"
