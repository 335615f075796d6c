"""Which weights of a Hugging Face model transformers' FP8 layers replace, for ``--quantize``'s
default rule.

    config.json ("architectures", the model's sizes)
      └─▶ the class built on the meta device (no memory, no values), in a child process
            type(module) is nn.Linear, a GroupedLinear  ──▶  ``replaced``: their X.weight
            any other module with a 2-D weight           ──▶  ``plain``  (Embedding, GPT-2's Conv1D, ...)
            model._keep_in_fp32_modules                  ──▶  ``kept``   (T5's "wo"): plain on load whatever its type

transformers 5 (``FineGrainedFP8HfQuantizer``, ``replace_with_fp8_linear``) swaps exactly those
``nn.Linear`` modules (and ``*.experts`` blocks, whose fused weights no checkpoint name matches)
for FP8 layers, unless ``modules_to_not_convert`` or ``_keep_in_fp32_modules`` names them; every
other module loads its stored tensor as it is. A weight quantized anywhere else loads as raw e4m3
codes (values up to 448) where it does not dequantize (a GPU), with only an "unexpected key" for
the scale. So the rule quantizes the ``replaced`` weights only.

The class is built where transformers is installed, in a short-lived child as
:mod:`parallel_dcp.jobs.kept_float32` reads its lists (importing transformers costs ~150 MiB and
seconds this process would carry through the job); in place where the caller imported it already.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from parallel_dcp._json import loads_json
from parallel_dcp.engine.sizes import format_bytes
from parallel_dcp.errors import MemoryLimitExceeded
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.quantized_pairs import source_config
from parallel_dcp.jobs.kept_float32 import run_within

__all__ = ["Fp8Layers", "fp8_layers", "model_config"]


@dataclass(frozen=True, slots=True)
class Fp8Layers:
    """What transformers' FP8 path does with each 2-D weight of one model class, by parameter name."""

    architecture: str
    replaced: frozenset[str]  # weights of the modules it swaps for FP8Linear
    plain: frozenset[str]  # 2-D weights of the modules it leaves as they are
    kept: tuple[str, ...]  # _keep_in_fp32_modules: never converted, whatever the module
    prefix: str  # base_model_prefix ("transformer", "model"): checkpoints may lack it

    def classify(self, key: str) -> bool | None:
        """True: transformers loads ``key`` into an FP8 layer; False: as a plain tensor; None: no
        parameter of the model has that name (one transformers renames on load)."""
        for name in _spellings(key, self.prefix):
            if name in self.replaced:
                return not _kept(name.removesuffix(".weight"), self.kept)
            if name in self.plain:
                return False
        return None


def _spellings(key: str, prefix: str) -> tuple[str, ...]:
    if not prefix:
        return (key,)
    stripped = key.removeprefix(prefix + ".")
    return (key, stripped) if stripped != key else (key, f"{prefix}.{key}")


def _kept(module: str, patterns: tuple[str, ...]) -> bool:
    # transformers' should_convert_module: a pattern matched from the start to a module boundary
    # (as a regex), or a suffix of the name
    return any(module.endswith(pattern) or _matches_from_start(pattern, module) for pattern in patterns)


def _matches_from_start(pattern: str, module: str) -> bool:
    """``pattern`` as a regex from the start of ``module`` to a module boundary; a pattern that is
    no valid regex matches nothing this way (its suffix rule still applies)."""
    try:
        return re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module) is not None
    except re.error:
        return False


# The child's work (also run in place): the model built on meta from the config, its weights sorted.
_READ_LAYERS = r"""
import json, sys

def layers(transformers, config):
    import torch
    from torch import nn
    model_class = getattr(transformers, config["architectures"][0], None)
    if model_class is None or not hasattr(model_class, "config_class"):
        return None
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    with torch.device("meta"):
        model = model_class(model_class.config_class.from_dict(config))
    replaced, plain = [], []
    for name, module in model.named_modules():
        for part, value in module.named_parameters(recurse=False):
            if value.dim() != 2:
                continue
            full = f"{name}.{part}" if name else part
            experts = name.endswith(".experts")  # swapped whole for FP8Experts
            linear = type(module) is nn.Linear or (
                isinstance(module, nn.Linear) and "GroupedLinear" in type(module).__name__)
            (replaced if experts or (linear and part == "weight") else plain).append(full)
    kept = sorted(n for n in (getattr(model, "_keep_in_fp32_modules", None) or ()) if isinstance(n, str) and n)
    return {"replaced": replaced, "plain": plain, "kept": kept,
            "prefix": str(getattr(model_class, "base_model_prefix", "") or "")}

if __name__ == "__main__":
    import transformers
    print(json.dumps(layers(transformers, json.loads(sys.stdin.read()))))
"""

# Long enough for a cold import of transformers and torch on a loaded node.


def fp8_layers(config: dict[str, Any] | None, limit: int | None = None) -> Fp8Layers | str:
    """What transformers' FP8 path replaces in the model of ``config``; or, where that cannot be
    known, why (no config, no "architectures", transformers not installed, no such class, or
    building it failed).

    Raises:
        MemoryLimitExceeded: the child that builds it passed ``limit`` (stopped there)."""
    if config is None:
        return "the source has no config.json"
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        return 'its config.json names no "architectures"'
    name = architectures[0]
    loaded = sys.modules.get("transformers")
    if loaded is not None:
        space: dict[str, Any] = {"__name__": "fp8_layers"}
        exec(_READ_LAYERS, space)  # the child's own code, run in place
        try:
            said = space["layers"](loaded, config)
        except Exception as error:  # a class that will not build from this config
            return f"building {name} from its config.json failed ({type(error).__name__}: {error})"
    else:
        said = _read_apart(name, config, limit)
        if isinstance(said, str):
            return said
    if said is None:
        return f"transformers has no model class {name}"
    return Fp8Layers(name, frozenset(said["replaced"]), frozenset(said["plain"]), tuple(said["kept"]), said["prefix"])


def model_config(source: Source, copy_files_from: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """The config.json the output will describe its model by: ``copy_files_from``'s (a local
    folder) when given, else the source's own; None when there is none or it is not a JSON object
    (refused, where it is written, with its own message)."""
    try:
        if copy_files_from is None:
            return source_config(source)
        path = os.path.join(os.fspath(copy_files_from), "config.json")
        if not os.path.isfile(path):
            return None
        with open(path, "rb") as file:
            config = loads_json(file.read(1 << 24))
        return config if isinstance(config, dict) else None
    except (OSError, ValueError):
        return None


# What to advise as the least limit for the building child: 374-376 MiB measured with transformers
# 5.25 (a Llama-8B and a DeepSeek-V3 config, built on the meta device), and some room.
CHILD_MEMORY = 416 * 2**20


def _over_limit(name: str, measured: int, limit: int) -> MemoryLimitExceeded:
    return MemoryLimitExceeded(
        f"telling which weights transformers' FP8 layers replace in {name} (a child process that imports "
        f"transformers and builds the model on the meta device, ~{format_bytes(CHILD_MEMORY)} measured) passed "
        f"the memory limit: {format_bytes(measured)} of {format_bytes(limit)}, before anything was written. "
        f"Raise --memory-limit (memory_limit=) to at least {format_bytes(CHILD_MEMORY)}",
        limit=limit,
        measured=measured,
        keys=[],
    )


def _read_apart(name: str, config: dict[str, Any], limit: int | None) -> Any:
    try:
        installed = importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        return "transformers is not installed"
    # the child imports from this process's sys.path (a path added at run time included), first
    path = os.pathsep.join(os.path.abspath(entry) for entry in sys.path if entry)
    try:  # watched against the limit as the float32 lists' child is (part of the job's tree)
        done = run_within(
            # -P (Python 3.11+): the working directory's files are not imported in place of transformers
            [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-c", _READ_LAYERS],
            json.dumps(config).encode(),
            {**os.environ, "PYTHONPATH": path},
            limit,
            lambda measured, most: _over_limit(name, measured, most),
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"building {name} failed ({error})"
    said = done.stdout.decode("utf-8", "replace").strip().splitlines()
    if done.returncode != 0 or not said:
        errors = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return f"building {name} failed ({errors[-1] if errors else f'exit status {done.returncode}'})"
    try:
        answer = json.loads(said[-1])
    except ValueError:
        return f"building {name} failed (it printed {said[-1][:200]!r})"
    if answer is not None and not (isinstance(answer, dict) and {"replaced", "plain", "kept", "prefix"} <= set(answer)):
        return f"building {name} failed (it printed {said[-1][:200]!r})"
    return answer
