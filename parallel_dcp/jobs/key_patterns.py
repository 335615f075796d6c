"""Key patterns, the same everywhere: ``convert(keys=)``/``--keys``, ``inspect --keys``, ``load(keys=)``.

A pattern is a glob matched against the whole flattened key (``"model.layers.*.weight"``,
``"*embed*"``; ``*`` also crosses dots), or, prefixed with ``re:``, a Python regular expression
that must match the whole key (``"re:model\\.layers\\.[0-3]\\..*"``). A pattern that is itself one
of the keys selects that key (a key may hold glob characters: ``mlp[0].weight``).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Sequence

from parallel_dcp.errors import KeyNotFoundError, KeyPatternError, describe_keys

__all__ = ["is_pattern", "matcher", "patterns_of", "select"]


def patterns_of(patterns: str | Iterable[str]) -> list[str]:
    """One pattern or several, as a list (a lone string is one pattern, not its characters)."""
    return [patterns] if isinstance(patterns, str) else list(patterns)


def is_pattern(pattern: str) -> bool:
    """Whether ``pattern`` selects by a rule (a regular expression or a glob), not by its name."""
    return pattern.startswith("re:") or any(c in pattern for c in "*?[")


def matcher(pattern: str) -> Callable[[str], object]:
    """A predicate true for the keys ``pattern`` matches (whole keys only).

    Raises:
        KeyPatternError: a ``re:`` pattern that is not a regular expression.
    """
    if pattern.startswith("re:"):
        try:
            return re.compile(pattern[3:]).fullmatch
        except re.error as exc:
            raise KeyPatternError(f"bad regular expression in {pattern!r}: {exc}") from exc
    return re.compile(fnmatch.translate(pattern)).match


def select(keys: Sequence[str], patterns: str | Iterable[str], where: str) -> list[str]:
    """The ``keys`` that ``patterns`` select, each once: a pattern's matches in ``keys``' order,
    the patterns in theirs.

    Raises:
        KeyNotFoundError: a name that is not among ``keys``, or a pattern that selects nothing
            (every one is named; ``where`` says what was searched).
        KeyPatternError: a bad regular expression.
    """
    known = set(keys)
    selected: dict[str, None] = {}
    missing: list[str] = []
    empty: list[str] = []
    for pattern in patterns_of(patterns):
        if pattern in known:
            selected[pattern] = None
            continue
        if not is_pattern(pattern):
            missing.append(pattern)
            continue
        test = matcher(pattern)
        found = [k for k in keys if test(k)]
        if not found:
            empty.append(pattern)
        selected.update(dict.fromkeys(found))
    if missing or empty:
        parts = [f"not in {where}: {describe_keys(missing)}"] if missing else []
        if empty:
            parts.append(f"patterns that select nothing in {where}: {describe_keys(empty)}")
        raise KeyNotFoundError("; ".join(parts), keys=missing + empty)
    return list(selected)
