"""Dequantize and quantize as steps of a conversion (see :mod:`parallel_dcp.formats.quantized`).

    source ── dequantize: DequantizedSource (pairs found and checked) ── select keys ── ...
    source ── select keys ── quantize: QuantizingSource (weights the rule picks) ── rename ── ...

A Hugging Face output gets the source's ``config.json`` with ``quantization_config`` removed
(dequantize) or set to the FP8 block layout (quantize), see :mod:`parallel_dcp.jobs.hf_config`;
a quantized one always has its index.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from parallel_dcp.errors import QuantizationError, describe_keys
from parallel_dcp.formats import lean
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.dequantized_source import DequantizedSource, block_size_of, dequantized_source
from parallel_dcp.formats.other_quantization import refuse_other_quantization
from parallel_dcp.formats.quantized import FP8_DTYPES, MAX_BLOCK
from parallel_dcp.formats.quantized_pairs import (
    PER_CHANNEL_SUFFIX,
    SCALE_SUFFIX,
    config_beside_file,
    dequantized_dtype_of,
    refuse_quantized,
)
from parallel_dcp.formats.quantizing_source import DEFAULT_RULE, parse_quantize, quantizing_source
from parallel_dcp.jobs.built_model import FP8_LAYERS, NAMES, refuse_unrelated_config
from parallel_dcp.jobs.fp8_layers import Fp8Layers, fp8_layers, model_config, unknown_names
from parallel_dcp.jobs.kept_pairs import check_pairs_named  # (here before; its rule is kept_pairs' now)
from parallel_dcp.jobs.targets import DcpTarget, Job, ShardedTarget, Target
from parallel_dcp.options import Options
from parallel_dcp.storage.records import LEAN_DTYPES, fills_uninitialised

__all__ = [
    "Quantization",
    "check_pairs_named",
    "dequantize_step",
    "prepare_target",
    "quantize_step",
    "with_dequantized_dtype",
    "write_computed",
]


@dataclass(frozen=True, slots=True)
class Quantization:
    """What a conversion does to quantized tensors: ``dequantize`` to ``dequantize_dtype`` (None:
    the dtype the source's config.json names, else bfloat16; see :func:`with_dequantized_dtype`)
    (block from ``block_size``, else config.json, else 128), or ``quantize`` (``"fp8-block[:B]"``)
    the weights ``quantize_keys`` select (None: :data:`DEFAULT_RULE`)."""

    dequantize: bool = False
    dequantize_dtype: torch.dtype | None = None
    quantize: str | None = None
    quantize_keys: str | Sequence[str] | None = None
    block_size: int | None = None

    def __post_init__(self) -> None:
        if self.dequantize and self.quantize is not None:
            raise QuantizationError("dequantize and quantize exclude each other: convert in two steps")
        if self.quantize is not None:
            parse_quantize(self.quantize)
        if self.quantize_keys is not None and self.quantize is None:
            raise QuantizationError("quantize_keys selects weights for quantize=; give quantize='fp8-block' too")
        if self.block_size is not None and not 1 <= self.block_size <= MAX_BLOCK:
            raise QuantizationError(f"block_size must be from 1 to {MAX_BLOCK}, not {self.block_size}")

    @property
    def active(self) -> bool:
        return self.dequantize or self.quantize is not None

    def block(self) -> tuple[int, int]:
        """The quantize block (``fp8-block:B``, else ``block_size``, else 128)."""
        assert self.quantize is not None
        if ":" not in self.quantize and self.block_size is not None:
            return (self.block_size, self.block_size)
        return parse_quantize(self.quantize)

    def describe(self) -> str:
        """One line for a dry run: what happens to quantized tensors, and which rule picks them."""
        if self.dequantize:
            return f"dequantize FP8 block / MXFP4 pairs to {self.dequantize_dtype} (scales dropped)"
        rule = f"keys matching {self.quantize_keys!r}" if self.quantize_keys is not None else DEFAULT_RULE
        size = self.block()
        return f"quantize to float8_e4m3fn in {size[0]}x{size[1]} blocks: {rule}"


def with_dequantized_dtype(quantization: Quantization | None, source: Source) -> Quantization | None:
    """``quantization`` with the dtype ``dequantize`` writes settled for ``source``
    (:func:`~parallel_dcp.formats.quantized_pairs.dequantized_dtype_of`), so that the weights, the
    output's config.json and a dry run's note all say the same."""
    if quantization is None or not quantization.dequantize or quantization.dequantize_dtype is not None:
        return quantization
    return dataclasses.replace(quantization, dequantize_dtype=dequantized_dtype_of(source, None))


def dequantize_step(source: Source, quantization: Quantization) -> Source:
    """``source`` seen dequantized (before keys are selected: ``keys`` names output tensors)."""
    dtype = dequantized_dtype_of(source, quantization.dequantize_dtype)
    return dequantized_source(source, dtype, block_size_of(source, quantization.block_size))


def write_computed(job: Job, target: Target, options: Options) -> None:
    """Let the shard writer dequantize FP8 weights straight into its buffers (formats.fp8_fill):
    for a DCP output (lean path: no value DCP's planner must see) whose records come from class
    templates (torch.save's CRC off, a tested dtype, no fill of new tensors), where the job writes
    the dequantized dtype as it is. Set before planning: a unit then counts no output tensor."""
    source = job.source
    if (
        isinstance(source, DequantizedSource)
        and isinstance(target, DcpTarget)
        and not options.crc32
        and source.dtype in LEAN_DTYPES
        and job.out_dtype(source.dtype) == source.dtype
        and not fills_uninitialised()
        and lean.lean_eligible(source.values.values())
    ):
        source.computed_writes = True


def quantize_step(
    source: Source,
    selected: tuple[str, ...],
    quantization: Quantization,
    dtype: torch.dtype | None,
    keep: frozenset[str] = frozenset(),
    copy_files_from: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    *,
    renamed: bool = False,
) -> tuple[Source, tuple[str, ...]]:
    """``source`` restricted to ``selected`` with its weights quantized; other floats cast to
    ``dtype``, but for those in ``keep``. The default rule quantizes only what transformers' FP8
    path loads into FP8 layers, for the model the output's config.json (``copy_files_from``'s, else
    the source's) describes (:mod:`parallel_dcp.jobs.fp8_layers`); where that cannot be known, by
    name, with a warning. ``renamed``: a preset named ``source``'s keys for another client.

    Raises:
        QuantizationError: ``selected`` holds quantized tensors already, or the rule selects none.
        ConfigMismatchError: the config.json is beside ``source``, one weights file named as the
            source, and describes another model (none of the file's tensor names).
        MemoryLimitExceeded: the child that builds the model passed ``limit``.
    """
    replaced, named, loaded_module = None, "", None
    refuse_quantized(source, selected)  # before building a model to classify them
    refuse_other_quantization(source, selected, "quantize (--quantize)", "needs plain weights")
    config = model_config(source, copy_files_from)
    # (a config the user named by --copy-files-from is the model's by their word)
    beside = config_beside_file(source) if config is not None and copy_files_from is None and not renamed else None
    questions = frozenset([NAMES] if beside is not None else [])
    # (its child stays under the job's limit, or the job is refused; the keys as keys_kept asks: one child)
    keys = sorted(source.entries)
    layers = fp8_layers(config, limit, questions, keys)
    if isinstance(layers, Fp8Layers) and beside is not None and config is not None:
        deciding = "which weights --quantize quantizes, nor be the output's config.json"
        refuse_unrelated_config(source, beside, config, questions | {FP8_LAYERS}, limit, deciding)
    if isinstance(layers, Fp8Layers):
        replaced, named, loaded_module = layers.classify, layers.architecture, layers.loaded_module
    elif config is not None and quantization.quantize_keys is None:
        unknown = unknown_names(config, limit, keys)
        if unknown:  # (renamed on load by its class, the model unbuilt: left plain, never quantized by name)
            replaced, named = (lambda key: None if key in unknown else True), str(config["architectures"][0])
        warnings.warn(
            f"could not tell which weights transformers' FP8 layers replace ({layers}): the default rule "
            "picks them by name only, and a weight of a module other than nn.Linear (GPT-2's Conv1D, an "
            "embedding not named 'embed') would load as raw FP8 codes where transformers does not dequantize; "
            "install transformers, or choose the weights with quantize_keys (--quantize-keys)",
            stacklevel=4,
        )
    return quantizing_source(
        source, selected, quantization.block(), quantization.quantize_keys, dtype, keep, replaced, named, loaded_module
    )


def prepare_target(target: Target, quantization: Quantization) -> None:
    """A quantized Hugging Face output always has its index (stock's quantized reader pairs
    weights and scales through it); its ``config.json`` is :mod:`parallel_dcp.jobs.hf_config`'s."""
    if isinstance(target, ShardedTarget) and target.kind == "safetensors":
        target.always_index = quantization.quantize is not None


def refuse_cast_of_pairs(source: Source, selected: Sequence[str], dtype: torch.dtype) -> None:
    """``dtype`` without dequantizing, on FP8 weights that have scales (``X.weight_scale_inv``
    as DeepSeek and transformers name them, or ``X.weight_scale``): the cast would keep their
    codes as numbers and round the float32 scales, and a reader that dequantizes the result
    (transformers, with the ``quantization_config`` the output keeps) would get other weights,
    with no error. The same holds for a release of another scheme (GPTQ, AWQ, bitsandbytes:
    :mod:`parallel_dcp.formats.other_quantization`), refused after these.

    Raises:
        QuantizationError: naming the weights, before anything is written.
    """
    entries, chosen = source.entries, set(selected)
    scaled = [
        k
        for k in selected
        if k in entries
        and entries[k].dtype in FP8_DTYPES
        and (k + SCALE_SUFFIX in chosen or k.removesuffix("weight") + "weight_scale" in chosen)
    ]
    per_channel = [k for k in scaled if k + PER_CHANNEL_SUFFIX in chosen]
    if per_channel:
        raise QuantizationError(
            f"{source.path} holds per-channel FP8 weights ({describe_keys(per_channel)}, their scales "
            f"X.weight{PER_CHANNEL_SUFFIX}: the compressed-tensors layout); dtype="
            f"{str(dtype).removeprefix('torch.')} (--dtype) would cast their codes and round their scales, and "
            f"dequantize (--dequantize) does not read this layout (FP8 blocks with X.weight{SCALE_SUFFIX} and MXFP4 "
            "only): leave --dtype out to copy them as they are, or dequantize them with compressed-tensors first",
            keys=per_channel,
        )
    if scaled:
        raise QuantizationError(
            f"{source.path} holds FP8 weights with scales ({describe_keys(scaled)}); dtype="
            f"{str(dtype).removeprefix('torch.')} (--dtype) without dequantize (--dequantize) would cast their "
            "codes and round their scales: add --dequantize for weights in that dtype, or leave --dtype out "
            "to copy them as they are",
            keys=scaled,
        )
    refuse_other_quantization(
        source,
        selected,
        f"dtype={str(dtype).removeprefix('torch.')} (--dtype)",
        "would round its float scales while the output keeps its quantization_config, so its reader "
        "would compute other weights, with no error",
    )
