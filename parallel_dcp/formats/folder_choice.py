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

Only where none of those names is there does a folder fall back to every file with the format's
suffix (a stock folder of other names: ``consolidated.safetensors``, ``diffusion_pytorch_model*``),
and a PEFT adapter (``adapter_model.*``) is then read only where it is the folder's only weights
file: it is never merged into a model beside it, nor taken for one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CLIENT_ORDER", "Choice", "client_choice", "fallback_names"]

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


def fallback_names(listing: Iterable[str], suffix: str) -> list[str]:
    """Every name with ``suffix``, sorted, for a folder with none of the client's names; an
    adapter's weights only where they are all there is."""
    found = sorted(n for n in listing if n.endswith(suffix))
    return [n for n in found if not n.startswith(_ADAPTER)] or found
