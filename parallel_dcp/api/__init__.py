"""The public functions, one module per job (save, load, convert, verify, inspect and diff);
``parallel_dcp/__init__.py`` re-exports them (and only that module is the public surface).

Nothing here imports torch or a job at import time: each function imports its job when called,
after :func:`_check_torch`, so ``parallel-dcp --help`` and usage errors stay quick.
"""

from __future__ import annotations

from parallel_dcp.options import Options


def _check_torch() -> None:
    """A torch or fsspec without a private name we use fails here, naming it (once, on first use)."""
    from parallel_dcp import _compat

    _compat.check_torch()


def _given_or(given: Options | None, from_keywords: Options) -> Options:
    """``options=`` when it was passed (the keywords then stay at their defaults), else the keywords'."""
    if given is None:
        return from_keywords
    if from_keywords != Options():
        raise TypeError("pass the options either as options=Options(...) or as keyword arguments, not both")
    return given
