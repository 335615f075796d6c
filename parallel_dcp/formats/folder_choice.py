"""Which weight files a Hugging Face style folder means: the ones the real client loads from it.

Our own readers are not the judge; the client is. transformers (5.x, modeling_utils.py
``_get_resolved_checkpoint_files``; the hub download path asks for the same names in the same
order) looks in a model folder for these names and loads the first it finds, ignoring the others:
``model.safetensors``, ``model.safetensors.index.json``, ``pytorch_model.bin``,
``pytorch_model.bin.index.json``. So a folder holding ``model.safetensors`` and an older index with
its shards (a sharded upload that ``upload_folder`` did not delete) means ``model.safetensors``;
a folder holding ``pytorch_model.bin`` and a PEFT adapter's ``adapter_model.safetensors`` means
``pytorch_model.bin``. sentence-transformers' Transformer module loads its folder through
transformers (the same order); diffusers' ``subfolder`` names its own
(``diffusion_pytorch_model.safetensors``), which the fallback below reads.

A ``config.json`` beside them may name the file instead (``transformers_weights``; transformers
5 loads it before any of those names, and refuses the folder where the name is not one it takes):
:func:`explicit_choice` says which file that is, by transformers' rules and ours.

Only where none of those names is there does a folder fall back to every file with the format's
suffix (a stock folder of other names: ``consolidated.safetensors``, ``diffusion_pytorch_model*``),
and a PEFT adapter (``adapter_model.*``) is then read only where it is the folder's only weights
file: it is never merged into a model beside it, nor taken for one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath

from parallel_dcp.errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = [
    "CLIENT_ORDER",
    "Choice",
    "client_choice",
    "client_names",
    "explicit_choice",
    "fallback_names",
    "mixed_sets",
    "named_kind",
]

# (name, format, an index): what transformers looks for, in its order.
CLIENT_ORDER: tuple[tuple[str, str, bool], ...] = (
    ("model.safetensors", "safetensors", False),
    ("model.safetensors.index.json", "safetensors", True),
    ("pytorch_model.bin", "torch", False),
    ("pytorch_model.bin.index.json", "torch", True),
)
_ADAPTER = "adapter_model."


@dataclass(frozen=True, slots=True)
class Choice:
    """The file a folder's client opens first: a single weights file, or an index (``sharded``)."""

    name: str
    kind: str
    sharded: bool


def client_choice(listing: Iterable[str]) -> Choice | None:
    """The first of :data:`CLIENT_ORDER` that ``listing`` (a folder's names) holds; None where none is."""
    names = set(listing)
    for name, kind, sharded in CLIENT_ORDER:
        if name in names:
            return Choice(name, kind, sharded)
    return None


# What transformers 5.25 takes as ``transformers_weights`` (modeling_utils.py
# ``_get_resolved_checkpoint_files``): a safetensors file or index, or this one torch file.
_NAMED_SUFFIXES = (".safetensors", ".safetensors.index.json")
_NAMED_TORCH = "adapter_model.bin"


def named_kind(named: object) -> str:
    """The format of the folder whose ``config.json`` names ``named`` as ``transformers_weights``
    (not None): ``"torch"`` for the one torch file transformers takes, else ``"safetensors"`` (a
    name it refuses too: the safetensors reader then refuses it, by :func:`explicit_choice`)."""
    return "torch" if named == _NAMED_TORCH else "safetensors"


def explicit_choice(named: object, config: str) -> Choice:
    """The file ``config`` (a ``config.json``) names as ``transformers_weights`` (not None),
    relative to its folder (``./`` and repeated ``/`` folded), as transformers 5.25 takes it: a
    ``*.safetensors`` file, a ``*.safetensors.index.json`` index (its shards named relative to the
    folder, not to the index), or ``adapter_model.bin``, anywhere below the folder.

    Raises:
        CorruptCheckpointError: a name transformers refuses (another suffix, not a string, empty):
            it loads nothing from the folder.
        UnsafeCheckpointError: an absolute name or one with ``..``: refused before anything is read
            (transformers takes one that stays in the folder; we read no name that could leave it).
    """
    said = f"{config} names transformers_weights {named!r}"
    if not isinstance(named, str) or not (named.endswith(_NAMED_SUFFIXES) or named == _NAMED_TORCH):
        raise CorruptCheckpointError(
            f"{said}, which transformers refuses: it takes a *.safetensors file, a *.safetensors.index.json "
            f"index or {_NAMED_TORCH}, so it loads no weights from this folder. Fix config.json (remove "
            "the setting to load the folder's usual weights), or convert a weights file itself"
        )
    path = PurePosixPath(named)
    if path.is_absolute() or ".." in path.parts or "\0" in named:
        raise UnsafeCheckpointError(
            f"{said}: an absolute name or one with '..' is not read (it may lead out of the folder; "
            "nothing was read or written). Name the file relative to the folder"
        )
    name = path.as_posix()
    return Choice(name, named_kind(name), name.endswith(_NAMED_SUFFIXES[1]))


def client_names(listing: Iterable[str]) -> list[str]:
    """Those of a folder's names that are in :data:`CLIENT_ORDER`."""
    wanted = {name for name, _, _ in CLIENT_ORDER}
    return [n for n in listing if n in wanted]


def fallback_names(listing: Iterable[str], suffix: str) -> list[str]:
    """Every name with ``suffix``, sorted, for a folder with none of the client's names; an
    adapter's weights only where they are all there is; a variant (``X.fp16.safetensors``) not
    where ``X.safetensors`` is beside it (diffusers loads the plain file unless asked for a
    variant: both read, every tensor would be in two shards)."""
    names = set(listing)
    found = sorted(n for n in names if n.endswith(suffix) and not _a_variant(n, suffix, names))
    return [n for n in found if not n.startswith(_ADAPTER)] or found


def _a_variant(name: str, suffix: str, names: set[str]) -> bool:
    """``name`` is ``stem.variant<suffix>`` and ``stem<suffix>`` is in ``names``."""
    stem, dot, variant = name[: -len(suffix)].rpartition(".")
    return bool(dot and stem and variant) and stem + suffix in names


_SHARD = re.compile(r"-\d{5}-of-\d{5}\.[a-z]+$")


def mixed_sets(names: list[str]) -> tuple[list[str], list[str]] | None:
    """Where a fallback's ``names`` are two sets of weights, the Hugging Face shards
    (``model-00001-of-00002.safetensors``, whose index is not there) and the other files beside
    them (Mistral's ``consolidated.safetensors``: a download filtered by ``*.safetensors`` keeps
    both copies of one model), the two; None where they are one set. The client refuses such a
    folder (none of its names); read together they would make one checkpoint of both copies."""
    shards = [n for n in names if _SHARD.search(n)]
    others = [n for n in names if not _SHARD.search(n)]
    return (shards, others) if shards and others else None
