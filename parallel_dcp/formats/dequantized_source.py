"""A quantized checkpoint seen as the dequantized one: each weight and its scale are one unit.

    inner source (HF directory or DCP)                     DequantizedSource (what the job plans)
      X.weight            float8_e4m3fn [R, C]   ─┐
      X.weight_scale_inv  float32 [R/128, C/128] ─┴──▶  X.weight  dtype [R, C]
      Y_blocks            uint8 [..., G, B]      ─┐
      Y_scales            uint8 [..., G]         ─┴──▶  Y         dtype [..., G * B * 2]
      anything else                               ───▶  as it is (the job casts it with ``dtype``)

Pairs are found by name over the whole source (a Hugging Face index's ``weight_map`` may put a
weight and its scale in different shards: each unit's read opens both), and checked from headers
before anything is written; E8M0 scales are also read once, in the coordinator, to refuse the
NaN exponent. A unit's memory counts the quantized input, the scale, the output and the float32
strip the arithmetic works in. Huge weights split into row ranges aligned to the block size, so
a chunk reads only its own rows and their scales (:meth:`DequantizedSource.split_alignment`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from parallel_dcp.errors import QuantizationError, describe_keys
from parallel_dcp.formats.base import Entry, Source
from parallel_dcp.formats.quantized import (
    DEFAULT_BLOCK,
    E8M0_NAN,
    FP8_DTYPES,
    dequantize_fp8,
    dequantize_mxfp4,
    fp8_scale_shape,
)
from parallel_dcp.storage.location import Remote

if TYPE_CHECKING:
    from parallel_dcp.engine.chunks import Chunk

__all__ = ["SCALE_SUFFIX", "DequantizedSource", "block_size_of", "dequantized_source"]

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
_BLOCKS, _SCALES = "_blocks", "_scales"
_WORK_BYTES = 32 * 1024 * 1024  # the arithmetic's float32 strip and its int64 nibble indices, at most


def block_size_of(source: Source, override: int | None = None) -> tuple[int, int]:
    """The FP8 block (rows, columns): ``override``, else ``quantization_config.weight_block_size``
    from ``config.json`` beside the source (a local directory), else 128 x 128."""
    if override is not None:
        if override < 1:
            raise QuantizationError(f"block size must be a positive number of elements, not {override}")
        return (override, override)
    config = source_config(source)
    size = (config or {}).get("quantization_config", {}).get("weight_block_size")
    if size is None:
        return (DEFAULT_BLOCK, DEFAULT_BLOCK)
    if isinstance(size, int):
        size = [size, size]
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(n, int) and n > 0 for n in size)):
        raise QuantizationError(f"config.json of {source.path}: weight_block_size {size!r} is not [rows, columns]")
    return (size[0], size[1])


def source_config(source: Source) -> dict[str, Any] | None:
    """``config.json`` in the source's directory (a local one), parsed; None when there is none."""
    if isinstance(source.location, Remote) or not os.path.isdir(source.path):
        return None
    path = os.path.join(source.path, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except ValueError as exc:
        raise QuantizationError(f"{path} is not JSON: {exc}") from exc
    return config if isinstance(config, dict) else None


@dataclass(frozen=True, slots=True)
class _Pair:
    """A quantized unit: its stored values, their scale, and how they decode."""

    values: str
    scale: str
    kind: str  # "fp8" or "mxfp4"


@dataclass
class DequantizedSource(Source):
    """``inner`` with every quantized pair replaced by its dequantized tensor (``dtype``)."""

    inner: Source | None = None
    dtype: torch.dtype = torch.bfloat16
    block: tuple[int, int] = (DEFAULT_BLOCK, DEFAULT_BLOCK)
    pairs: dict[str, _Pair] = field(default_factory=dict)  # output key -> its pair

    def _inner(self) -> Source:
        assert self.inner is not None
        return self.inner

    def _stored(self, keys: Iterable[str]) -> list[str]:
        """The inner keys that ``keys`` read."""
        out: list[str] = []
        for key in keys:
            pair = self.pairs.get(key)
            out += [pair.values, pair.scale] if pair else [key]
        return out

    def close(self) -> None:
        self._inner().close()

    def check(self, keys: Iterable[str] | None = None) -> None:
        """The inner files are there, and no selected E8M0 scale holds the NaN exponent (255)."""
        keys = list(self.entries) + list(self.values) if keys is None else list(keys)
        self._inner().check(self._stored(keys))
        bad = []
        for key in keys:
            pair = self.pairs.get(key)
            if pair is not None and pair.kind == "mxfp4":
                scales = self._inner().read([pair.scale])[pair.scale]
                if bool((scales == E8M0_NAN).any()):
                    bad.append(pair.scale)
                del scales
                self._inner().release()
        if bad:
            raise QuantizationError(
                f"{self.path}: E8M0 scales hold the exponent 255, which means NaN: {describe_keys(bad)} "
                "(nothing was written)",
                keys=bad,
            )

    def load_values(self, keys: Iterable[str]) -> None:
        self._inner().load_values(keys)

    def value_bytes(self, key: str) -> int:
        return self._inner().value_bytes(key)

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        keys = list(keys)
        data = self._inner().read(self._stored(keys))
        out: dict[str, torch.Tensor] = {}
        for key in keys:
            pair = self.pairs.get(key)
            if pair is None:
                out[key] = data[key]
            elif pair.kind == "fp8":
                out[key] = dequantize_fp8(data.pop(pair.values), data.pop(pair.scale), self.dtype, self.block)
            else:
                out[key] = dequantize_mxfp4(data.pop(pair.values), data.pop(pair.scale), self.dtype)
        return out

    def read_chunk(self, chunk: Chunk) -> torch.Tensor:
        pair = self.pairs.get(chunk.key)
        inner = self._inner()
        if pair is None:
            return inner.read_chunk(chunk)
        stored = inner.entries[pair.values]
        if pair.kind == "mxfp4" and chunk.dim == len(chunk.shape) - 1:
            return chunk.of(self.read([chunk.key])[chunk.key]).contiguous()  # split inside the packed groups
        piece = inner.read_chunk(dataclasses.replace(chunk, key=pair.values, shape=stored.shape))
        scale = inner.read([pair.scale])[pair.scale]
        if pair.kind == "fp8":
            row0, col0 = (chunk.start, 0) if chunk.dim == 0 else (0, chunk.start)
            return dequantize_fp8(piece, scale, self.dtype, self.block, row0=row0, col0=col0)
        return dequantize_mxfp4(piece, scale.narrow(chunk.dim, chunk.start, chunk.stop - chunk.start), self.dtype)

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
        out = self.entries[key].nbytes
        return inner.copied_bytes(pair.values) + inner.copied_bytes(pair.scale) + out + min(2 * out, _WORK_BYTES)

    def chunk_memory(self, chunk: Chunk) -> int:
        pair = self.pairs.get(chunk.key)
        inner = self._inner()
        if pair is None:
            return inner.chunk_memory(chunk)
        if pair.kind == "mxfp4" and chunk.dim == len(chunk.shape) - 1:
            return self.copied_bytes(chunk.key) + chunk.nbytes(self.dtype.itemsize)
        stored = inner.entries[pair.values]
        read = inner.chunk_memory(dataclasses.replace(chunk, key=pair.values, shape=stored.shape))
        out = chunk.nbytes(self.dtype.itemsize)
        return read + inner.copied_bytes(pair.scale) + out + min(2 * out, _WORK_BYTES)

    def transient_bytes(self, key: str) -> int:
        pair = self.pairs.get(key)
        if pair is None:
            return self._inner().transient_bytes(key)
        return min(2 * self.entries[key].nbytes, _WORK_BYTES)

    def release(self) -> None:
        self._inner().release()

    def fingerprint(self) -> dict[str, Any]:
        # What the output is made of includes the arithmetic: a resume must not mix dtypes.
        dequantize = {"dtype": str(self.dtype).removeprefix("torch."), "block": list(self.block)}
        return self._inner().fingerprint() | {"dequantize": dequantize}


def _pairs(source: Source, block: tuple[int, int]) -> dict[str, _Pair]:
    """The quantized pairs of ``source`` by output key, checked from headers.

    Raises:
        QuantizationError: every unpaired, mis-shaped or mis-typed tensor, listed.
    """
    entries = source.entries
    pairs: dict[str, _Pair] = {}
    problems: list[str] = []
    offenders: list[str] = []

    def refuse(key: str, why: str) -> None:
        offenders.append(key)
        problems.append(f"  {key!r}: {why}")

    for key, entry in entries.items():
        if key.endswith(SCALE_SUFFIX):
            weight = key.removesuffix(SCALE_SUFFIX)
            if weight not in entries:
                refuse(key, f"a scale without its weight {weight!r}")
                continue
            stored = entries[weight]
            if stored.dtype not in FP8_DTYPES:
                refuse(weight, f"has a {key.rsplit('.', 1)[-1]} but is {stored.dtype}, not FP8")
            elif len(stored.shape) != 2 or len(entry.shape) != 2:
                refuse(weight, f"block-scaled FP8 needs a 2-D weight and scale, not {stored.shape} and {entry.shape}")
            elif entry.shape != fp8_scale_shape(stored.shape, block):
                refuse(
                    key,
                    f"shape {list(entry.shape)} does not match the {block[0]}x{block[1]} blocks of "
                    f"{weight!r} {list(stored.shape)} (expected {list(fp8_scale_shape(stored.shape, block))})",
                )
            elif not entry.dtype.is_floating_point:
                refuse(key, f"a scale must be floating, not {entry.dtype}")
            else:
                pairs[weight] = _Pair(weight, key, "fp8")
        elif key.endswith(_SCALES) or key.endswith(_BLOCKS):
            stem = key.removesuffix(_SCALES).removesuffix(_BLOCKS)
            blocks, scales = stem + _BLOCKS, stem + _SCALES
            if key == scales and blocks not in entries:
                refuse(key, f"MXFP4 scales without their blocks {blocks!r}")
            elif key == blocks and scales not in entries:
                refuse(key, f"MXFP4 blocks without their scales {scales!r}")
            elif key == blocks:
                shape, scale_shape = entry.shape, entries[scales].shape
                if entry.dtype != torch.uint8 or entries[scales].dtype != torch.uint8:
                    refuse(key, f"MXFP4 blocks and scales are uint8, not {entry.dtype} and {entries[scales].dtype}")
                elif len(shape) < 2 or scale_shape != shape[:-1]:
                    refuse(scales, f"shape {list(scale_shape)} does not match the groups of {key!r} {list(shape)}")
                elif stem in entries:
                    refuse(key, f"dequantizes to {stem!r}, which the source also holds")
                else:
                    pairs[stem] = _Pair(key, scales, "mxfp4")
        elif entry.dtype in FP8_DTYPES and key + SCALE_SUFFIX not in entries:
            refuse(key, f"an FP8 weight without its scale {key + SCALE_SUFFIX!r}")
    if problems:
        shown = "\n".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise QuantizationError(f"{source.path} cannot be dequantized (nothing was written):\n{shown}", keys=offenders)
    return pairs


def dequantized_source(source: Source, dtype: torch.dtype, block: tuple[int, int] | None = None) -> DequantizedSource:
    """``source`` seen dequantized to ``dtype``: keys in the source's order, each pair at its weight's place.

    Raises:
        QuantizationError: see :func:`_pairs`; also a source with no quantized pair at all.
    """
    block = block or block_size_of(source)
    pairs = _pairs(source, block)
    if not pairs:
        raise QuantizationError(
            f"{source.path} holds no quantized tensors (X.weight + X.weight_scale_inv, or X_blocks + X_scales)"
        )
    view = DequantizedSource(
        path=source.path,
        kind=source.kind,
        values=source.values,
        files=list(source.files),
        storage_options=source.storage_options,
        trust_pickle=source.trust_pickle,
        inner=source,
        dtype=dtype,
        block=block,
    )
    scales = {p.scale for p in pairs.values()}
    by_values = {p.values: out for out, p in pairs.items()}
    for key, entry in source.entries.items():
        if key in scales:
            continue
        out = by_values.get(key)
        if out is None:
            view.entries[key] = entry
            view.mapping[key] = source.mapping.get(key, (key,))
            continue
        pair = pairs[out]
        shape = entry.shape if pair.kind == "fp8" else (*entry.shape[:-2], math.prod(entry.shape[-2:]) * 2)
        view.entries[out] = Entry(out, dtype, tuple(shape), entry.file)
        view.pairs[out] = pair
        path = source.mapping.get(key, (key,))
        view.mapping[out] = (*path[:-1], str(path[-1]).removesuffix(_BLOCKS)) if pair.kind == "mxfp4" else path
    for key, path in source.mapping.items():
        if key not in source.entries:
            view.mapping[key] = path
    return view
