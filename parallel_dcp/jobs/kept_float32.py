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

The lists are the model class's, read from transformers where it is installed (nothing is
built: class attributes only). They are read in a short-lived child process, before the job
starts: importing transformers and a model class costs ~150 MiB and several seconds, which this
process would otherwise carry for the whole job, charged against ``--memory-limit``. Where the
caller has imported transformers already, its module is read in place. Without transformers there
is nothing to read, and every floating tensor is cast; docs/conversion.md says so. Names match as
transformers matches them: each entry a pattern (``*`` any run of characters) searched anywhere in the key.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from parallel_dcp._json import loads_json
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.quantized_pairs import source_config
from parallel_dcp.jobs.copy_files import Copies, read_copies
from parallel_dcp.jobs.targets import Job

__all__ = ["kept_by_copied_config", "kept_in_float32", "keys_kept"]


def kept_in_float32(config: dict[str, Any] | None, dtype: torch.dtype | None) -> Callable[[str], bool] | None:
    """Which keys transformers keeps in float32 for a model of ``config`` loaded as ``dtype``;
    None when it keeps none (or transformers, or the class, is not there to say)."""
    if config is None or dtype not in (torch.bfloat16, torch.float16):
        return None
    modules = _class_lists(config, dtype)
    if not modules:
        return None
    pattern = re.compile("|".join(f"(?:{m.replace('*', '.*')})" for m in sorted(modules)))
    return lambda key: pattern.search(key) is not None


def _class_lists(config: dict[str, Any], dtype: torch.dtype) -> set[str]:
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        return set()
    strict, loose = _lists_of(architectures[0])
    return set(strict) | (set(loose) if dtype == torch.float16 else set())


# What each model class keeps, by class name, as a child process read it (a batch asks once a class).
_LISTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}

# The child's whole work: the class's two lists as JSON, or null where transformers has no such class.
_READ_LISTS = """
import json, sys
import transformers
model_class = getattr(transformers, sys.argv[1], None)
def names(attribute):
    value = getattr(model_class, attribute, None) or ()
    return [n for n in value if isinstance(n, str) and n]
print(json.dumps(None if model_class is None else
                 [names("_keep_in_fp32_modules_strict"), names("_keep_in_fp32_modules")]))
"""

# Long enough for a cold import of transformers and torch on a loaded node.
_READ_TIMEOUT = 300.0


def _lists_of(class_name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The class's ``_keep_in_fp32_modules_strict`` and ``_keep_in_fp32_modules``; empty where
    transformers is not installed or has no such class."""
    loaded = sys.modules.get("transformers")
    if loaded is not None:  # imported by the caller already: read in place, as it is now
        return _lists_from(getattr(loaded, class_name, None))
    if class_name not in _LISTS:
        _LISTS[class_name] = _lists_read_apart(class_name)
    return _LISTS[class_name]


def _lists_from(model_class: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    def names(attribute: str) -> tuple[str, ...]:
        try:
            value = getattr(model_class, attribute, None) or ()
            return tuple(n for n in value if isinstance(n, str) and n)
        except Exception:  # a broken class: nothing to read
            return ()

    return names("_keep_in_fp32_modules_strict"), names("_keep_in_fp32_modules")


def _lists_read_apart(class_name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The lists read by a child process that imports transformers (see the module's docstring)."""
    try:
        installed = importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        return (), ()
    # the child imports from this process's sys.path (a path added at run time included), first
    path = os.pathsep.join(os.path.abspath(entry) for entry in sys.path if entry)
    env = {**os.environ, "PYTHONPATH": path}
    try:
        done = subprocess.run(
            # -P (Python 3.11+): the working directory's files are not imported in place of transformers
            [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-c", _READ_LISTS, class_name],
            capture_output=True,
            env=env,
            timeout=_READ_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return _unread(class_name, str(error))
    # (whatever the library prints on import, in any encoding: the answer is the last line)
    said = done.stdout.decode("utf-8", "replace").strip().splitlines()
    if done.returncode != 0 or not said:
        errors = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return _unread(class_name, errors[-1] if errors else f"exit status {done.returncode}")
    try:
        lists = json.loads(said[-1])
    except ValueError:
        return _unread(class_name, f"it printed {said[-1][:200]!r}")
    if not isinstance(lists, list) or len(lists) != 2 or not all(isinstance(part, list) for part in lists):
        return (), ()  # no such class in transformers
    strict, loose = (tuple(n for n in part if isinstance(n, str) and n) for part in lists)
    return strict, loose


def _unread(class_name: str, why: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    warnings.warn(
        f"could not read which tensors transformers keeps in float32 for {class_name} (importing it "
        f"failed: {why}), so every floating tensor is cast",
        stacklevel=5,
    )
    return (), ()


def keys_kept(source: Source, keys: Sequence[str], dtype: torch.dtype | None) -> frozenset[str]:
    """The floating tensors among ``keys`` that ``dtype`` leaves, for a Hugging Face output of
    ``source`` (its ``config.json`` names the model class)."""
    if dtype is None:
        return frozenset()
    try:
        config = source_config(source)
    except ValueError:  # not JSON, or refused by the rule for reading: said where the config is written
        return frozenset()
    kept = kept_in_float32(config, dtype)
    if kept is None:
        return frozenset()
    entries = source.entries
    return frozenset(k for k in keys if k in entries and entries[k].dtype.is_floating_point and kept(k))


def kept_by_copied_config(job: Job, copies: Copies, renamed: bool) -> Job:
    """``job`` with what transformers keeps in float32 left uncast, where the model's config.json
    comes from ``copies`` (``--copy-files-from``: a DCP checkpoint exported to Hugging Face) rather
    than from beside the source; as it is otherwise (no cast, names changed, or kept already)."""
    if job.dtype is None or job.keep_dtype or renamed or "config.json" not in copies:
        return job
    try:
        config = loads_json(read_copies(copies, ["config.json"])["config.json"])
    except ValueError:
        return job  # refused where the config is written, with its own message
    kept = kept_in_float32(config if isinstance(config, dict) else None, job.dtype)
    if kept is None:
        return job
    entries = job.source.entries
    keep = frozenset(k for k in job.source_keys() if k in entries and entries[k].dtype.is_floating_point and kept(k))
    return dataclasses.replace(job, keep_dtype=keep) if keep else job
