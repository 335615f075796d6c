"""The tensors a Hugging Face model keeps in float32 when loaded as bfloat16 or float16, so that
``--dtype`` leaves them as transformers' own cast does.

    transformers' model class (config.json "architectures")
      _keep_in_fp32_modules_strict  ──▶  kept in float32 for bfloat16 and float16 (DeepSeek-V3's
                                          router "gate.weight" and "e_score_correction_bias")
      _keep_in_fp32_modules         ──▶  kept in float32 for float16 (T5's "wo")

``from_pretrained(src, dtype=torch.bfloat16)`` loads those in float32 with the source's values. A
file that holds them cast loads them upcast again: rounded, with no warning, and a router's
rounded bias can pick other experts. So a conversion with ``--dtype`` to a Hugging Face output
keeps them in their dtype (float32 stays float32; a bfloat16 source's stay bfloat16, as
transformers upcasts those too).

The lists are the model's as transformers loads it: its ``post_init`` unions every sub-model's
lists into the instance's (Blip2 or Musicgen with a T5 language model: the class keeps none of
T5's ``wo``, the instance does), so the model is built from the source's config on the meta
device (no weights: measured 271-277 MiB for the whole child, tiny to DeepSeek-V3 size, all but
a few MiB of it the import) and its instance read. A class that is not one of transformers'
models is read by its class attributes. They are read in a short-lived child process, before the
job starts: importing transformers and a model class costs ~150 MiB and several seconds, which
this process would otherwise carry for the whole job. The child is in the job's process tree, so
it is held to ``--memory-limit``: its memory is read as it runs, and past the limit it is stopped
and the job refused, before anything is written. Where the caller has imported transformers
already, the same code runs in place, after the job's memory baseline: what building the model
on the meta device leaves is counted like the job's own. Without transformers there is nothing
to read, and every floating tensor is cast; docs/conversion.md says so. Names match as
transformers matches them (core_model_loading's ``build_glob_alternation``): each entry a pattern,
``*`` any run of characters, searched anywhere in the name transformers loads the key as
(:mod:`parallel_dcp.jobs.loaded_names`: its renames on load; T5's ``wo`` matches InstructBlip's
``word_embeddings`` too, as in transformers). A key whose loaded name cannot be known is kept.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from parallel_dcp._json import loads_json
from parallel_dcp.errors import describe_keys, dtype_name
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.quantized_pairs import config_beside_file, source_config
from parallel_dcp.jobs.built_model import (
    FLOAT32_LISTS,
    FP8_LAYERS,
    LISTS_CHILD_MEMORY,
    LOADED_NAMES,
    NAMES,
    Unread,
    read_model,
    refuse_unrelated_config,
)
from parallel_dcp.jobs.copy_files import Copies, read_copies
from parallel_dcp.jobs.loaded_names import LoadedNames
from parallel_dcp.jobs.targets import Job
from parallel_dcp.jobs.watched_child import run_within

__all__ = ["CHILD_MEMORY", "kept_by_copied_config", "kept_in_float32", "keys_kept", "run_within"]


# What to advise as the least limit for the reading child (built_model's figure for this question).
CHILD_MEMORY = LISTS_CHILD_MEMORY


def kept_in_float32(
    config: dict[str, Any] | None,
    dtype: torch.dtype | None,
    limit: int | None = None,
    questions: frozenset[str] = frozenset(),
    keys: Sequence[str] = (),
) -> Callable[[str], bool] | None:
    """Which of the checkpoint's ``keys`` transformers keeps in float32 for a model of ``config``
    loaded as ``dtype``, judged by the names it loads them as (:mod:`parallel_dcp.jobs.loaded_names`;
    a key it loads no parameter from, by its own name); None when it keeps none (or transformers, or
    the class, is not there to say). A key whose loaded name cannot be known is kept, with a warning
    naming it: transformers' own cast then rounds it where it should. The child that reads it is
    stopped, and MemoryLimitExceeded raised, where it passes ``limit`` bytes; it answers
    ``questions`` too (:mod:`parallel_dcp.jobs.built_model`: what else the job will ask)."""
    if config is None or dtype not in (torch.bfloat16, torch.float16):
        return None
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        return None
    class_name = architectures[0]
    (strict, loose), loaded = _lists_of(class_name, config, limit, questions, keys)
    modules = set(strict) | (set(loose) if dtype == torch.float16 else set())
    if not modules:
        return None
    pattern = re.compile("|".join(f"(?:{m.replace('*', '.*')})" for m in sorted(modules)))
    if loaded is None:
        return lambda key: pattern.search(key) is not None
    if loaded.unknown:
        unknown = sorted(loaded.unknown)
        warnings.warn(
            f"could not tell the names transformers loads {len(unknown)} tensors of {class_name} as "
            f"({loaded.why}; {describe_keys(unknown)}): kept in their dtype, not cast to {dtype_name(dtype)}, as "
            "transformers matches its float32 lists against the names it renames them to; its own cast "
            "rounds them on load where it should",
            stacklevel=4,
        )

    def kept(key: str) -> bool:
        if key in loaded.unknown:
            return True
        name = loaded.name(key)  # (None: transformers loads no parameter from it: its own name decides)
        return pattern.search(key if name is None else name) is not None

    return kept


def _lists_of(
    class_name: str, config: dict[str, Any], limit: int | None, questions: frozenset[str], keys: Sequence[str]
) -> tuple[tuple[tuple[str, ...], tuple[str, ...]], LoadedNames | None]:
    """The model's ``_keep_in_fp32_modules_strict`` and ``_keep_in_fp32_modules`` (empty where
    transformers is not installed or has no such class), and the names it loads ``keys`` as (None:
    not read). ``questions``: what else the same build answers for this job
    (:mod:`parallel_dcp.jobs.built_model`)."""
    said = read_model(class_name, config, questions | {FLOAT32_LISTS, LOADED_NAMES}, limit, keys)
    if isinstance(said, Unread):  # (said: a DeepSeek-V3 router cast to bfloat16 loads rounded, s16 review F11)
        return _unread(class_name, said), None
    if said is None:
        return ((), ()), None  # no such class in transformers
    if isinstance(said["why"], str):
        warnings.warn(
            f"could not build {class_name} on the meta device to read which tensors transformers keeps "
            f"in float32 ({said['why']}): its class's lists are kept, not those its sub-models add",
            stacklevel=5,
        )
    strict, loose = (tuple(n for n in part if isinstance(n, str) and n) for part in said[FLOAT32_LISTS][:2])
    return (strict, loose), LoadedNames.of(said.get(LOADED_NAMES))


def _unread(class_name: str, why: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    warnings.warn(
        f"could not read which tensors transformers keeps in float32 for {class_name} ({why}), so every "
        "floating tensor is cast (transformers' own cast keeps some, e.g. DeepSeek-V3's router, T5's wo)",
        stacklevel=6,
    )
    return (), ()


def keys_kept(
    source: Source,
    keys: Sequence[str],
    dtype: torch.dtype | None,
    limit: int | None = None,
    *,
    quantizing: bool = False,
) -> frozenset[str]:
    """The floating tensors among ``keys`` that ``dtype`` leaves, for a Hugging Face output of
    ``source`` (its ``config.json`` names the model class). ``quantizing``: the job quantizes by
    the same config too (``--quantize``), so the child that reads the lists tells the FP8 layers
    as well, and the job starts one child, not two.

    Raises:
        ConfigMismatchError: the config.json is beside ``source``, one weights file, and its model
            has none of the file's tensor names, yet would keep some of them in float32.
        MemoryLimitExceeded: the child passed ``limit``.
    """
    if dtype is None:
        return frozenset()
    try:
        config = source_config(source)
    except ValueError:  # not JSON, or refused by the rule for reading: said where the config is written
        return frozenset()
    beside = config_beside_file(source) if config is not None else None
    questions = frozenset(([FP8_LAYERS] if quantizing else []) + ([NAMES] if beside is not None else []))
    kept = kept_in_float32(config, dtype, limit, questions, sorted(source.entries))
    if kept is None:
        return frozenset()
    entries = source.entries
    keep = frozenset(k for k in keys if k in entries and entries[k].dtype.is_floating_point and kept(k))
    if keep and beside is not None and config is not None:  # (a file's own config.json, or refused)
        refuse_unrelated_config(
            source, beside, config, questions, limit, f"which tensors --dtype {dtype_name(dtype)} keeps in float32"
        )
    return keep


def kept_by_copied_config(job: Job, copies: Copies, renamed: bool, limit: int | None = None) -> Job:
    """``job`` with what transformers keeps in float32 left uncast, where the model's config.json
    comes from ``copies`` (``--copy-files-from``: a DCP checkpoint exported to Hugging Face) rather
    than from beside the source; as it is otherwise (no cast, names changed, or kept already)."""
    if job.dtype is None or job.keep_dtype or renamed or "config.json" not in copies:
        return job
    try:
        config = loads_json(read_copies(copies, ["config.json"])["config.json"])
    except ValueError:
        return job  # refused where the config is written, with its own message
    entries = job.source.entries
    kept = kept_in_float32(config if isinstance(config, dict) else None, job.dtype, limit, keys=sorted(entries))
    if kept is None:
        return job
    keep = frozenset(k for k in job.source_keys() if k in entries and entries[k].dtype.is_floating_point and kept(k))
    return dataclasses.replace(job, keep_dtype=keep) if keep else job
