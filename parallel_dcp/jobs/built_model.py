"""What a job asks of the model transformers builds from a ``config.json``: one build answers all.

    config.json ("architectures", the model's sizes)
      └─▶ the class built once on the meta device (no weights), in one short-lived child process
            FLOAT32_LISTS  ──▶ the instance's _keep_in_fp32_modules[_strict]   (kept_float32: --dtype)
            FP8_LAYERS     ──▶ the 2-D weights FP8 layers replace, or not      (fp8_layers: --quantize)
            NAMES          ──▶ its parameter and buffer names   (is a config.json beside one named
                                                                 weights file that file's model?)
            LOADED_NAMES   ──▶ each checkpoint key's name as transformers loads it (its renames on
                                load: loaded_names; both questions above decide on those names)

Importing transformers costs seconds and ~270 MiB, which the job's own process would carry to its
end, so a child does it and exits before the job starts. A conversion with both ``--dtype`` and
``--quantize`` asks both questions of one child (one import, one build), where it started two; a
conversion with one option asks only its own. Answers are kept for the process, by class and config
(and, read in place, by the transformers module that gave them), so a later question about the same
model starts no child.

The child is in the job's process tree, so it is held to ``--memory-limit`` by
:mod:`parallel_dcp.jobs.watched_child`: its memory is read as it runs, and past the limit it is
stopped and the job refused, before anything is written. Where the caller has imported transformers already, the same
code runs in place, after the job's memory baseline (what the build leaves is counted like the
job's own).

The model is built as ``from_pretrained`` builds it (``torch.device("meta")`` and transformers'
``meta_device_safe_creation_ops``). When FP8 layers are asked, the config's
``quantization_config`` is left out of the build (no model class of transformers 5.25 reads it when
built; a release's own one only says how its stored weights are quantized).

Longer than 300 lines because the child's code, the in-place run, the answers kept per process and
the refusal of another model's config.json share one build and its cache; the renames on load are
:mod:`parallel_dcp.jobs.loaded_names`'s.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from parallel_dcp.engine.sizes import format_bytes
from parallel_dcp.errors import ConfigMismatchError, MemoryLimitExceeded, printable
from parallel_dcp.formats.base import Source
from parallel_dcp.jobs.loaded_names import CHILD_CODE, LOADED_NAMES
from parallel_dcp.jobs.watched_child import run_within

__all__ = [
    "FLOAT32_LISTS",
    "FP8_LAYERS",
    "LAYERS_CHILD_MEMORY",
    "LISTS_CHILD_MEMORY",
    "LOADED_NAMES",
    "NAMES",
    "NOT_INSTALLED",
    "Unread",
    "read_model",
    "refuse_unrelated_config",
    "shares_a_name",
    "spellings",
]

FLOAT32_LISTS, FP8_LAYERS, NAMES = "float32_lists", "fp8_layers", "names"
_OF_KEYS = "loaded_names_of"  # (the digest of the keys a LOADED_NAMES answer maps)

# What to advise as the least limit for the child, by the most it is asked (its peak as the ceiling
# counts it, with transformers 5.25, and some room): the float32 lists alone, 271-277 MiB measured
# (tiny to DeepSeek-V3-sized configs); FP8 layers too, 374-376 MiB (a Llama-8B and a DeepSeek-V3
# config), both lists and layers from one build included. The loaded names (asked with either) add
# ~21 MiB for a DeepSeek-V3 release's 47,400 keys (274 -> 295-297 MiB, lists and names).
LISTS_CHILD_MEMORY = 352 * 2**20
LAYERS_CHILD_MEMORY = 448 * 2**20


class Unread(str):
    """Why nothing could be read (transformers not installed, its import failed, the child's
    answer unreadable): each caller says what that costs in its own words."""


NOT_INSTALLED = Unread("transformers is not installed: pip install transformers")


# The child's whole work (also run in place, by exec): the model built once, each question answered.
_ANSWER = (
    r"""
def answer(transformers, torch, class_name, config, questions, keys):
    import contextlib
    from torch import nn
    model_class = getattr(transformers, class_name, None)
    if model_class is None:
        return None
    pretrained = getattr(transformers, "PreTrainedModel", None)
    is_model = isinstance(model_class, type) and isinstance(pretrained, type) and issubclass(model_class, pretrained)
    buildable = hasattr(model_class, "config_class")
    built, why = None, None
    # (the float32 lists of a class that is not one of transformers' models: its class attributes)
    shaped = any(q in questions for q in ("fp8_layers", "names", "loaded_names"))  # (need the instance)
    if shaped and buildable or "float32_lists" in questions and is_model:
        if "fp8_layers" in questions:
            config = {k: v for k, v in config.items() if k != "quantization_config"}
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.device("meta"))
                init = getattr(transformers, "initialization", None)
                safe = getattr(init, "meta_device_safe_creation_ops", None)
                if safe is not None:  # (transformers 5: a model calling .item() in __init__)
                    stack.enter_context(safe())
                built = model_class(model_class.config_class.from_dict(config))
        except Exception as error:
            why = f"{type(error).__name__}: {error}"[:300]
    said = {"why": why, "prefix": str(getattr(model_class, "base_model_prefix", "") or "")}
    def names(owner, attribute):
        value = getattr(owner, attribute, None) or ()
        return sorted(n for n in value if isinstance(n, str) and n)
    if "float32_lists" in questions:
        owner = built if built is not None else model_class
        try:
            strict, loose = names(owner, "_keep_in_fp32_modules_strict"), names(owner, "_keep_in_fp32_modules")
            said["float32_lists"] = [strict, loose]
        except Exception:  # a broken class: nothing to read
            said["float32_lists"] = [[], []]
    if "fp8_layers" in questions and buildable and built is not None:
        replaced, plain = [], []
        for name, module in built.named_modules():
            for part, value in module.named_parameters(recurse=False):
                if value.dim() != 2:
                    continue
                full = f"{name}.{part}" if name else part
                experts = name.endswith(".experts")  # swapped whole for FP8Experts
                linear = type(module) is nn.Linear or (
                    isinstance(module, nn.Linear) and "GroupedLinear" in type(module).__name__)
                (replaced if experts or (linear and part == "weight") else plain).append(full)
        said["fp8_layers"] = {"replaced": replaced, "plain": plain, "kept": names(built, "_keep_in_fp32_modules")}
    elif "fp8_layers" in questions:
        said["fp8_layers"] = why if buildable else None
    if "names" in questions and built is not None:
        said["names"] = sorted({n for n, _ in built.named_parameters(remove_duplicate=False)}
                               | {n for n, _ in built.named_buffers(remove_duplicate=False)})
    if "loaded_names" in questions:
        said["loaded_names"] = loaded_names(transformers, built, model_class, config, keys) if buildable else None
    return said
"""
    + CHILD_CODE
)

_CHILD = (
    _ANSWER
    + """
import json, sys
import torch
import transformers
asked = json.loads(sys.stdin.read())
print(json.dumps(answer(transformers, torch, sys.argv[1], asked["config"], asked["questions"], asked["keys"])))
"""
)

# Every answer this process has had, by (class, config as JSON, the transformers module read in place
# or None for a child's): a question asked again, or another option's of the same model, starts nothing.
_ANSWERS: dict[tuple[str, str, object], dict[str, Any] | Unread | None] = {}


def read_model(
    class_name: str,
    config: dict[str, Any],
    questions: Iterable[str],
    limit: int | None,
    keys: Sequence[str] = (),
) -> dict[str, Any] | Unread | None:
    """The answers to ``questions`` (of FLOAT32_LISTS, FP8_LAYERS, NAMES, LOADED_NAMES) about
    transformers' model ``class_name`` built from ``config``, by their names, with ``"why"`` (the
    build failed: what it raised; else None) and ``"prefix"`` (``base_model_prefix``). None:
    transformers has no such class. Unread: why nothing could be read. A question whose answer the
    build could not give is absent (NAMES), or None (FP8_LAYERS or LOADED_NAMES of a class that is no
    model) or the build's error (FP8_LAYERS). LOADED_NAMES maps the checkpoint's ``keys``
    (:mod:`parallel_dcp.jobs.loaded_names`); its answer is kept for those keys only.

    Raises:
        MemoryLimitExceeded: the child passed ``limit`` (stopped there, before anything is written).
    """
    loaded = sys.modules.get("transformers")
    key = (class_name, json.dumps(config, sort_keys=True), loaded)
    known = _ANSWERS.get(key)
    wanted = set(questions)
    if key in _ANSWERS and not isinstance(known, dict):
        return known
    of_keys = hashlib.sha256("\0".join(keys).encode()).hexdigest() if LOADED_NAMES in wanted else None
    unanswered = wanted - set(known or ())
    if of_keys is not None and (known.get(_OF_KEYS) if isinstance(known, dict) else None) != of_keys:
        unanswered.add(LOADED_NAMES)  # (answered for other keys)
    missing = sorted(unanswered)
    if not missing:
        return known
    said: dict[str, Any] | Unread | None
    if loaded is not None:  # imported by the caller already: answered in place (counted by the governor)
        space: dict[str, Any] = {}
        exec(_ANSWER, space)  # (the child's own code)
        import torch

        said = space["answer"](loaded, torch, class_name, config, missing, list(keys))
    else:
        said = _read_apart(class_name, config, missing, limit, list(keys) if of_keys else [])
    if isinstance(said, dict) and of_keys:
        said[_OF_KEYS] = of_keys  # (the same model asked of other keys is asked again)
    if isinstance(said, dict) and isinstance(known, dict):
        said = {**known, **said, "why": said.get("why") or known.get("why")}
    if said is not NOT_INSTALLED:  # (looked for again: cheap, and it may be installed later)
        _ANSWERS[key] = said
    return said


def _read_apart(
    class_name: str, config: dict[str, Any], questions: list[str], limit: int | None, keys: list[str]
) -> dict[str, Any] | Unread | None:
    """The answers from a child process that imports transformers, stopped where it would pass ``limit``."""
    try:
        installed = importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        return NOT_INSTALLED
    # the child imports from this process's sys.path (a path added at run time included), first
    path = os.pathsep.join(os.path.abspath(entry) for entry in sys.path if entry)
    env = {**os.environ, "PYTHONPATH": path}
    given = json.dumps({"config": config, "questions": questions, "keys": keys}).encode()
    try:
        # -P (Python 3.11+): the working directory's files are not imported in place of transformers
        argv = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-c", _CHILD, class_name]
        done = run_within(argv, given, env, limit, lambda peak, most: _over_limit(class_name, questions, peak, most))
    except (OSError, subprocess.TimeoutExpired) as error:
        return Unread(f"importing it failed: {error}")
    # (whatever the library prints on import, in any encoding: the answer is the last line)
    said = done.stdout.decode("utf-8", "replace").strip().splitlines()
    if done.returncode != 0 or not said:
        errors = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return Unread(f"importing it failed: {errors[-1] if errors else f'exit status {done.returncode}'}")
    try:
        answer = json.loads(said[-1])
    except ValueError:
        answer = Unread(f"importing it failed: it printed {said[-1][:200]!r}")
    if answer is not None and not (isinstance(answer, dict) and set(questions) - {NAMES} <= set(answer)):
        return Unread(f"importing it failed: it printed {said[-1][:200]!r}")
    return answer


def _over_limit(class_name: str, questions: list[str], measured: int, limit: int) -> MemoryLimitExceeded:
    layers = FP8_LAYERS in questions
    asked = [
        *([f"which tensors transformers keeps in float32 for {class_name}"] if FLOAT32_LISTS in questions else []),
        *([f"which weights transformers' FP8 layers replace in {class_name}"] if layers else []),
    ] or [f"the parameter names of {class_name}"]
    least = LAYERS_CHILD_MEMORY if layers else LISTS_CHILD_MEMORY
    instead = "" if layers else ", or convert without --dtype and cast on load"
    return MemoryLimitExceeded(
        f"reading {' and '.join(asked)} (a child process that imports transformers and builds the model on "
        f"the meta device, ~{format_bytes(least)} measured) passed the memory limit: {format_bytes(measured)} of "
        f"{format_bytes(limit)}, before anything was written. Raise --memory-limit (memory_limit=) to at least "
        f"{format_bytes(least)}{instead}",
        limit=limit,
        measured=measured,
        keys=[],
    )


def spellings(key: str, prefix: str) -> tuple[str, ...]:
    """``key`` as the model may name it: with its ``prefix`` (base_model_prefix) taken off or put on."""
    if not prefix:
        return (key,)
    stripped = key.removeprefix(prefix + ".")
    return (key, stripped) if stripped != key else (key, f"{prefix}.{key}")


def shares_a_name(keys: Iterable[str], names: Iterable[str], prefix: str) -> bool:
    """Whether a checkpoint's ``keys`` name any of a model's parameters or buffers (``names``),
    with its ``prefix`` (base_model_prefix) or ``model.`` taken off or put on, as checkpoints spell them."""
    model = frozenset(names)
    prefixes = {prefix, "model"} - {""}
    return any(name in model for key in keys for p in prefixes for name in spellings(key, p))


def refuse_unrelated_config(
    source: Source,
    config_path: str,
    config: dict[str, Any],
    questions: Iterable[str],
    limit: int | None,
    deciding: str,
) -> None:
    """Refuse the ``config.json`` at ``config_path``, beside ``source`` (one weights file named as the
    source), where the model it describes has none of the file's tensor names (with the
    ``base_model_prefix`` or ``model.`` taken off or put on): it is another model's, and would decide
    ``deciding``. transformers pairs a folder's config.json with that folder's own weights, never
    with another file in it; judged by another model's lists, a BERT's ``word_embeddings`` would stay
    float32 by T5's ``wo``. A config whose model cannot be built says nothing either way, and is left.

    Raises:
        ConfigMismatchError: naming the file, the config, its model, and what to do.
    """
    class_name = config["architectures"][0]
    said = read_model(class_name, config, {*questions, NAMES}, limit)  # (asked with the job's others: no child)
    if not isinstance(said, dict) or not isinstance(said.get(NAMES), list):
        return
    keys = sorted(source.entries)
    if not keys or shares_a_name(keys, said[NAMES], said["prefix"]):
        return
    model_type = config.get("model_type")
    folder = os.path.dirname(config_path)
    example = f" (the file's {keys[0]!r}; the model's {said[NAMES][0]!r})" if said[NAMES] else ""
    raise ConfigMismatchError(
        f"{source.path} is named as the source, and the config.json beside it ({config_path}) describes "
        f"another model: {class_name} (model_type {printable(str(model_type))!r}) has none of the file's "
        f"{len(keys)} tensor names{example}, so it cannot say {deciding}. Name the folder ({folder}) to "
        f"convert the model that config.json describes, or move {os.path.basename(source.path)} to a folder "
        "of its own (with its own config.json, if it has one); refused before anything was written"
    )
