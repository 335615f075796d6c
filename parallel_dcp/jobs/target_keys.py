"""What an output can hold of the keys a conversion selected, checked after ``keys=`` and
``rename=`` and before anything is written: safetensors holds tensors only, and only one
torch.save file keeps a mapping key that is not a string (formats/key_paths.py).

A torch.save training checkpoint, ``{"model": ..., "optimizer": opt.state_dict(), "epoch": 3}``,
keys its optimizer state by parameter index (ints). ``torch.load`` gives them back, so a
conversion to one torch.save file writes them as they are. DCP and safetensors name keys by
strings only: there the state is refused, naming the file's own keys and the selection that
leaves it out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from parallel_dcp.errors import InvalidStateDictError, key_name, printable
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.key_paths import NonStringKey, describe_level, first_non_string
from parallel_dcp.jobs.targets import Target
from parallel_dcp.jobs.top_level import module_name

__all__ = ["check_keys_fit"]

# What a format of string names makes of the int key 0, as the reader of the output sees it.
_WHAT_BECOMES_OF_IT = {
    "dcp": (
        "DCP names keys by strings only: stock torch.distributed.checkpoint.save stores it under its str() "
        "name ('{name}'), and a load without a template (dcp_to_torch_save too) gives back the string "
        "'{name}', which an optimizer's load_state_dict keeps apart from its parameter, so the parameter "
        "resumes with fresh state (only a load into a template holding the same int keys fills them)"
    ),
    "safetensors": (
        "safetensors holds flat string names only: the key comes back inside a name ('{example}'), "
        "never as the {kind} it is"
    ),
    "torch": (
        "A sharded torch.save directory holds flat string names, as Hugging Face's shards: the key comes "
        "back inside a name ('{example}'), never as the {kind} it is"
    ),
}


def check_keys_fit(target: Target, source: Source, keys: Sequence[str]) -> None:
    """Refuse, before any write, ``keys`` of ``source`` that ``target`` cannot hold as they are.

    Raises:
        InvalidStateDictError: a key under a mapping key that is not a string, for any output but
            one torch.save file.
        ValueError: a value that is not a tensor, for safetensors.
    """
    if not target.keeps_nesting:
        _refuse_non_string_keys(target, source, keys)
    if target.tensors_only:
        others = [k for k in keys if k not in source.entries]
        _refuse_modules(source, others)
        if others:
            raise ValueError(
                f"safetensors holds only tensors, and {source.path} selects {len(others)} other values "
                f"({', '.join(key_name(k) for k in others[:5])}); select tensors only with keys= (--keys)"
            )


def _refuse_modules(source: Source, keys: Sequence[str]) -> None:
    """A pickled ``nn.Module`` (``torch.save(model)``, or one under a key) is no tensor: say so, and
    that its ``state_dict()`` is what converts (its weights are not keys of the file)."""
    modules = [(k, v) for k in keys if isinstance(v := source.values.get(k), torch.nn.Module)]
    if not modules:
        return
    key, module = modules[0]
    name = module_name(type(module))
    where = "the file" if key == "" else f"its key {printable(key)!r}"
    raise ValueError(
        f"{source.path}: {where} holds a pickled {name} module, not tensors (torch.save of the model "
        "object, not of its state_dict()); safetensors holds tensors only: load it where its class can be "
        "imported and save model.state_dict() (torch.save(model.state_dict(), PATH)), which converts"
    )


def _refuse_non_string_keys(target: Target, source: Source, keys: Sequence[str]) -> None:
    found = first_non_string(source.mapping, keys)
    if found is None:
        return
    first, level = found
    path = source.mapping[first]
    under = [k for k in keys if any(type(part) is NonStringKey for part in source.mapping.get(k, ()))]
    said = _WHAT_BECOMES_OF_IT[target.kind].format(
        name=str(path[level]), example=first, kind=type(path[level].key).__name__
    )
    shown = ", ".join(key_name(k) for k in under[:3]) + (" ..." if len(under) > 3 else "")
    raise InvalidStateDictError(
        f"{source.path} holds {describe_level(path, level)}, not a string (torch.load gives it as it is; "
        f"an optimizer's state_dict() keys its state by parameter index), and {len(under)} selected keys "
        f"lie under such keys ({shown}). {said}. Nothing was written. {_what_to_do(target, source, keys, under)}"
    )


def _what_to_do(target: Target, source: Source, keys: Sequence[str], under: list[str]) -> str:
    """The selection of this file's top-level names that leaves every such key out (tensors only,
    for safetensors), and the output that keeps them."""
    held = {source.mapping.get(k, (k,))[0] for k in under}
    tops: dict[str, bool] = {}  # each other top-level name: whether it holds a nesting
    for key in keys:
        path = source.mapping.get(key, (key,))
        if path[0] not in held and (key in source.entries or not target.tensors_only):
            tops[str(path[0])] = tops.get(str(path[0]), False) or len(path) > 1
    keep = "convert to one torch.save file (.pt), which keeps them as they are"
    if not tops:
        return f"Rename those levels to strings (rename=, --rename), or {keep}."
    patterns = [f"{top}.*" if nested else top for top, nested in tops.items()]
    flags = " ".join(f"--keys '{p}'" for p in patterns)
    api = repr(patterns[0] if len(patterns) == 1 else patterns)
    return f"Leave them out with keys={api} ({flags}), or {keep}."
