"""An in-memory state dict read by workers that did not fork from its owner (``parallel_dcp.Saver``).

    coordinator (holds the state dict)             worker (started before the state dict existed)
    ──────────────────────────────────             ──────────────────────────────────────────────
    flatten, check; shell() once, and per task     with_part(part): a source of the task's keys
    part(keys): its tensors' addresses, shapes,    only (entries, values, layouts), on the shell
    strides, dtypes (no bytes)        ── pickle ─▶ read(keys):
                                                   - a tensor of >= PENDING_MIN_BYTES whose storage
                                                     is exactly its bytes: a PendingTensor; the
                                                     writer copies it with process_vm_readv straight
                                                     into its aligned buffer (one copy, GIL released,
                                                     no fresh memory: storage/pending.py)
                                                   - smaller ones: one gathered read (a call per
                                                     1,024 tensors) into one fresh buffer
                                                   - a view with gaps: its span copied, then DCP's
                                                     copy of its elements

Only what is copied into fresh memory is charged (``copied_bytes``, ``chunk_memory``): admission
plans for it; a pending tensor costs the writer's buffers, which the task's stream charges already.
The coordinator must keep the tensors alive and unchanged until the save returns (it does: the
caller is inside ``save``).

Longer than 300 lines because the coordinator's side (the shell and the per-task parts, built
in columns) and the worker's side (reading those parts back) must agree field by field: kept
together, a change to one is seen beside the other.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import numpy
import torch

from parallel_dcp.engine.chunks import Chunk
from parallel_dcp.engine.remote_memory import read_gathered, read_into
from parallel_dcp.errors import InvalidStateDictError
from parallel_dcp.formats import lean
from parallel_dcp.formats.base import Entry
from parallel_dcp.formats.memory_format import MemorySource
from parallel_dcp.storage.pending import PendingTensor
from parallel_dcp.storage.records import LEAN_DTYPES

__all__ = ["PENDING_MIN_BYTES", "RemoteMemorySource", "SourcePart"]

# Tensors at least this large are copied by the writer, straight into its buffers; a smaller one
# costs more in per-tensor calls (a copy call, a fill) than its copy through a gathered buffer.
PENDING_MIN_BYTES = 64 * 1024

_dtype, _shape, _grad = attrgetter("dtype"), attrgetter("shape"), attrgetter("requires_grad")


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where a tensor (or a view of one) lies in the coordinator: first element, sizes, strides;
    ``span``: bytes from the first element to past the last (a view's gaps included)."""

    address: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    span: int
    nbytes: int
    contiguous: bool

    def narrow(self, chunk: Chunk) -> _Layout:
        first = self.address + chunk.start * self.strides[chunk.dim] * self.itemsize
        return _layout(first, chunk.sizes, self.strides, self.itemsize)

    def memory(self) -> int:
        """What a worker allocates: see :func:`_copied`."""
        return _copied(self.span, self.nbytes)

    def pending(self) -> bool:
        """Whether the writer may copy these bytes itself, straight into its buffers: large
        enough, and the span exactly the elements (contiguous, or a dense permutation: the storage)."""
        return self.span == self.nbytes >= PENDING_MIN_BYTES


@dataclass(frozen=True, slots=True)
class SourcePart:
    """The columns a worker reads a task's keys from (:meth:`RemoteMemorySource.part`): per tensor
    its key, dtype, sizes, strides and address in the coordinator; the task's other values and
    its keys' paths in the nesting (DCP's ``planner_data``); ``grads``: the keys whose tensor
    requires grad (DCP records it in ``.metadata``: a Saver writes what ``save`` does)."""

    keys: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    strides: list[tuple[int, ...]]
    addresses: list[int]
    values: dict[str, Any]
    mapping: dict[str, tuple[Any, ...]]
    grads: frozenset[str] = frozenset()
    # The keys whose tensor is a lazy view: (its conjugate bit, its negative bit).
    lazy: dict[str, tuple[bool, bool]] = field(default_factory=dict)


def _requiring_grad(keys: Sequence[str], tensors: Iterable[torch.Tensor]) -> frozenset[str]:
    """The keys whose tensor requires grad (one C pass over the tensors)."""
    return frozenset(compress(keys, map(_grad, tensors)))


def _rebuilt(
    keys: Iterable[str],
    dtypes: Iterable[torch.dtype],
    shapes: Iterable[Any],
    strides: Iterable[Any],
    addresses: Iterable[int],
) -> tuple[dict[str, Entry], dict[str, _Layout]]:
    """In a worker: the entries and layouts of the tensors the columns describe."""
    entries: dict[str, Entry] = {}
    layouts: dict[str, _Layout] = {}
    for key, dtype, shape, stride, address in zip(keys, dtypes, shapes, strides, addresses, strict=True):
        entries[key] = Entry(key, dtype, shape)
        layouts[key] = _layout(address, shape, stride, dtype.itemsize)
    return entries, layouts


def _copied(span: int, nbytes: int) -> int:
    """What a worker allocates for a tensor: the span copied, and DCP's copy of a view with gaps."""
    return span + (nbytes if span != nbytes else 0)


def _layout(address: int, sizes: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> _Layout:
    numel = math.prod(sizes)
    contiguous = True
    expected = 1
    for n, s in zip(reversed(sizes), reversed(strides), strict=True):
        if n != 1 and s != expected:
            contiguous = False
        expected *= n
    if contiguous or numel == 0:
        span = numel * itemsize
    else:
        span = (1 + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))) * itemsize
    return _Layout(address, sizes, strides, itemsize, span, numel * itemsize, contiguous)


@dataclass
class RemoteMemorySource(MemorySource):
    """A :class:`MemorySource` whose pickled form carries where each tensor lies, not its bytes.

    In the coordinator a tensor is its sizes (the columns :class:`MemorySource` keeps, with what a
    worker copies) and the tensor itself; no :class:`_Layout` per key: the workers build those
    from the columns the pickle carries (addresses and strides, read in one C pass each).
    """

    # Whether the writer may copy large tensors itself (PendingTensor): only where it writes them
    # from a record template (torch.save's CRC off, a tested dtype) and on the lean path (no value
    # that DCP's planner must see); else every tensor is copied here and charged.
    pending_writes: bool = True
    _owner: int = 0
    _layouts: dict[str, _Layout] = field(default_factory=dict, repr=False)
    # In a worker: the keys whose tensor requires grad in the coordinator (read back as such).
    _grads: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        super().__post_init__()
        self._owner = os.getpid()
        tensors = list(map(self._flat.__getitem__, self.entries))
        if not self._plain:
            key, tensor = next((k, t) for k, t in zip(self.entries, tensors, strict=True) if type(t) not in lean._PLAIN)
            raise InvalidStateDictError(
                f"{key!r} is a {type(tensor).__name__} on {tensor.device}: a Saver writes plain CPU tensors; "
                "save this state dict with parallel_dcp.save"
            )
        self.pending_writes = self.pending_writes and lean.lean_eligible(self.values.values())
        # What a worker copies: a contiguous tensor's span is its bytes (torch's rule is _layout's);
        # nothing for a tensor the writer copies itself.
        contiguous = map(torch.Tensor.is_contiguous, tensors)
        lazy = self._lazy
        pends = self.pending_writes
        self._sizes = {
            key: (
                nbytes,
                (
                    0
                    if pends
                    and nbytes >= PENDING_MIN_BYTES
                    and self.entries[key].dtype in LEAN_DTYPES
                    and key not in lazy
                    else nbytes
                )
                if whole
                else self._memory(key, self._layout_of(key)),
            )
            for (key, (nbytes, _)), whole in zip(self._sizes.items(), contiguous, strict=True)
        }

    def _layout_of(self, key: str) -> _Layout:
        """``key``'s layout: built on unpickling in a worker, from the tensor in the coordinator."""
        layout = self._layouts.get(key)
        if layout is not None:
            return layout
        tensor = self._flat[key]
        return _layout(tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.element_size())

    def __getstate__(self) -> dict[str, Any]:
        # Columns of plain ints and strings, not one dataclass per key: pickling 50,000 Entry and
        # _Layout objects costs the coordinator ~10 us a key, these columns a fraction of that.
        state = dict(self.__dict__)
        state.pop("_leaves", None)  # (a reopened source's leaves: the tensors, never sent)
        state["state_dict"], state["_flat"], state["entries"], state["_sizes"] = None, {}, {}, {}
        entries = self.entries.values()
        dtypes = list(map(_dtype, entries))
        names = {dtype: str(dtype).removeprefix("torch.") for dtype in set(dtypes)}
        tensors = list(map(self._flat.__getitem__, self.entries))
        state["_layouts"] = (
            tuple(self.entries),
            list(map(names.__getitem__, dtypes)),
            list(map(_shape, entries)),
            list(map(torch.Tensor.stride, tensors)),
            list(map(torch.Tensor.data_ptr, tensors)),
        )
        state["_grads"] = _requiring_grad(tuple(self.entries), tensors)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        keys, dtype_names, shapes, strides, addresses = state.pop("_layouts")
        self.__dict__.update(state)
        names = {name: getattr(torch, name) for name in set(dtype_names)}
        dtypes = map(names.__getitem__, dtype_names)
        self.entries, self._layouts = _rebuilt(keys, dtypes, shapes, strides, addresses)

    def reopened(
        self,
        state_dict: Any,
        flat: dict[str, Any],
        values: dict[str, Any],
        path: str,
        *,
        leaves: tuple[Sequence[str], Sequence[Any]] | None = None,
    ) -> RemoteMemorySource:
        """In the coordinator: this source's listing (entries, sizes, nesting) over ``state_dict``
        (flattened: ``flat``; its non-tensor ``values``), which the caller found laid out as this
        one's, key by key (:mod:`parallel_dcp.jobs.plan_reuse`), saved to ``path``: no pass over
        the keys here. ``leaves``: every key in order and its leaf, of which ``flat`` is made at
        its first use instead (``flat`` is then ignored): a later save whose parts were all kept
        never looks a tensor up by key, and the dict costs a pass over the keys (~4 ms at 50,000)."""
        source = object.__new__(type(self))
        source.__dict__.update(self.__dict__)
        source.__dict__.pop("_leaves", None)
        source.state_dict, source.values, source.path = state_dict, values, path
        if leaves is None:
            source._flat = flat
        else:
            source.__dict__.pop("_flat", None)  # made by __getattr__ at its first use
            source.__dict__["_leaves"] = leaves
        source._owner, source._layouts, source._grads = os.getpid(), {}, frozenset()
        return source

    if not TYPE_CHECKING:  # (mypy would take every misspelt attribute for this one)

        def __getattr__(self, name: str) -> Any:
            """Reached only where ``name`` is not set: a reopened source's ``_flat``, made from
            its ``leaves`` (see :meth:`reopened`) at its first use."""
            if name == "_flat" and "_leaves" in self.__dict__:
                keys, found = self.__dict__.pop("_leaves")
                flat = self.__dict__["_flat"] = dict(zip(keys, found, strict=True))
                return flat
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def shell(self) -> RemoteMemorySource:
        """In the coordinator: this source without any key (what every worker of a pool that
        outlives one job receives once; each task's keys come with it: :meth:`part`)."""
        shell = object.__new__(type(self))
        shell.__dict__.update(self.__dict__)
        shell.__dict__.pop("_leaves", None)
        shell.state_dict, shell._flat, shell._sizes, shell._layouts = None, {}, {}, {}
        shell.entries, shell.values, shell.mapping, shell._grads = {}, {}, {}, frozenset()
        shell._lazy = {}
        return shell

    def part(self, keys: Sequence[str]) -> SourcePart:
        """In the coordinator: what a worker needs to read ``keys`` and nothing else, in columns
        (a few C passes over ``keys``; no object per key)."""
        entries, values, mapping = self.entries, self.values, self.mapping
        tensor_keys = list(filter(entries.__contains__, keys))
        listed = list(map(entries.__getitem__, tensor_keys))
        tensors = list(map(self._flat.__getitem__, tensor_keys))
        return SourcePart(
            tensor_keys,
            list(map(_dtype, listed)),
            list(map(_shape, listed)),
            list(map(torch.Tensor.stride, tensors)),
            list(map(torch.Tensor.data_ptr, tensors)),
            {key: values[key] for key in keys if key in values} if values else {},
            {key: mapping[key] for key in keys if key in mapping},
            _requiring_grad(tensor_keys, tensors),
            {key: self._lazy[key] for key in tensor_keys if key in self._lazy} if self._lazy else {},
        )

    def with_part(self, part: SourcePart) -> RemoteMemorySource:
        """In a worker, on the shell: a source of ``part``'s keys only."""
        source = object.__new__(type(self))
        source.__dict__.update(self.__dict__)
        source.entries, source._layouts = _rebuilt(part.keys, part.dtypes, part.shapes, part.strides, part.addresses)
        source.values, source.mapping, source._sizes = part.values, part.mapping, {}
        source._grads = part.grads
        source._lazy = part.lazy
        return source

    def plain_tensors(self) -> bool:
        return True

    def copied_bytes(self, key: str) -> int:
        sizes = self._sizes.get(key)
        return sizes[1] if sizes is not None else self._memory(key, self._layout_of(key))

    def chunk_memory(self, chunk: Chunk) -> int:
        return self._memory(chunk.key, self._layout_of(chunk.key).narrow(chunk))

    def _pends(self, key: str, layout: _Layout) -> bool:
        return (
            self.pending_writes
            and layout.pending()
            and self.entries[key].dtype in LEAN_DTYPES
            and key not in self._lazy
        )

    def _memory(self, key: str, layout: _Layout) -> int:
        """What a worker allocates to read ``layout``: nothing where the writer copies it (see
        :meth:`_Layout.pending`); else :meth:`_Layout.memory`."""
        return 0 if self._pends(key, layout) else layout.memory()

    def read(self, keys: Iterable[str]) -> dict[str, Any]:  # type: ignore[override]
        """The tensors of ``keys``, in order: a :class:`PendingTensor` for each large one whose
        storage is exactly its bytes (the writer copies it); a lazy view copied into a buffer of
        its own and resolved there (in a shared buffer it could lie misaligned for its dtype, and
        torch's complex kernels crash on such memory); the others copied in one gathered read
        into one buffer, each owning just its bytes of it (an alias, as ``exact_storage`` makes),
        so writers see whole tensors."""
        keys = list(keys)
        out: dict[str, Any] = dict.fromkeys(keys)
        copied = []
        for key in keys:
            layout = self._layout_of(key)
            if self._pends(key, layout):
                out[key] = self._pending(key, layout)
            elif key in self._lazy:  # resolved in place: in memory of its own, aligned for its dtype
                out[key] = self._fetch(key, layout)
            else:
                copied.append((key, layout))
        buffer = numpy.empty(sum(layout.span for _, layout in copied), dtype=numpy.uint8)
        if buffer.size:
            read_gathered(self._owner, [(layout.address, layout.span) for _, layout in copied], buffer.ctypes.data)
        offset = 0
        for key, layout in copied:
            piece = torch.from_numpy(buffer[offset : offset + layout.span])
            out[key] = self._shaped(key, layout, piece)
            offset += layout.span
        return out

    def read_chunk(self, chunk: Chunk) -> Any:  # type: ignore[override]
        layout = self._layout_of(chunk.key).narrow(chunk)
        return self._pending(chunk.key, layout) if self._pends(chunk.key, layout) else self._fetch(chunk.key, layout)

    def _pending(self, key: str, layout: _Layout) -> PendingTensor:
        owner, address = self._owner, layout.address

        def fill(offset: int, nbytes: int, destination: int) -> None:
            read_into(owner, address + offset, nbytes, destination)

        grad = key in self._grads
        return PendingTensor(self.entries[key].dtype, layout.sizes, layout.strides, layout.nbytes, fill, grad)

    def _fetch(self, key: str, layout: _Layout) -> torch.Tensor:
        buffer = torch.empty(layout.span, dtype=torch.uint8)
        if layout.span:
            read_into(self._owner, layout.address, layout.span, buffer.data_ptr())
        return self._shaped(key, layout, buffer)

    def _shaped(self, key: str, layout: _Layout, raw: torch.Tensor) -> torch.Tensor:
        """``raw`` (the span's bytes) viewed as the tensor: its dtype, sizes and strides, and
        requiring grad where the coordinator's does."""
        dtype = self.entries[key].dtype
        if layout.nbytes == 0:
            shaped = torch.empty(layout.sizes, dtype=dtype)
        elif layout.contiguous:
            shaped = raw.view(dtype).view(layout.sizes)
        else:
            shaped = torch.as_strided(raw.view(dtype), layout.sizes, layout.strides)
        conj, neg = self._lazy.get(key, (False, False))
        if conj:  # a lazy view's values, from its bytes: in place, in this worker's copy (never a
            # PendingTensor: the writer would copy the bytes as they are)
            shaped.conj_physical_()
        if neg:
            shaped.neg_()
        return shaped.detach().requires_grad_() if key in self._grads else shaped
