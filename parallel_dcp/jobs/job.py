"""A job: the units of work selected from a source (keys, or chunks of large tensors), the dtype
floats become, and per unit what it writes and needs in memory (planned once, before any worker
starts), and the worker-side read of a task's units."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from operator import itemgetter
from typing import Any

import torch

from parallel_dcp.engine.chunks import Chunk, chunk_count, split
from parallel_dcp.formats.base import Source
from parallel_dcp.storage.pending import PendingTensor

__all__ = ["Job"]


@dataclass(frozen=True, slots=True)
class Job:
    """What to write: units of work selected from the source, and the dtype floats become.

    A unit is a source key, or (for a tensor split by :mod:`parallel_dcp.engine.chunks`) the name of one
    of its chunks, mapped to the chunk in ``chunks``.
    """

    source: Source
    keys: tuple[str, ...]
    dtype: torch.dtype | None = None
    chunks: dict[str, Chunk] = field(default_factory=dict)
    # unit -> (bytes written, memory needed): asked for several times per unit while planning.
    _sizes: dict[str, tuple[int, int]] = field(default_factory=dict, compare=False, repr=False)
    _ordered_sizes: dict[str, tuple[int, int]] = field(default_factory=dict, compare=False, repr=False)
    _positions: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    # What the planning reads of the sizes as a whole (see :meth:`totals`): kept with them.
    _totals: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # Source keys ``dtype`` leaves as they are (what transformers keeps in float32: kept_float32.py).
    keep_dtype: frozenset[str] = frozenset()
    # The source files a conversion's tasks check as they read them (a jobs.source_check.SourceChecks).
    checks: Any = None

    def positions(self) -> dict[str, int]:
        """Each unit's place in ``keys``: where its entries go in ``.metadata`` (built once per
        process, on first use)."""
        if not self._positions and self.keys:
            self._positions.update(zip(self.keys, range(len(self.keys))))
        return self._positions

    def source_keys(self) -> list[str]:
        """The source keys the units cover, in order, each once."""
        if not self.chunks:
            return list(self.keys)
        return list(dict.fromkeys(self.chunks[u].key if u in self.chunks else u for u in self.keys))

    def split(self, threshold: int, admit: Callable[[str, int, int], None] | None = None) -> Job:
        """This job with every tensor larger than ``threshold`` bytes split into chunks;
        ``admit(key, chunks, bytes)`` (the governor's ``admit_units``) runs before each tensor's
        chunks are built."""
        entries = self.source.entries
        known = self.source.tensor_sizes()
        if known and max(map(itemgetter(0), known.values())) <= threshold:
            return self  # no tensor of the source needs splitting (one C pass over its sizes)
        if not any(entry.nbytes > threshold for entry in map(entries.get, self.keys) if entry is not None):
            return self  # nothing to split: this job, with the sizes it computed already (50,000 keys: 0.1 s)
        taken = set(self.keys)
        units: list[str] = []
        chunks: dict[str, Chunk] = {}
        for key in self.keys:
            entry = entries.get(key)
            pieces = []
            if entry is not None and entry.nbytes > threshold:  # aligned to a quantized weight's blocks
                if admit is not None:
                    admit(key, chunk_count(entry, threshold), entry.nbytes)
                pieces = split(entry, threshold, partial(self.source.split_alignment, key))
            if not pieces:
                units.append(key)
            for piece in pieces:
                name = f"{key}[{piece.dim}:{piece.start}:{piece.stop}]"
                while name in taken:
                    name += "'"
                taken.add(name)
                units.append(name)
                chunks[name] = piece
        known = {unit: self._sizes[unit] for unit in units if unit in self._sizes}  # whole keys keep theirs
        return Job(self.source, tuple(units), self.dtype, chunks, known, keep_dtype=self.keep_dtype, checks=self.checks)

    def sizes(self) -> dict[str, tuple[int, int]]:
        """(bytes written, memory needed) of every unit, in ``keys`` order: the planning passes
        over 50,000 keys read this dict instead of calling :meth:`out_bytes` and :meth:`memory`."""
        if len(self._ordered_sizes) != len(self.keys):
            known = self._sizes
            if not known and self.dtype is None:  # uncast whole tensors: as the source sized them
                known.update(self.source.tensor_sizes())
            for unit in self.keys:
                if unit not in known:  # values, chunks, casts
                    self._sized(unit)
            self._ordered_sizes.clear()
            self._ordered_sizes.update(zip(self.keys, map(known.__getitem__, self.keys)))
        return self._ordered_sizes

    def totals(self) -> tuple[int, int, int]:
        """The bytes every unit writes, and the largest memory a unit needs with its place in
        ``keys`` (the first of equals; 0 and -1 without units): one C pass each over the sizes,
        made once per job (a Saver's later save of a layout keeps them with its sizes)."""
        found = self._totals.get("totals")
        if found is None or found[0] != len(self.keys):
            sizes = self.sizes()
            memories = list(map(itemgetter(1), sizes.values()))
            most = max(memories, default=0)
            total = sum(map(itemgetter(0), sizes.values()))
            found = (len(self.keys), total, most, memories.index(most) if memories else -1)
            self._totals["totals"] = found
        return found[1], found[2], found[3]

    def out_bytes(self, unit: str) -> int:
        """Bytes of tensor data ``unit`` writes (0 for other values)."""
        return self._sized(unit)[0]

    def memory(self, unit: str) -> int:
        """What a worker allocates for ``unit``: its read (or copy), plus the cast result."""
        return self._sized(unit)[1]

    def transient(self, unit: str) -> int:
        """The part of :meth:`memory` the read frees before it returns (see ``Source.transient_bytes``)."""
        chunk = self.chunks.get(unit)
        key = chunk.key if chunk else unit
        return self.source.transient_bytes(key) if key in self.source.entries else 0

    def _sized(self, unit: str) -> tuple[int, int]:
        sizes = self._sizes.get(unit)
        if sizes is None:  # once per unit, for every unit before any worker starts: kept to one pass
            source = self.source
            chunk = self.chunks.get(unit)
            key = chunk.key if chunk else unit
            entry = source.entries.get(key)
            if entry is None:  # a non-tensor value: its pickle, made in the worker
                sizes = (0, source.value_bytes(key) if key in source.values else 0)
            else:
                out = self.out_dtype(entry.dtype, key)
                nbytes = chunk.nbytes(out.itemsize) if chunk else entry.nbytes // entry.dtype.itemsize * out.itemsize
                read = source.chunk_memory(chunk) if chunk else source.copied_bytes(key)
                sizes = (nbytes, read + (nbytes if out != entry.dtype else 0))
            self._sizes[unit] = sizes
        return sizes

    def out_dtype(self, dtype: torch.dtype, key: str | None = None) -> torch.dtype:
        """What a tensor of ``dtype`` (of source key ``key``) is written as."""
        if self.dtype is None or not dtype.is_floating_point or key in self.keep_dtype:
            return dtype
        return self.dtype

    def read(self, units: tuple[str, ...]) -> dict[str, Any]:
        """In a worker: the task's tensors and chunks (read and cast) and other values, by unit."""
        whole = [u for u in units if u in self.source.entries]
        data: dict[str, Any] = dict(self.source.read(whole))
        for unit in units:
            if unit in self.chunks:
                data[unit] = self.source.read_chunk(self.chunks[unit])
            elif unit not in data:
                data[unit] = self.source.values[unit]
        for unit, value in data.items():
            key = self.chunks[unit].key if unit in self.chunks else unit
            if isinstance(value, PendingTensor) and self.out_dtype(value.dtype, key) != value.dtype:
                value = value.materialize()  # cast: the bytes must be here
            if isinstance(value, torch.Tensor) and self.out_dtype(value.dtype, key) != value.dtype:
                data[unit] = value.to(self.out_dtype(value.dtype, key))
        # In the task's order, tensors and values interleaved as in the source: a torch.save
        # output nests them again in this order (tensors first would reorder every level).
        return {unit: data[unit] for unit in units}
