"""Find and check the quantized pairs of a checkpoint, from headers alone (before any write).

    FP8 block-scaled:  X.weight (float8) + X.weight_scale_inv (float, [ceil(R/Br), ceil(C/Bc)])
    MXFP4:             X_blocks (uint8 [..., G, B]) + X_scales (uint8 [..., G])  -> X

The FP8 block comes from ``--block-size``, else ``config.json``'s
``quantization_config.weight_block_size``, else 128 x 128.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from parallel_dcp._json import loads_json
from parallel_dcp.errors import CorruptCheckpointError, QuantizationError, describe_keys, dtype_name
from parallel_dcp.formats.base import Entry, Source
from parallel_dcp.formats.quantized import DEFAULT_BLOCK, FP8_DTYPES, MAX_BLOCK, fp8_scale_shape
from parallel_dcp.storage.location import Remote
from parallel_dcp.storage.safe_files import source_tree
from parallel_dcp.storage.safe_reader import read_in_tree

# A model's config.json is a few KiB; anything near this is not one.
_CONFIG_MAX_BYTES = 16 * 2**20

__all__ = [
    "BLOCKS_SUFFIX",
    "PER_CHANNEL_SUFFIX",
    "SCALES_SUFFIX",
    "SCALE_SUFFIX",
    "Pair",
    "block_size_of",
    "config_beside_file",
    "dequantized_dtype_of",
    "find_pairs",
    "named_pairs",
    "scale_name",
    "source_config",
]

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
PER_CHANNEL_SUFFIX = "_scale"  # X.weight -> X.weight_scale (compressed-tensors; not read)
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def block_size_of(source: Source, override: int | None = None) -> tuple[int, int]:
    """The FP8 block (rows, columns): ``override``, else ``quantization_config.weight_block_size``
    from ``config.json`` beside the source (a local directory), else 128 x 128."""
    if override is not None:
        if not 1 <= override <= MAX_BLOCK:
            raise QuantizationError(f"block size must be from 1 to {MAX_BLOCK} elements, not {override}")
        return (override, override)
    config = source_config(source)
    quantization = (config or {}).get("quantization_config")
    size = quantization.get("weight_block_size") if isinstance(quantization, dict) else None
    if size is None:
        return (DEFAULT_BLOCK, DEFAULT_BLOCK)
    if isinstance(size, int):
        size = [size, size]
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(n, int) and 0 < n <= MAX_BLOCK for n in size)):
        raise QuantizationError(f"config.json of {source.path}: weight_block_size {size!r} is not [rows, columns]")
    return (size[0], size[1])


def dequantized_dtype_of(source: Source, asked: torch.dtype | None) -> torch.dtype:
    """What ``--dequantize`` writes the weights as: ``asked`` (``--dtype``), else what transformers'
    own dequantizing load of the folder gives (``dtype="auto"``): the dtype its ``config.json``
    names (``dtype``, else ``torch_dtype``), or where it names none, the first floating tensor's
    that is not FP8 (by key; transformers reads its first shard's); bfloat16 where that is not
    bfloat16, float16 or float32, or there is no config.json (a DCP checkpoint). A float32 model's
    FP8 folder loads float32, and so does its dequantized copy."""
    if asked is not None:
        return asked
    config = source_config(source)
    if config is None:
        return torch.bfloat16
    named = config.get("dtype", config.get("torch_dtype"))
    wide = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if named is None:
        entries = source.entries
        plain = (entries[k].dtype for k in sorted(entries) if entries[k].dtype.is_floating_point)
        first = next((d for d in plain if d not in FP8_DTYPES), None)
        return first if first is not None and first in wide.values() else torch.bfloat16
    return wide.get(named, torch.bfloat16) if isinstance(named, str) else torch.bfloat16


def source_config(source: Source) -> dict[str, Any] | None:
    """``config.json`` of a local source, parsed: in its directory, or beside the one file it is
    (``SRC/model.safetensors``, ``SRC/pytorch_model.bin``: the model's, as for the folder, so
    ``--dtype`` keeps the same tensors either way); None when there is none."""
    path = _config_path(source)
    if path is None:
        return None
    folder = os.path.dirname(path)
    try:  # by the one rule: a config.json linking out of the folder is refused, never read
        config = loads_json(read_in_tree(path, source_tree(folder), limit=_CONFIG_MAX_BYTES))
    except CorruptCheckpointError:  # (a ValueError too) a link out of the folder, a FIFO, a huge file
        raise
    except ValueError as exc:
        raise QuantizationError(f"{path} is not JSON: {exc}") from exc
    return config if isinstance(config, dict) else None


def config_beside_file(source: Source) -> str | None:
    """The path of the ``config.json`` :func:`source_config` reads where ``source`` is one weights
    file (beside it, not the folder's own by being named as the source); None otherwise."""
    path = _config_path(source)
    return path if path is not None and not os.path.isdir(source.path) else None


def _config_path(source: Source) -> str | None:
    if isinstance(source.location, Remote):
        return None
    folder = source.path if os.path.isdir(source.path) else os.path.dirname(os.path.abspath(source.path))
    path = os.path.join(folder, "config.json")
    return path if os.path.lexists(path) and not os.path.isdir(path) else None


@dataclass(frozen=True, slots=True)
class Pair:
    """A quantized unit: its stored values, their scale, and how they decode."""

    values: str
    scale: str
    kind: str  # "fp8" or "mxfp4" (and "fp8-channel" from named_pairs: a layout dequantize does not read)


def named_pairs(entries: Mapping[str, Entry]) -> list[Pair]:
    """The quantized pairs ``entries`` hold by name and dtype alone, shapes unchecked (those
    :func:`find_pairs` checks): an FP8 ``X`` with ``X_scale_inv`` ("fp8"), or with the per-channel
    ``X_scale`` of compressed-tensors ("fp8-channel"); ``X_blocks`` with ``X_scales`` ("mxfp4").
    In the entries' order; nothing is refused (an unpaired tensor is simply in no pair)."""
    pairs = []
    for key, entry in entries.items():
        if entry.dtype in FP8_DTYPES and key + SCALE_SUFFIX in entries:
            pairs.append(Pair(key, key + SCALE_SUFFIX, "fp8"))
        elif entry.dtype in FP8_DTYPES and key + PER_CHANNEL_SUFFIX in entries:
            pairs.append(Pair(key, key + PER_CHANNEL_SUFFIX, "fp8-channel"))
        elif key.endswith(BLOCKS_SUFFIX) and key.removesuffix(BLOCKS_SUFFIX) + SCALES_SUFFIX in entries:
            pairs.append(Pair(key, key.removesuffix(BLOCKS_SUFFIX) + SCALES_SUFFIX, "mxfp4"))
    return pairs


def scale_name(kind: str, values: str) -> str | None:
    """The name a reader looks up the scale of ``values`` by, as transformers names the pairs of
    ``kind`` (a :class:`Pair`'s): ``X.weight`` -> ``X.weight_scale_inv`` ("fp8") or
    ``X.weight_scale`` ("fp8-channel"), ``X_blocks`` -> ``X_scales`` ("mxfp4"); None where
    ``values`` is not named as that kind's values are (an FP8 weight not called ``X.weight``)."""
    if kind == "mxfp4":
        return values.removesuffix(BLOCKS_SUFFIX) + SCALES_SUFFIX if values.endswith(BLOCKS_SUFFIX) else None
    if not values.endswith(".weight"):
        return None
    return values + (SCALE_SUFFIX if kind == "fp8" else PER_CHANNEL_SUFFIX)


def find_pairs(source: Source, block: tuple[int, int]) -> dict[str, Pair]:
    """The quantized pairs of ``source`` by output key, checked from headers.

    Raises:
        QuantizationError: every unpaired, mis-shaped or mis-typed tensor, listed.
    """
    entries = source.entries
    pairs: dict[str, Pair] = {}
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
                refuse(weight, f"has a {key.rsplit('.', 1)[-1]} but is {dtype_name(stored.dtype)}, not FP8")
            elif len(stored.shape) != 2 or len(entry.shape) != 2:
                refuse(weight, f"block-scaled FP8 needs a 2-D weight and scale, not {stored.shape} and {entry.shape}")
            elif entry.shape != fp8_scale_shape(stored.shape, block):
                refuse(
                    key,
                    f"shape {list(entry.shape)} does not match the {block[0]}x{block[1]} blocks of "
                    f"{weight!r} {list(stored.shape)} (expected {list(fp8_scale_shape(stored.shape, block))})",
                )
            elif not entry.dtype.is_floating_point:
                refuse(key, f"a scale must be floating, not {dtype_name(entry.dtype)}")
            else:
                pairs[weight] = Pair(weight, key, "fp8")
        elif key.endswith(SCALES_SUFFIX) or key.endswith(BLOCKS_SUFFIX):
            stem = key.removesuffix(SCALES_SUFFIX).removesuffix(BLOCKS_SUFFIX)
            blocks, scales = stem + BLOCKS_SUFFIX, stem + SCALES_SUFFIX
            if key == scales and blocks not in entries:
                refuse(key, f"MXFP4 scales without their blocks {blocks!r}")
            elif key == blocks and scales not in entries:
                refuse(key, f"MXFP4 blocks without their scales {scales!r}")
            elif key == blocks:
                shape, scale_shape = entry.shape, entries[scales].shape
                if entry.dtype != torch.uint8 or entries[scales].dtype != torch.uint8:
                    refuse(
                        key,
                        f"MXFP4 blocks and scales are uint8, not {dtype_name(entry.dtype)} and "
                        f"{dtype_name(entries[scales].dtype)}",
                    )
                elif len(shape) < 2 or scale_shape != shape[:-1]:
                    refuse(scales, f"shape {list(scale_shape)} does not match the groups of {key!r} {list(shape)}")
                elif stem in entries:
                    refuse(key, f"dequantizes to {stem!r}, which the source also holds")
                else:
                    pairs[stem] = Pair(key, scales, "mxfp4")
        elif entry.dtype in FP8_DTYPES and key + PER_CHANNEL_SUFFIX in entries:
            refuse(
                key,
                f"a per-channel FP8 weight (its scale {key + PER_CHANNEL_SUFFIX!r}: the compressed-tensors layout), "
                f"which dequantize does not read: it reads FP8 blocks (X.weight{SCALE_SUFFIX}) and MXFP4 only",
            )
        elif entry.dtype in FP8_DTYPES and key + SCALE_SUFFIX not in entries:
            refuse(key, f"an FP8 weight without its scale {key + SCALE_SUFFIX!r}")
    if problems:
        shown = problems[:20] + ([f"  ... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        if any("does not match the" in p and "blocks of" in p for p in problems):
            shown.append(
                f"  (blocks of {block[0]}x{block[1]}: quantization_config.weight_block_size of a config.json beside "
                "the source, else 128 x 128; --block-size N (block_size=N) gives the release's)"
            )
        raise QuantizationError(
            f"{source.path} cannot be dequantized (nothing was written):", keys=offenders, lines=shown
        )
    return pairs


def refuse_quantized(source: Source, keys: Sequence[str]) -> None:
    """Quantizing needs plain weights: FP8 weights, their scales (``X.weight_scale_inv``, or a
    per-channel ``X.weight_scale``) and MXFP4 ``X_blocks``/``X_scales`` among ``keys`` mean the
    source is quantized already. Quantizing around them would keep them and replace the config's
    ``quantization_config`` (an MXFP4 one included) by the FP8 one, under which transformers finds
    neither (the gpt-oss experts load random).

    Raises:
        QuantizationError: naming them and what to do, before anything is written.
    """
    entries = source.entries
    found = [
        k
        for k in keys
        if k in entries
        and (
            entries[k].dtype in FP8_DTYPES
            or k.endswith((SCALE_SUFFIX, ".weight" + PER_CHANNEL_SUFFIX))
            or (k.endswith(BLOCKS_SUFFIX) and k.removesuffix(BLOCKS_SUFFIX) + SCALES_SUFFIX in entries)
        )
    ]
    if not found:
        return
    per_channel = any(k.endswith(".weight" + PER_CHANNEL_SUFFIX) for k in found)
    how = (
        "a per-channel FP8 checkpoint (X.weight_scale, as compressed-tensors writes), which dequantize "
        "(--dequantize) does not read: dequantize it with its own tools first"
        if per_channel
        else "convert it with dequantize (--dequantize) to a plain checkpoint first, then quantize that"
    )
    raise QuantizationError(
        f"{source.path} is quantized already ({describe_keys(found)}): quantize (--quantize) needs plain "
        f"weights; {how} (nothing was written)",
        keys=found,
    )
