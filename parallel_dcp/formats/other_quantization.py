"""Releases quantized by a scheme this tool does not dequantize (GPTQ, AWQ, bitsandbytes, ...).

The tool dequantizes FP8 blocks and MXFP4 only (:mod:`parallel_dcp.formats.quantized_pairs`).
Any other scheme stores integer codes beside float scales (GPTQ's ``scales``, bitsandbytes'
``absmax`` and ``quant_map``) that its own reader combines. A plain conversion copies them as
they are; ``--dtype`` would round those scales while the output keeps the ``quantization_config``,
so the scheme's reader would compute other weights with no error. Such a release is known by its
``config.json`` (beside the folder's weights, or beside a weights file named alone), else by the
key layouts below, which no plain checkpoint has:

    GPTQ / AWQ:           X.qweight (int32) + X.qzeros + X.scales (+ X.g_idx)
    bitsandbytes 4-bit:   X.weight (uint8) + X.weight.absmax + X.weight.quant_map + X.weight.quant_state.*
    bitsandbytes 8-bit:   X.weight (int8) + X.SCB
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from parallel_dcp.errors import QuantizationError, describe_keys
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.quantized_pairs import source_config

__all__ = ["DEQUANTIZED_METHODS", "other_method", "other_quantization", "refuse_other_quantization"]

# The quant_method names of the layouts dequantize reads (transformers' FP8 block and MXFP4 configs).
DEQUANTIZED_METHODS = frozenset({"fp8", "mxfp4"})


def other_method(config: dict[str, Any] | None) -> str | None:
    """The ``quant_method`` of ``config``'s ``quantization_config``, when it names one the tool does
    not dequantize (bitsandbytes' older configs name none: their ``load_in_4bit`` / ``load_in_8bit``)."""
    quantization = (config or {}).get("quantization_config")
    if not isinstance(quantization, dict):
        return None
    method = quantization.get("quant_method")
    if method is None and (quantization.get("load_in_4bit") or quantization.get("load_in_8bit")):
        method = "bitsandbytes"
    if not isinstance(method, str) or method.lower() in DEQUANTIZED_METHODS:
        return None
    return method


def _layout_keys(source: Source, keys: Iterable[str]) -> tuple[str, list[str]] | None:
    """The scheme and its keys among ``keys``, when their names show a layout of the module doc."""
    entries = source.entries
    gptq, bnb4, bnb8 = [], [], []
    for key in keys:
        if key not in entries:
            continue
        if key.endswith(".qweight") and key.removesuffix("qweight") + "scales" in entries:
            gptq.append(key)
        elif key.endswith((".weight.absmax", ".weight.quant_map")) or ".weight.quant_state." in key:
            bnb4.append(key)
        elif (
            key.endswith(".SCB")
            and getattr(entries.get(key.removesuffix("SCB") + "weight"), "dtype", None) == torch.int8
        ):
            bnb8.append(key)
    if gptq:
        return "GPTQ / AWQ (X.qweight, X.qzeros, X.scales)", gptq
    if bnb4:
        return "bitsandbytes 4-bit (X.weight.absmax, X.weight.quant_map, X.weight.quant_state.*)", bnb4
    if bnb8:
        return "bitsandbytes 8-bit (X.weight int8, X.SCB)", bnb8
    return None


def other_quantization(source: Source, keys: Iterable[str]) -> tuple[str, list[str]] | None:
    """What shows ``source`` quantized by a scheme the tool does not dequantize: a description and
    the keys that show it (none where it is the config), or None. Reads config.json and headers only."""
    try:
        config = source_config(source)
    except QuantizationError:  # not JSON: the copy's own check refuses it, in its words, where it matters
        config = None
    method = other_method(config)
    if method is not None:
        return f"quantized by {method} (quant_method {method!r} in its config.json's quantization_config)", []
    found = _layout_keys(source, keys)
    if found is None:
        return None
    scheme, shown = found
    return f"quantized by {scheme}: {describe_keys(shown)}", shown


def refuse_other_quantization(source: Source, keys: Iterable[str], asked: str, why: str) -> None:
    """Refuse ``asked`` (the option, as the user gave it) on a release :func:`other_quantization`
    finds, saying ``why`` it cannot be done and that a plain conversion copies it unchanged.

    Raises:
        QuantizationError: before anything is written.
    """
    found = other_quantization(source, keys)
    if found is None:
        return
    what, shown = found
    raise QuantizationError(
        f"{source.path} is {what}, which this tool does not dequantize (it reads FP8 blocks and MXFP4 only): "
        f"{asked} {why}; convert without it to copy the release unchanged, or dequantize it with its own "
        "library first (nothing was written)",
        keys=shown,
    )
