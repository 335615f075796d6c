"""The ``config.json`` of a converted Hugging Face directory, made to say what the shards hold.

    config.json (copied from the source, or --copy-files-from)
        always           ──▶  no "transformers_weights" (the weights file it names is not in the output)
        --dtype D        ──▶  "dtype": D and "torch_dtype": D   (transformers 5 reads "dtype", 4 "torch_dtype")
        --dequantize     ──▶  no "quantization_config"; both dtypes the dequantized one
        --quantize       ──▶  "quantization_config": FP8 blocks + "modules_to_not_convert" (what stayed
                              unquantized, by output name); both dtypes --dtype's when given
    target.extra_files["config.json"]: committed with the shards, in place of the copy

A config that says another dtype than the shards' loads them as that dtype without a word
(transformers 5 reads ``dtype`` first and casts), and one that keeps ``quantization_config`` after a
dequantize asks for scales that are gone. So the config follows the data. Decided (and a broken
config.json refused) before anything is written.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from parallel_dcp._json import loads_json
from parallel_dcp.errors import printable
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.other_quantization import other_method
from parallel_dcp.formats.quantized import FP8_DTYPES
from parallel_dcp.formats.quantized_pairs import SCALE_SUFFIX, source_config
from parallel_dcp.formats.quantizing_source import QuantizingSource
from parallel_dcp.jobs.copy_files import read_copies
from parallel_dcp.jobs.quantization import Quantization
from parallel_dcp.jobs.targets import Job, ShardedTarget, Target

__all__ = ["CONFIG_FILE", "modules_not_converted", "output_config", "prepare_config"]

CONFIG_FILE = "config.json"
# The weights file a config.json names (transformers 5 loads it before the folder's own shards):
# never in an output, so never written into one (save_pretrained drops it too).
_NAMED_WEIGHTS = "transformers_weights"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def modules_not_converted(job: Job, *, tied: bool = False) -> list[str]:
    """The modules (output names, ``X`` of ``X.weight``, sorted) whose 2-D floating weight a quantizing
    job leaves unquantized: what transformers must keep as plain layers (routers, embeddings,
    ``lm_head``, and whatever ``quantize_keys`` did not select), and, where transformers renames
    such a weight on load, its module by that name too (transformers matches the list against the
    names it loads). Norms and biases are 1-D: no layer of transformers' FP8 replaces them, so they
    are not listed."""
    entries = job.source.entries
    out = []
    for key in job.keys:
        entry = entries.get(key)
        if entry is None or not key.endswith(".weight") or len(entry.shape) != 2:
            continue
        if entry.dtype in FP8_DTYPES and key + SCALE_SUFFIX in entries:
            continue
        if entry.dtype.is_floating_point:
            out.append(key.removesuffix(".weight"))
    if tied and "lm_head" not in out:  # tied to the embedding: no weight of its own here, and plain as it is
        out.append("lm_head")
    if isinstance(job.source, QuantizingSource):  # (transformers matches the list against the names it loads)
        out += [m for m in job.source.loaded_plain if m not in out]
    return sorted(out)


def output_config(
    config: dict[str, Any], dtype: torch.dtype | None, quantization: Quantization | None, job: Job
) -> dict[str, Any]:
    """``config`` updated to describe the output of ``job`` (a new dict; see the module doc)."""
    config = {k: v for k, v in config.items() if k != _NAMED_WEIGHTS}
    data_dtype = dtype
    if quantization is not None and quantization.dequantize:
        config.pop("quantization_config", None)
        data_dtype = quantization.dequantize_dtype
    elif quantization is not None and quantization.quantize is not None:
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(quantization.block()),
            "modules_to_not_convert": modules_not_converted(job, tied=config.get("tie_word_embeddings") is True),
        }
    if data_dtype is not None:
        # Both keys, the same value: transformers 5 reads "dtype" and falls back to "torch_dtype".
        config["dtype"] = config["torch_dtype"] = _name(data_dtype)
    return config


def _follow_the_data(target: ShardedTarget, job: Job) -> None:
    """A copied config.json whose ``quantization_config`` promises quantized weights the shards do
    not hold, where no option changed them (a dequantized checkpoint written out with its
    release's files): written without it, so transformers builds plain layers for plain weights.
    One of a scheme the tool does not read (GPTQ, bitsandbytes: their tensors copied unchanged)
    is kept: its shards hold what it promises, under names this check does not know.
    One that names a weights file (``transformers_weights``, which the output never holds: its
    weights are its own shards) is written without that, as ``save_pretrained`` writes it, so
    transformers loads the output's shards. Otherwise (its dtype included: transformers casts on
    load as it would from the source) it is copied byte for byte."""
    try:
        config = loads_json(read_copies(target.copies, [CONFIG_FILE])[CONFIG_FILE])
    except ValueError:
        return  # copied as it is, as before
    if not isinstance(config, dict):
        return
    dropped = {_NAMED_WEIGHTS} if _NAMED_WEIGHTS in config else set()
    if "quantization_config" in config and other_method(config) is None and not _quantized(job):
        dropped.add("quantization_config")
    if not dropped:
        return
    plain = {k: v for k, v in config.items() if k not in dropped}
    target.extra_files[CONFIG_FILE] = (json.dumps(plain, indent=2) + "\n").encode()


def _quantized(job: Job) -> bool:
    """The job's source holds quantized weights (FP8 with scales, MXFP4 blocks)."""
    entries = job.source.entries
    return any(k.endswith("_blocks") or (k in entries and entries[k].dtype in FP8_DTYPES) for k in job.source_keys())


def prepare_config(
    target: Target, source: Source, job: Job, dtype: torch.dtype | None, quantization: Quantization | None
) -> None:
    """Set the output's ``config.json`` (``target.extra_files``) when the conversion changes what
    it must say: a sharded directory output, with ``--dtype``, ``--dequantize`` or ``--quantize``.

    The config is the one being copied (the source's or ``copy_files_from``'s); a (de)quantized
    safetensors output takes the source's own even when nothing is copied.

    Raises:
        ValueError: that config.json is not a JSON object (:class:`QuantizationError` for the
            source's own, read when nothing is copied).
    """
    if not isinstance(target, ShardedTarget):
        return
    active = quantization if quantization is not None and quantization.active else None
    if active is not None and active.quantize is not None and target.kind != "safetensors":
        active = None  # transformers reads FP8 blocks from safetensors only: no quantization_config
    copied = target.copies.get(CONFIG_FILE)
    if dtype is None and active is None:
        if copied is not None and target.extra_files.get(CONFIG_FILE) is None:
            _follow_the_data(target, job)
        return
    given = target.extra_files.get(CONFIG_FILE)  # a preset's model config, written as the output's
    if given is not None:
        config = loads_json(given)
    elif copied is not None:
        raw = read_copies(target.copies, [CONFIG_FILE])[CONFIG_FILE]
        try:
            config = loads_json(raw)
        except ValueError as exc:
            raise ValueError(
                f"{printable(str(copied))} is not JSON, so it cannot be made to describe the output: {exc} "
                "(nothing was written; fix it, or convert with --no-copy-files)"
            ) from exc
        if not isinstance(config, dict):
            raise ValueError(f"{printable(str(copied))} is not a JSON object (nothing was written)")
    elif active is not None and target.kind == "safetensors":
        config = source_config(source)  # a (de)quantized Hugging Face output always gets one
        if config is None:
            return
    else:
        return
    target.extra_files[CONFIG_FILE] = (json.dumps(output_config(config, dtype, active, job), indent=2) + "\n").encode()
