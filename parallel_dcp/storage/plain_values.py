"""A stored value made of builtins alone, unpickled by the C unpickler with nothing allowed to run.

DCP stores a non-tensor value (an optimizer's ``param_groups``: dicts, numbers and a list of one
index per parameter) as a ``torch.save`` record. torch's ``weights_only=True`` unpickler reads it
safely but in Python, about 2.5 us an element: a 25,000-parameter list costs 60 ms, more than
reading 25,000 small tensors. A value of builtins needs no global and no storage, so here the
record's ``data.pkl`` goes through ``pickle.Unpickler`` (C) with ``find_class`` and
``persistent_load`` refusing everything: stricter than ``weights_only=True`` (no callable can be
named, so nothing can run). Anything else (a tensor, a class, a record not laid out as torch
writes it) gives None, and the caller unpickles it with ``weights_only=True`` as before.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from typing import Any

__all__ = ["plain_value"]


class _NotPlain(Exception):
    """The value needs a global or a storage: not builtins alone."""


class _BuiltinsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise _NotPlain(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _NotPlain("a storage")


def plain_value(data: io.BytesIO) -> tuple[bool, Any]:
    """(True, value) for a ``torch.save`` record of builtins alone; (False, None) otherwise (the
    caller seeks ``data`` back to its start)."""
    try:
        with zipfile.ZipFile(data) as archive:
            pickles = [info for info in archive.infolist() if info.filename.rsplit("/", 1)[-1] == "data.pkl"]
            if len(pickles) != 1 or pickles[0].compress_type != zipfile.ZIP_STORED:
                return False, None
            raw = archive.read(pickles[0])  # stored: no bigger than the record itself
        unpickler = _BuiltinsOnly(io.BytesIO(raw))
        value = unpickler.load()
    except Exception:  # not builtins alone, or not a record torch wrote: torch's own reader decides
        return False, None
    return True, value
