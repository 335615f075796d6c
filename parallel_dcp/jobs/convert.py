"""Conversion between DCP, safetensors and torch.save, in either direction, with the write pipeline.

    source path ── detect format ── open (headers only) ── select keys ── rename ── run_job(target) ──▶ dst
                                                                                 └─ dry run: plan only

The memory governor is created before the source is opened, so whatever opening loads (a legacy
torch.save file) counts against the limit. Several sources convert one after the other, each
with the whole pool, each into its own destination. A source's checksums are checked as it is read (source_check.py).
Longer than 300 lines because convert_one orders every check of a conversion before its first
write in one place, where a reader sees which comes first.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.errors import plural, printable
from parallel_dcp.formats import open_source
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.safetensors_format import SafetensorsSource
from parallel_dcp.formats.validate import empty_mapping
from parallel_dcp.jobs.copy_files import check_no_clash, checked_copies
from parallel_dcp.jobs.dryrun import DryRunPlan, plan_dry_run
from parallel_dcp.jobs.hf_config import prepare_config
from parallel_dcp.jobs.kept_float32 import kept_by_copied_config, keys_kept
from parallel_dcp.jobs.kept_pairs import check_pairs_named, check_pairs_selected
from parallel_dcp.jobs.key_patterns import matcher, patterns_of
from parallel_dcp.jobs.pipeline import SaveResult
from parallel_dcp.jobs.presets import Preset, PresetStep, apply_preset
from parallel_dcp.jobs.quantization import (
    Quantization,
    dequantize_step,
    prepare_target,
    quantize_step,
    refuse_cast_of_pairs,
    with_dequantized_dtype,
    write_computed,
)
from parallel_dcp.jobs.rename import RenameRules, rename_source
from parallel_dcp.jobs.runner import run_job
from parallel_dcp.jobs.source_check import source_checks, warn_unchecked_direct
from parallel_dcp.jobs.streamed import measured_stream_source, stream_source
from parallel_dcp.jobs.target_keys import check_keys_fit
from parallel_dcp.jobs.targets import Job, ShardedTarget, Target, target_for, warn_metadata_left_out
from parallel_dcp.jobs.top_level import refuse_non_mapping
from parallel_dcp.options import DEFAULT_SHARD_SIZE, Options
from parallel_dcp.storage.io_mode import resolve_io
from parallel_dcp.storage.location import Remote, is_url, locate, same_place
from parallel_dcp.storage.protocol import WriteLocation
from parallel_dcp.storage.read_choice import ReadChoice

__all__ = ["convert_one", "destinations", "parse_dtype", "select_keys"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """A floating dtype from ``torch.bfloat16`` or a name (``"bfloat16"``, ``"bf16"``, ``"fp16"``...).

    Raises:
        ValueError: not a floating dtype.
    """
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and not value.is_floating_point:
            raise ValueError(f"dtype casts floating tensors, so it must be a floating dtype, not {value}")
        return value
    name = value.lower().removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {value!r}: use one of {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


def select_keys(source: Source, patterns: str | Sequence[str] | None) -> tuple[str, ...]:
    """The source's keys (tensors and other values, in the source's order) that ``patterns`` select.

    A pattern is a glob matched against the whole flattened key (``"model.layers.*.weight"``,
    ``"*embed*"``; ``*`` also crosses dots), or, prefixed with ``re:``, a Python regular expression
    that must match the whole key (``"re:model\\.layers\\.[0-3]\\..*"``) (see
    :mod:`parallel_dcp.jobs.key_patterns`). A key is selected when any pattern matches. None
    selects everything.

    Raises:
        KeyPatternError: a bad regular expression (a ValueError).
        ValueError: patterns that select nothing (the keys are listed so the user can correct them).
    """
    keys = list(source.keys())
    if patterns is None:
        return tuple(keys)
    patterns = patterns_of(patterns)
    matchers = [matcher(pattern) for pattern in patterns]
    exact = set(patterns)  # a pattern that is itself a key selects it (glob characters and all)
    selected = tuple(k for k in keys if k in exact or any(m(k) for m in matchers))
    if not selected:
        sample = ", ".join(printable(k) for k in keys[:5]) + (" ..." if len(keys) > 5 else "")
        raise ValueError(f"keys {patterns} select nothing in {source.path} (its keys: {sample})")
    return selected


def destinations(sources: Sequence[str | os.PathLike[str]], dst: str | os.PathLike[str]) -> list[str]:
    """Where each source goes: ``dst`` itself for one source; ``dst/<source name>`` for several.

    For several sources, each output is a directory named after its source without its format
    suffix (``dst/model`` from ``a/model.pt``), in the format ``to`` (DCP by default); two sources
    with the same name are refused.
    """
    if len(sources) == 1:
        return [os.fspath(dst)]
    names = []
    for src in sources:
        name = os.fspath(src).rstrip("/").rsplit("/", 1)[-1]
        for ext in (".safetensors", ".pt", ".pth", ".bin"):
            name = name.removesuffix(ext)
        names.append(name)
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise ValueError(f"several sources would write the same destination: {sorted(duplicates)}")
    return [f"{os.fspath(dst).rstrip('/')}/{n}" if is_url(dst) else os.path.join(dst, n) for n in names]


def convert_one(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    options: Options,
    *,
    to: str | None,
    dtype: torch.dtype | None,
    keys: str | Sequence[str] | None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    trust_pickle: bool = False,
    rename: RenameRules | None = None,
    dry_run: bool = False,
    copy_files: bool = True,
    copy_files_from: str | os.PathLike[str] | None = None,
    quantization: Quantization | None = None,
    preset: Preset | None = None,
    model_config: str | os.PathLike[str] | None = None,
    rename_strict: bool = False,
) -> SaveResult | DryRunPlan:
    """Convert one source (or, with ``dry_run``, plan it); see :func:`parallel_dcp.convert`."""
    start = time.perf_counter()
    target = target_for(
        dst, to, shard_size=shard_size, storage_options=options.storage_options, compression=options.compression()
    )
    locate(src, options.storage_options)  # a bad URL fails here; its filesystem's code is loaded
    governor = MemoryGovernor(options.memory_ceiling())
    source = open_source(
        src, trust_pickle=trust_pickle, storage_options=options.storage_options, memory_limit=options.memory_ceiling()
    )
    quantization = with_dequantized_dtype(quantization, source)  # (no --dtype: the dtype its config names)
    if isinstance(source, SafetensorsSource) and options.io == "direct":
        # Only when asked: under auto the library's mmap is kept, since a direct read adds a copy
        # (bounce buffer -> a fresh tensor, its pages faulted in) that costs more than it saves
        # (measured on ext4: 2.05 s vs 1.73 s and 1.65 vs 0.91 CPU s for a cold 1 GiB conversion).
        source.use_direct_reads(resolve_io(options.io, source.location, writing=False))
    try:
        asked: ReadChoice | None = None
        if not dry_run and (options.io != "auto" or options.distributed):
            # A DCP output takes the bytes of the source's files straight, reading ahead, as asked
            # (io="direct"), or as the ranks' cold read probe says. Under io="auto" on one node the
            # choice is measured beside the conversion's writes, once it is staged (below).
            asked = stream_source(source, target, options, governor)
        steps = _Steps(rename, quantization, preset, model_config, copy_files_from, rename_strict)
        job = _convert_job(source, target, dtype, keys, steps, governor.limit)
        write_computed(job, target, options)  # FP8 dequantized straight into a DCP writer's buffers
        copies = checked_copies(  # (checked before the config.json reads below)
            source,
            directory_output=isinstance(target, ShardedTarget),
            copy_files=copy_files,
            copy_files_from=copy_files_from,
            storage_options=options.storage_options,
            limit=governor.limit,
            check=options.check_source,
        )
        if isinstance(target, ShardedTarget):
            target.copies = copies
            job = kept_by_copied_config(job, copies, renamed=bool(rename or preset), limit=governor.limit)
        if quantization is not None and quantization.active:
            prepare_target(target, quantization)
        if steps.done is not None and preset is not None and preset.writes_hf:
            _give_config(target, steps.done)
        prepare_config(target, source, job, dtype, quantization)  # config.json says what the shards hold
        if isinstance(target, ShardedTarget):
            check_no_clash(copies, target.extra_files, overwriting=target.path if options.overwrite else None)
        # (before a dry run too: the tasks that hash a file hold the pass's buffer, which it counts)
        job = dataclasses.replace(job, checks=source_checks(job.source, source) if options.check_source else None)
        warn_unchecked_direct(job.checks, job.keys, job.chunks)  # (auto keeps a checked source off the ring)
        if dry_run:
            plan = plan_dry_run(job, target, options, governor)
            if copies:
                names = ", ".join(printable(name) for name in copies)
                note = f"copies {plural(len(copies), 'file')} beside the weights: {names}"
                plan = dataclasses.replace(plan, notes=[*plan.notes, note])
            if quantization is not None and quantization.active:
                plan.notes.append(quantization.describe())
            if steps.done is not None:
                plan.notes.append(steps.done.note)
            return plan
        measured: list[ReadChoice | None] = []

        def choose_reads(staging: WriteLocation, workers: int) -> None:
            # after every check of the job and its destination: the probe writes there
            if not isinstance(staging.root, Remote):
                measured.append(
                    measured_stream_source(job, target, options, governor, staging.root, workers, staging.save_id)
                )

        result = run_job(job, target, options, governor, start=start, before_tasks=choose_reads)
        return dataclasses.replace(result, read_choice=measured[0] if measured else asked)  # (None: not a read choice)
    finally:
        source.close()


@dataclass
class _Steps:
    """What a conversion does on the way, besides selecting keys and casting."""

    rename: RenameRules | None = None
    quantization: Quantization | None = None
    preset: Preset | None = None
    model_config: str | os.PathLike[str] | None = None
    copy_files_from: str | os.PathLike[str] | None = None
    rename_strict: bool = False
    done: PresetStep | None = None  # what the preset did, once it has


def _give_config(target: Target, step: PresetStep) -> None:
    """A Hugging Face directory made by a preset holds the model's config.json (unless copied)."""
    if isinstance(target, ShardedTarget) and target.kind == "safetensors" and "config.json" not in target.copies:
        target.extra_files.setdefault("config.json", (json.dumps(step.config, indent=2) + "\n").encode())


def _convert_job(
    source: Source,
    target: Target,
    dtype: torch.dtype | None,
    keys: str | Sequence[str] | None,
    steps: _Steps,
    limit: int,
) -> Job:
    """The job converting ``source``: dequantized, keys selected, a preset's transforms and
    names, quantized, then renamed by the user's rules (checked before any write)."""
    rename, quantization = steps.rename, steps.quantization
    src = source.path
    if same_place(source.location, target.path):
        raise ValueError(f"{src} is both the source and the destination")
    refuse_non_mapping(source)  # (a torch.save of a list, a tensor: no state dict to write)
    if quantization is not None and quantization.dequantize:
        source = dequantize_step(source, quantization)
    selected = select_keys(source, keys)
    # Before any write: the files the selection needs are all there and long enough, and its
    # non-tensor values unpickle safely (an unsafe one is refused here, by name). The values are
    # read together, before anything looks at one: read one at a time, each read walked all of
    # .metadata (a DCP source of 3,000 values: 9.5 s).
    source.check(k for k in selected if k in source.entries or k in source.values)
    source.load_values(k for k in selected if k not in source.entries)
    if not target.holds_empty:  # a torch.save source's empty mappings: dropped, as DCP drops them
        selected = tuple(k for k in selected if not empty_mapping(source.values.get(k)))
    # A selection that parts an FP8 weight (or MXFP4 blocks) from its scale keeps codes no reader can
    # decode. (Dequantized, no pair is left to part; quantize refuses a quantized source.)
    if keys is not None and (quantization is None or not quantization.active):
        check_pairs_selected(source, selected)
    if dtype is not None and (quantization is None or not (quantization.dequantize or quantization.quantize)):
        refuse_cast_of_pairs(source, selected, dtype)
    if steps.preset is not None:
        steps.done = apply_preset(
            source,
            selected,
            steps.preset,
            narrowed=keys is not None,
            model_config=steps.model_config,
            copy_files_from=steps.copy_files_from,
        )
        source, selected = steps.done.source, steps.done.keys
    # What transformers keeps in float32, left by the cast (a Hugging Face output named as its source);
    # the child that reads it stays under the limit, or the job is refused here, before any write
    hf_named = target.kind != "dcp" and not (rename or steps.preset)
    # (quantizing by the source's own config too: one child reads the float32 lists and tells the FP8 layers)
    quantizing = quantization is not None and quantization.quantize is not None
    keep = (
        keys_kept(source, selected, dtype, limit, quantizing=quantizing and steps.copy_files_from is None)
        if hf_named
        else frozenset()
    )
    if quantization is not None and quantization.quantize is not None:
        source, selected = quantize_step(
            source, selected, quantization, dtype, keep, steps.copy_files_from, limit, renamed=steps.preset is not None
        )
        dtype = None  # the quantizing view casts the other tensors itself
    if rename is not None:
        source, selected = rename_source(source, selected, rename, strict=steps.rename_strict)
        check_pairs_named(source, selected)  # the pairs kept (a source's, or quantize's) still pair by name
    check_keys_fit(target, source, selected)  # (an optimizer's int keys: one torch.save file only)
    job = Job(source, selected, dtype, keep_dtype=keep if dtype is not None else frozenset())
    target.check_holds(job)
    warn_metadata_left_out(target, job.source)
    return job
