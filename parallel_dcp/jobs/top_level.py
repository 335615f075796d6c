"""A torch.save file whose top level is not a mapping, refused by a conversion before any task.

``torch.save([sd1, sd2])``, ``torch.save((sd,))``, ``torch.save(tensor)`` or ``torch.save(model)``
hold no state dict: ``load`` and ``inspect`` read the object under the key ``""`` (as
docs/python-api.md says), but a conversion writes a state dict: DCP and safetensors hold nothing
else, and a torch.save output is nested again from names, so it would write ``{"": obj}`` where
``torch.load`` of the source gave ``obj`` (a tuple converted so; a list or a tensor failed in a
worker, after the job had started, naming keys such as ``'.0.a'``).
"""

from __future__ import annotations

import torch

from parallel_dcp.errors import InvalidStateDictError
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.torch_format import TorchSource

__all__ = ["module_name", "refuse_non_mapping"]


def module_name(kind: type) -> str:
    """A module class as users write it: ``torch.nn.Linear``, ``mypkg.models.Net``."""
    module = "torch.nn" if kind.__module__.startswith("torch.nn.") else kind.__module__
    return f"{module}.{kind.__qualname__}"


def refuse_non_mapping(source: Source) -> None:
    """Refuse ``source`` when a file of it holds something other than a mapping at its top level.

    Raises:
        InvalidStateDictError: naming the file, what it holds, and what to save instead.
    """
    if not isinstance(source, TorchSource) or not source.top_levels:
        return
    file, kind = next(iter(source.top_levels.items()))
    if issubclass(kind, torch.nn.Module):
        raise InvalidStateDictError(
            f"{file}: the file holds a pickled {module_name(kind)} module, not tensors (torch.save of the model "
            "object, not of its state_dict()), and no state dict at its top level. Nothing was written: load it "
            "where its class can be imported and save model.state_dict() (torch.save(model.state_dict(), PATH)), "
            "which converts"
        )
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    held = f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
    advice = "torch.save a dict that names each of its tensors"
    if issubclass(kind, torch.Tensor):
        held, advice = "a tensor", "torch.save a dict that names it (torch.save({'weight': tensor}, PATH))"
    elif issubclass(kind, (list, tuple)):
        advice = "torch.load the file and torch.save the state dict it holds (torch.save(obj[0], PATH))"
    raise InvalidStateDictError(
        f"{file} holds {held} at its top level, not a state dict (a mapping of names to tensors and values), "
        "which a conversion writes: DCP and safetensors hold nothing else, and a torch.save output would hold "
        f"it under the key '', not as torch.load gives it. Nothing was written: {advice}; "
        "load() and inspect read the file as it is, under the key ''"
    )
