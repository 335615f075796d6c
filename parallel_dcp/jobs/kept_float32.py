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
``*`` any run of characters, searched anywhere in the key (T5's ``wo`` matches InstructBlip's
``word_embeddings`` too, as in transformers).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from parallel_dcp._json import loads_json
from parallel_dcp.engine.breach import anonymous_bytes
from parallel_dcp.engine.sizes import format_bytes
from parallel_dcp.errors import MemoryLimitExceeded
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.quantized_pairs import source_config
from parallel_dcp.jobs.copy_files import Copies, read_copies
from parallel_dcp.jobs.targets import Job

__all__ = ["CHILD_MEMORY", "kept_by_copied_config", "kept_in_float32", "keys_kept", "run_within"]

# What to advise as the least limit for the reading child: its peak as the ceiling counts it,
# 271-277 MiB measured with transformers 5.25 (see the module's docstring), and some room.
CHILD_MEMORY = 320 * 2**20


def kept_in_float32(
    config: dict[str, Any] | None, dtype: torch.dtype | None, limit: int | None = None
) -> Callable[[str], bool] | None:
    """Which keys transformers keeps in float32 for a model of ``config`` loaded as ``dtype``;
    None when it keeps none (or transformers, or the class, is not there to say). The child that
    reads it is stopped, and MemoryLimitExceeded raised, where it passes ``limit`` bytes."""
    if config is None or dtype not in (torch.bfloat16, torch.float16):
        return None
    modules = _class_lists(config, dtype, limit)
    if not modules:
        return None
    pattern = re.compile("|".join(f"(?:{m.replace('*', '.*')})" for m in sorted(modules)))
    return lambda key: pattern.search(key) is not None


def _class_lists(config: dict[str, Any], dtype: torch.dtype, limit: int | None) -> set[str]:
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        return set()
    strict, loose = _lists_of(architectures[0], config, limit)
    return set(strict) | (set(loose) if dtype == torch.float16 else set())


# What each model, by class name and config, keeps, as a child process read it (asked once each).
_LISTS: dict[tuple[str, str], tuple[tuple[str, ...], tuple[str, ...]]] = {}

# The model's two lists, and why only its class's were read (or None); None where transformers has
# no such class. A model of transformers is built on the meta device, as from_pretrained builds it:
# its post_init unions every child model's lists into the instance's (Blip2's T5 language model
# adds "wo"), which the class attributes do not show. Run by the child, or in place (exec).
_LISTS_OF = """
def lists_of(transformers, torch, class_name, config):
    import contextlib
    model_class = getattr(transformers, class_name, None)
    if model_class is None:
        return None
    def names(owner, attribute):
        value = getattr(owner, attribute, None) or ()
        return sorted(n for n in value if isinstance(n, str) and n)
    owner, why = model_class, None
    pretrained = getattr(transformers, "PreTrainedModel", None)
    if isinstance(model_class, type) and isinstance(pretrained, type) and issubclass(model_class, pretrained):
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.device("meta"))
                init = getattr(transformers, "initialization", None)
                safe = getattr(init, "meta_device_safe_creation_ops", None)
                if safe is not None:  # (transformers 5: a model calling .item() in __init__)
                    stack.enter_context(safe())
                owner = model_class(model_class.config_class.from_dict(config))
        except Exception as error:
            why = f"{type(error).__name__}: {error}"[:300]
    try:
        return [names(owner, "_keep_in_fp32_modules_strict"), names(owner, "_keep_in_fp32_modules"), why]
    except Exception:  # a broken class: nothing to read
        return [[], [], why]
"""

# The child's whole work: that answer as JSON, for the config on its stdin.
_READ_LISTS = (
    _LISTS_OF
    + """
import json, sys
import torch
import transformers
print(json.dumps(lists_of(transformers, torch, sys.argv[1], json.loads(sys.stdin.read()))))
"""
)

# Long enough for a cold import of transformers and torch on a loaded node.
_READ_TIMEOUT = 300.0
# How often the child's memory is read against the limit (a read of /proc/<pid>/status: ~30 us).
_WATCH_EVERY = 0.02


def _lists_of(class_name: str, config: dict[str, Any], limit: int | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The model's ``_keep_in_fp32_modules_strict`` and ``_keep_in_fp32_modules``; empty where
    transformers is not installed or has no such class."""
    loaded = sys.modules.get("transformers")
    if loaded is not None:  # imported by the caller already: read in place (counted by the governor)
        namespace: dict[str, Any] = {}
        exec(_LISTS_OF, namespace)  # (the child's own code)
        return _answer(class_name, namespace["lists_of"](loaded, torch, class_name, config))
    text = json.dumps(config, sort_keys=True)
    if (class_name, text) not in _LISTS:
        _LISTS[class_name, text] = _lists_read_apart(class_name, text, limit)
    return _LISTS[class_name, text]


def _lists_read_apart(class_name: str, config: str, limit: int | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The lists read by a child process that imports transformers (see the module's docstring),
    stopped where it would pass ``limit``."""
    try:
        installed = importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:  # (said: a DeepSeek-V3 router cast to bfloat16 loads rounded, s16 review F11)
        return _unread(class_name, "transformers is not installed: pip install transformers")
    # the child imports from this process's sys.path (a path added at run time included), first
    path = os.pathsep.join(os.path.abspath(entry) for entry in sys.path if entry)
    env = {**os.environ, "PYTHONPATH": path}
    try:
        # -P (Python 3.11+): the working directory's files are not imported in place of transformers
        argv = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-c", _READ_LISTS, class_name]
        done = run_within(argv, config.encode(), env, limit, lambda peak, most: _over_limit(class_name, peak, most))
    except (OSError, subprocess.TimeoutExpired) as error:
        return _unread(class_name, f"importing it failed: {error}")
    # (whatever the library prints on import, in any encoding: the answer is the last line)
    said = done.stdout.decode("utf-8", "replace").strip().splitlines()
    if done.returncode != 0 or not said:
        errors = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return _unread(class_name, f"importing it failed: {errors[-1] if errors else f'exit status {done.returncode}'}")
    try:
        lists = json.loads(said[-1])
    except ValueError:
        return _unread(class_name, f"importing it failed: it printed {said[-1][:200]!r}")
    return _answer(class_name, lists)


def _answer(class_name: str, lists: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The two lists of ``lists_of``'s answer, warning where only the class's were read."""
    if not isinstance(lists, list) or len(lists) != 3 or not all(isinstance(part, list) for part in lists[:2]):
        return (), ()  # no such class in transformers
    if isinstance(lists[2], str):
        warnings.warn(
            f"could not build {class_name} on the meta device to read which tensors transformers keeps "
            f"in float32 ({lists[2]}): its class's lists are kept, not those its sub-models add",
            stacklevel=6,
        )
    strict, loose = (tuple(n for n in part if isinstance(n, str) and n) for part in lists[:2])
    return strict, loose


def run_within(
    argv: list[str],
    given: bytes,
    env: dict[str, str],
    limit: int | None,
    over_limit: Callable[[int, int], MemoryLimitExceeded],
) -> subprocess.CompletedProcess[bytes]:
    """``argv`` run with ``given`` on its stdin, its memory (RssAnon + RssShmem: an exec'd process
    shares none of it) read every 20 ms; killed, and the job refused before anything is written
    (``over_limit(measured, limit)`` says why), once it passes ``limit``
    (docs/guarantees.md#the-memory-ceiling). Every child that imports transformers for a job runs so."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=err, env=env)
        peak = 0
        try:
            assert child.stdin is not None
            child.stdin.write(given)
            child.stdin.close()
            deadline = time.monotonic() + _READ_TIMEOUT
            while child.poll() is None:
                peak = max(peak, anonymous_bytes(child.pid))
                if limit is not None and peak > limit:
                    raise over_limit(peak, limit)
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(argv, _READ_TIMEOUT)
                time.sleep(_WATCH_EVERY)
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, child.returncode, out.read(), err.read())


def _over_limit(class_name: str, measured: int, limit: int) -> MemoryLimitExceeded:
    return MemoryLimitExceeded(
        f"reading which tensors transformers keeps in float32 for {class_name} (a child process that "
        f"imports transformers, ~{format_bytes(CHILD_MEMORY)} measured) passed the memory limit: "
        f"{format_bytes(measured)} of {format_bytes(limit)}, before anything was written. Raise "
        f"--memory-limit (memory_limit=) to at least {format_bytes(CHILD_MEMORY)}, or convert "
        f"without --dtype and cast on load",
        limit=limit,
        measured=measured,
        keys=[],
    )


def _unread(class_name: str, why: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    warnings.warn(
        f"could not read which tensors transformers keeps in float32 for {class_name} ({why}), so every "
        "floating tensor is cast (transformers' own cast keeps some, e.g. DeepSeek-V3's router, T5's wo)",
        stacklevel=5,
    )
    return (), ()


def keys_kept(
    source: Source, keys: Sequence[str], dtype: torch.dtype | None, limit: int | None = None
) -> frozenset[str]:
    """The floating tensors among ``keys`` that ``dtype`` leaves, for a Hugging Face output of
    ``source`` (its ``config.json`` names the model class)."""
    if dtype is None:
        return frozenset()
    try:
        config = source_config(source)
    except ValueError:  # not JSON, or refused by the rule for reading: said where the config is written
        return frozenset()
    kept = kept_in_float32(config, dtype, limit)
    if kept is None:
        return frozenset()
    entries = source.entries
    return frozenset(k for k in keys if k in entries and entries[k].dtype.is_floating_point and kept(k))


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
    kept = kept_in_float32(config if isinstance(config, dict) else None, job.dtype, limit)
    if kept is None:
        return job
    entries = job.source.entries
    keep = frozenset(k for k in job.source_keys() if k in entries and entries[k].dtype.is_floating_point and kept(k))
    return dataclasses.replace(job, keep_dtype=keep) if keep else job
