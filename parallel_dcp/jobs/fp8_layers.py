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

The class is built where transformers is installed, by :mod:`parallel_dcp.jobs.built_model`: in a
short-lived child (importing transformers costs ~270 MiB and seconds this process would carry
through the job), the same one that reads :mod:`parallel_dcp.jobs.kept_float32`'s lists where the
job casts too (one import and one build for both); in place where the caller imported it already.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallel_dcp._json import loads_json
from parallel_dcp.errors import UnsafeCheckpointError
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.quantized_pairs import source_config
from parallel_dcp.jobs.built_model import (
    FP8_LAYERS,
    LAYERS_CHILD_MEMORY,
    LOADED_NAMES,
    NOT_INSTALLED,
    Unread,
    read_model,
    spellings,
)
from parallel_dcp.jobs.loaded_names import LoadedNames
from parallel_dcp.storage.safe_files import source_tree
from parallel_dcp.storage.safe_reader import read_in_tree

__all__ = ["CHILD_MEMORY", "Fp8Layers", "fp8_layers", "model_config", "unknown_names"]


@dataclass(frozen=True, slots=True)
class Fp8Layers:
    """What transformers' FP8 path does with each 2-D weight of one model class, by parameter name."""

    architecture: str
    replaced: frozenset[str]  # weights of the modules it swaps for FP8Linear
    plain: frozenset[str]  # 2-D weights of the modules it leaves as they are
    kept: tuple[str, ...]  # _keep_in_fp32_modules: never converted, whatever the module
    prefix: str  # base_model_prefix ("transformer", "model"): checkpoints may lack it
    loaded: LoadedNames | None = None  # the names transformers loads the keys as (None: not read)

    def classify(self, key: str) -> bool | None:
        """True: transformers loads ``key`` into an FP8 layer; False: as a plain tensor; None: it
        loads no 2-D weight from it, or the name it loads it as cannot be known
        (:mod:`parallel_dcp.jobs.loaded_names`): never to be quantized as if replaced."""
        names = spellings(key, self.prefix)  # (a key transformers does not rename: its own, the prefix put on or off)
        if self.loaded is not None and (key in self.loaded.unknown or key in self.loaded.renamed):
            name = None if key in self.loaded.unknown else self.loaded.renamed[key]
            names = () if name is None else (name,)
        for name in names:
            if name in self.replaced:
                return not _kept(name.removesuffix(".weight"), self.kept)
            if name in self.plain:
                return False
        return None

    def loaded_module(self, key: str) -> str | None:
        """The module transformers loads the weight ``key`` into, where it names it otherwise than
        the checkpoint (``X`` of its ``X.weight``); None where it is the same, or not known."""
        name = self.loaded.renamed.get(key) if self.loaded is not None else None
        if name is None or not name.endswith(".weight") or name in spellings(key, self.prefix):
            return None  # (the prefix alone: transformers matches the checkpoint's name as a suffix)
        return name.removesuffix(".weight")


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


def fp8_layers(
    config: dict[str, Any] | None,
    limit: int | None = None,
    questions: frozenset[str] = frozenset(),
    keys: Sequence[str] = (),
) -> Fp8Layers | str:
    """What transformers' FP8 path replaces in the model of ``config``, and the names it loads the
    checkpoint's ``keys`` as; or, where that cannot be known, why (no config, no "architectures",
    transformers not installed, no such class, or building it failed). The build answers
    ``questions`` too (:mod:`parallel_dcp.jobs.built_model`); where the job asked this of the child
    that read its float32 lists, no child is started.

    Raises:
        MemoryLimitExceeded: the child that builds it passed ``limit`` (stopped there)."""
    if config is None:
        return "the source has no config.json"
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        return 'its config.json names no "architectures"'
    name = architectures[0]
    said = read_model(name, config, questions | {FP8_LAYERS, LOADED_NAMES}, limit, keys)
    if isinstance(said, Unread):
        return "transformers is not installed" if said == NOT_INSTALLED else f"building {name} failed ({said})"
    if said is None or said[FP8_LAYERS] is None:
        return f"transformers has no model class {name}"
    layers = said[FP8_LAYERS]
    if isinstance(layers, str):  # a class that will not build from this config
        return f"building {name} from its config.json failed ({layers})"
    return Fp8Layers(
        name,
        frozenset(layers["replaced"]),
        frozenset(layers["plain"]),
        tuple(layers["kept"]),
        said["prefix"],
        LoadedNames.of(said.get(LOADED_NAMES)),
    )


def unknown_names(config: dict[str, Any] | None, limit: int | None, keys: Sequence[str]) -> frozenset[str]:
    """The ``keys`` whose loaded names cannot be known where the model did not build (its class's
    mapping renames them on load): never quantized by their names. Asked after :func:`fp8_layers`
    with the same keys, so its child's answer is read again, not asked of another."""
    architectures = (config or {}).get("architectures")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        return frozenset()
    said = read_model(architectures[0], config or {}, {FP8_LAYERS, LOADED_NAMES}, limit, keys)
    loaded = LoadedNames.of(said.get(LOADED_NAMES)) if isinstance(said, dict) else None
    return loaded.unknown if loaded is not None else frozenset()


def model_config(source: Source, copy_files_from: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """The config.json the output will describe its model by: ``copy_files_from``'s (a local
    folder) when given, else the source's own; None when there is none or it is not a JSON object
    (refused, where it is written, with its own message)."""
    if copy_files_from is None:
        return source_config(source)
    folder = Path(os.fspath(copy_files_from))
    try:  # by the one rule for a source's small files, as the copy reads it: never through a link out
        config = loads_json(read_in_tree(folder / "config.json", source_tree(folder), limit=1 << 24))
    except UnsafeCheckpointError:
        raise  # (a link out of the folder, a FIFO: the copy refuses it too; the child is never fed it)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


# What to advise as the least limit for the building child (built_model's figure for this question).
CHILD_MEMORY = LAYERS_CHILD_MEMORY
