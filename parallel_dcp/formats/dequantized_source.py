"""A quantized checkpoint seen as the dequantized one: each weight and its scale are one unit.

    inner source (HF directory or DCP)                     DequantizedSource (what the job plans)
      X.weight            float8_e4m3fn [R, C]   ─┐
      X.weight_scale_inv  float32 [R/128, C/128] ─┴──▶  X.weight  dtype [R, C]
      Y_blocks            uint8 [..., G, B]      ─┐
      Y_scales            uint8 [..., G]         ─┴──▶  Y         dtype [..., G * B * 2]
      E_blocks (experts)  uint8 [E, N, G, B]     ─┐
      E_scales            uint8 [E, N, G]        ─┴──▶  E         dtype [E, G * B * 2, N]  (transformers' layout)
      anything else                               ───▶  as it is (the job casts it with ``dtype``)

Pairs are found by name over the whole source (a Hugging Face index's ``weight_map`` may put a
weight and its scale in different shards: each unit's read opens both), and checked from headers
before anything is written; E8M0 scales are also read once, in the coordinator, to refuse the
NaN exponent. A unit's memory counts the quantized input, the scale, the output and the strip the
arithmetic works in (4 MiB at most, never more than the unit's own elements call for:
:func:`~parallel_dcp.formats.quantized.dequantize_work_bytes`). Huge weights split into row ranges
aligned to the block size, so a chunk reads only its own rows and their scales
(:meth:`DequantizedSource.split_alignment`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from parallel_dcp.engine.chunks import split
from parallel_dcp.errors import QuantizationError, describe_keys
from parallel_dcp.formats.base import Entry, Source
from parallel_dcp.formats.fp8_fill import fp8_pending
from parallel_dcp.formats.other_quantization import refuse_other_quantization
from parallel_dcp.formats.quantized import (
    DEFAULT_BLOCK,
    E8M0_NAN,
    dequantize_fp8,
    dequantize_mxfp4,
    dequantize_mxfp4_experts,
    dequantize_work_bytes,
    mxfp4_is_experts,
    mxfp4_shape,
)
from parallel_dcp.formats.quantized_pairs import (
    BLOCKS_SUFFIX,
    SCALE_SUFFIX,
    Pair,
    block_size_of,
    find_pairs,
    source_config,
)
from parallel_dcp.formats.range_read import RawRange
from parallel_dcp.formats.wrapped_source import WrappedSource

if TYPE_CHECKING:
    from parallel_dcp.engine.chunks import Chunk

__all__ = ["SCALE_SUFFIX", "DequantizedSource", "block_size_of", "dequantized_source", "source_config"]

# The coordinator checks E8M0 scales for the NaN exponent in pieces of at most this much.
CHECK_PIECE_BYTES = 4 * 1024 * 1024


@dataclass
class DequantizedSource(WrappedSource):
    """``inner`` with every quantized pair replaced by its dequantized tensor (``dtype``)."""

    dtype: torch.dtype = torch.bfloat16
    block: tuple[int, int] = (DEFAULT_BLOCK, DEFAULT_BLOCK)
    pairs: dict[str, Pair] = field(default_factory=dict)  # output key -> its pair
    # Whether an FP8 pair is read as a PendingTensor that the shard writer fills by dequantizing
    # into its own buffers (formats.fp8_fill): set by the conversion for a DCP output written from
    # record templates (:func:`writes_computed`); a unit then holds no output tensor, and counts none.
    computed_writes: bool = False
    order: list[str] = field(default_factory=list)  # every key, tensors and values, as the source has them

    def keys(self) -> tuple[str, ...]:
        return tuple(self.order)

    def _stored(self, keys: Iterable[str]) -> list[str]:
        """The inner keys that ``keys`` read."""
        out: list[str] = []
        for key in keys:
            pair = self.pairs.get(key)
            out += [pair.values, pair.scale] if pair else [key]
        return out

    def check(self, keys: Iterable[str] | None = None) -> None:
        """The inner files are there, and no selected E8M0 scale holds the NaN exponent (255)."""
        keys = list(self.entries) + list(self.values) if keys is None else list(keys)
        self._inner().check(self._stored(keys))
        bad = []
        for key in keys:
            pair = self.pairs.get(key)
            if pair is not None and pair.kind == "mxfp4" and self._holds_nan(pair.scale):
                bad.append(pair.scale)
        if bad:
            raise QuantizationError(
                f"{self.path}: E8M0 scales hold the exponent 255, which means NaN: {describe_keys(bad)} "
                "(nothing was written)",
                keys=bad,
            )

    def raw_ranges(self) -> dict[str, RawRange]:
        """The inner source's, for the tensors kept as they are (a pair is computed)."""
        return {k: r for k, r in self._inner().raw_ranges().items() if k in self.entries and k not in self.pairs}

    def _holds_nan(self, scale: str) -> bool:
        """Whether E8M0 ``scale`` holds the exponent 255, read in pieces of at most
        :data:`CHECK_PIECE_BYTES` (this runs in the coordinator, before any task is admitted: a
        whole scale tensor of a large MoE would be read beside nothing that counts it)."""
        inner = self._inner()
        entry = inner.entries[scale]
        pieces: list[Chunk | None] = [*split(entry, CHECK_PIECE_BYTES)] or [None]
        for piece in pieces:
            values = inner.read([scale])[scale] if piece is None else inner.read_chunk(piece)
            found = bool((values == E8M0_NAN).any())
            del values
            inner.release()
            if found:
                return True
        return False

    def read(self, keys: Iterable[str]) -> dict[str, Any]:  # type: ignore[override]
        keys = list(keys)
        data = self._inner().read(self._stored(keys))
        out: dict[str, Any] = {}
        for key in keys:
            pair = self.pairs.get(key)
            if pair is None:
                out[key] = data[key]
            elif pair.kind == "fp8":
                weight, scale = data.pop(pair.values), data.pop(pair.scale)
                if self._computed(pair):
                    out[key] = fp8_pending(weight, scale, self.dtype, self.block)
                else:
                    out[key] = dequantize_fp8(weight, scale, self.dtype, self.block)
            else:
                out[key] = self._mxfp4(data.pop(pair.values), data.pop(pair.scale))
        return out

    def _mxfp4(self, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        if mxfp4_is_experts(tuple(blocks.shape)):
            return dequantize_mxfp4_experts(blocks, scales, self.dtype)
        return dequantize_mxfp4(blocks, scales, self.dtype)

    def _computed(self, pair: Pair) -> bool:
        """Whether ``pair`` is read as a PendingTensor the writer fills (see ``computed_writes``)."""
        return self.computed_writes and pair.kind == "fp8"

    def _stored_dim(self, pair: Pair, dim: int) -> int | None:
        """The dimension of ``pair``'s stored values that output dimension ``dim`` runs along;
        None for the unpacked groups of MXFP4 (its values interleave inside the packed bytes)."""
        if pair.kind == "fp8":
            return dim
        shape = self._inner().entries[pair.values].shape
        if mxfp4_is_experts(shape):
            return {0: 0, 2: 1}.get(dim)  # [E, G * B * 2, N] from [E, N, G, B]
        return dim if dim < len(shape) - 2 else None

    def read_chunk(self, chunk: Chunk) -> Any:  # type: ignore[override]
        pair = self.pairs.get(chunk.key)
        inner = self._inner()
        if pair is None:
            return inner.read_chunk(chunk)
        stored = inner.entries[pair.values]
        dim = self._stored_dim(pair, chunk.dim)
        if dim is None:
            return chunk.of(self.read([chunk.key])[chunk.key]).contiguous()  # split inside the packed groups
        piece = inner.read_chunk(dataclasses.replace(chunk, key=pair.values, dim=dim, shape=stored.shape))
        scale = inner.read([pair.scale])[pair.scale]
        if pair.kind == "fp8":
            row0, col0 = (chunk.start, 0) if chunk.dim == 0 else (0, chunk.start)
            if self._computed(pair):
                return fp8_pending(piece, scale, self.dtype, self.block, row0=row0, col0=col0)
            return dequantize_fp8(piece, scale, self.dtype, self.block, row0=row0, col0=col0)
        return self._mxfp4(piece, scale.narrow(dim, chunk.start, chunk.stop - chunk.start))

    def split_alignment(self, key: str, dim: int) -> int:
        pair = self.pairs.get(key)
        if pair is not None and pair.kind == "fp8" and dim < 2:
            return self.block[dim]
        return 1

    def copied_bytes(self, key: str) -> int:
        pair = self.pairs.get(key)
        if pair is None:
            return self._inner().copied_bytes(key)
        inner = self._inner()
        out = 0 if self._computed(pair) else self.entries[key].nbytes
        work = dequantize_work_bytes(self.entries[key].nbytes // self.dtype.itemsize)
        return inner.copied_bytes(pair.values) + inner.copied_bytes(pair.scale) + out + work

    def chunk_memory(self, chunk: Chunk) -> int:
        pair = self.pairs.get(chunk.key)
        inner = self._inner()
        if pair is None:
            return inner.chunk_memory(chunk)
        dim = self._stored_dim(pair, chunk.dim)
        if dim is None:
            return self.copied_bytes(chunk.key) + chunk.nbytes(self.dtype.itemsize)
        stored = inner.entries[pair.values]
        read = inner.chunk_memory(dataclasses.replace(chunk, key=pair.values, dim=dim, shape=stored.shape))
        out = 0 if self._computed(pair) else chunk.nbytes(self.dtype.itemsize)
        return read + inner.copied_bytes(pair.scale) + out + dequantize_work_bytes(chunk.nbytes(1))

    def transient_bytes(self, key: str) -> int:
        pair = self.pairs.get(key)
        # Not the arithmetic's strip: freed strips stay in the worker's heap (glibc keeps them for
        # the next allocation), so a task holding several units was measured to keep one per unit.
        return self._inner().transient_bytes(pair.values if pair else key)

    def release(self) -> None:
        self._inner().release()

    def fingerprint(self) -> dict[str, Any]:
        # What the output is made of includes the arithmetic: a resume must not mix dtypes.
        dequantize = {"dtype": str(self.dtype).removeprefix("torch."), "block": list(self.block)}
        return self._inner().fingerprint() | {"dequantize": dequantize}


def dequantized_source(source: Source, dtype: torch.dtype, block: tuple[int, int] | None = None) -> DequantizedSource:
    """``source`` seen dequantized to ``dtype``: keys in the source's order, each pair at its weight's place.

    Raises:
        QuantizationError: see :func:`find_pairs`; also a source with no quantized pair at all.
    """
    block = block or block_size_of(source)
    pairs = find_pairs(source, block)
    if not pairs:
        refuse_other_quantization(source, source.keys(), "dequantize (--dequantize)", "cannot read its layout")
        raise QuantizationError(
            f"{source.path} holds no quantized tensors (X.weight + X.weight_scale_inv, or X_blocks + X_scales)"
        )
    view = DequantizedSource.around(source, values=source.values, dtype=dtype, block=block)
    scales = {p.scale for p in pairs.values()}
    by_values = {p.values: out for out, p in pairs.items()}
    for key in source.keys():  # noqa: SIM118 (a Source is not a dict: its keys in order)
        entry = source.entries.get(key)
        if key in scales:
            continue
        out = by_values.get(key)
        if out is None:
            view.order.append(key)
            if entry is not None:
                view.entries[key] = entry
                view.mapping[key] = source.mapping.get(key, (key,))
            continue
        assert entry is not None  # (a pair's values are a tensor)
        view.order.append(out)
        pair = pairs[out]
        shape = entry.shape if pair.kind == "fp8" else mxfp4_shape(entry.shape)
        view.entries[out] = Entry(out, dtype, tuple(shape), entry.file)
        view.pairs[out] = pair
        path = source.mapping.get(key, (key,))
        view.mapping[out] = (*path[:-1], str(path[-1]).removesuffix(BLOCKS_SUFFIX)) if pair.kind == "mxfp4" else path
    for key, path in source.mapping.items():
        if key not in source.entries:
            view.mapping[key] = path
    return view
