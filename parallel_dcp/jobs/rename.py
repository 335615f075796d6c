"""Rename rules: map a source's flattened names to new ones on the way to the output.

    source keys ── select (--keys) ── rename (first matching rule) ── check ──▶ RenamedSource

A rule is a Python regular expression matched against the whole flattened name (``fullmatch``)
and a template with ``\\1`` / ``\\g<name>`` references (``re.Match.expand``). Rules are tried in
order; the first that matches renames the key; a key no rule matches keeps its name. A callable
``name -> new name`` (None keeps it) may stand for the rules.

Nesting of the output follows the new names: a key that keeps its name keeps the source's
nesting; a renamed key keeps the leading levels of its old nesting that its new name still
starts with (``("model", "layers.0.q")`` renamed ``model.layers.0.wq`` nests as
``("model", "layers.0.wq")``) and holds the rest of its name as one flat level, as a flat state
dict (``model.state_dict()``) does. Dots are never split into new levels: a flat name such as
``layers.0.attention.wq.weight`` could come from ``{"layers": {"0": ...}}`` or from a flat dict,
and only the latter is what ``model.state_dict()`` gives.

A rule that renames no key is most likely a typo or written for another model: each one is a
:class:`~parallel_dcp.errors.RenameWarning` naming it, and the conversion logs a summary ("N keys
renamed by M of K rules", logger ``parallel_dcp``; the CLI prints it on stderr). Keys that no rule
matched are one more warning (their count and first names); ``strict`` makes them an error.

Everything is checked before any write: two source keys mapped to one name, an empty name, and
one key's nesting path being a level of another's are refused, every offender listed.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

from parallel_dcp.errors import RenameError, RenameWarning, describe_keys, plural
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.renamed_source import RenamedSource
from parallel_dcp.jobs.rename_rules import parse_rule, read_rules_file

__all__ = ["RenameRules", "RenamedSource", "compile_rules", "parse_rule", "read_rules_file", "rename_source"]

RenameRules: TypeAlias = Sequence[tuple[str, str]] | Callable[[str], str | None]

_SHOWN = 10  # collisions listed in an error message (then "... and N more")
_log = logging.getLogger("parallel_dcp")


def compile_rules(
    rules: RenameRules, used: list[int] | None = None, unmatched: list[str] | None = None
) -> Callable[[str], str]:
    """A function giving each flattened name its new name (unmatched names are returned as is).

    ``used``: filled with the number of names each rule renamed (the first matching rule counts),
    one entry per rule; left empty for a callable. ``unmatched``: each name no rule matched (the
    callable returned None) is appended to it.

    Raises:
        RenameError: a rule that is not a (regex, template) pair of strings, or a bad regex
            (here); a template naming a group its regex lacks (when a name first matches it).
    """
    if callable(rules):
        user = rules

        def by_callable(name: str) -> str:
            new = user(name)
            if new is None:
                if unmatched is not None:
                    unmatched.append(name)
                return name
            if not isinstance(new, str):
                raise RenameError(f"the rename function returned {new!r} for {name!r}: expected a str or None")
            return new

        return by_callable
    if isinstance(rules, (str, bytes)):
        raise RenameError("rename takes a list of (regex, template) pairs, not a single string")
    compiled: list[tuple[re.Pattern[str], str]] = []
    counts = used if used is not None else []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and all(isinstance(s, str) for s in rule)):
            raise RenameError(f"rename rule {i} is {rule!r}: expected a (regex, template) pair of strings")
        try:
            compiled.append((re.compile(rule[0]), rule[1]))
        except re.error as exc:
            raise RenameError(f"rename rule {i}: bad regular expression {rule[0]!r}: {exc}") from exc
    counts[:] = [0] * len(compiled)

    def by_rules(name: str) -> str:
        for i, (pattern, template) in enumerate(compiled):
            match = pattern.fullmatch(name)
            if match is not None:
                counts[i] += 1
                try:
                    return match.expand(template)
                except (re.error, IndexError) as exc:
                    raise RenameError(
                        f"rename rule {i} ({pattern.pattern!r} -> {template!r}) cannot rename {name!r}: {exc}"
                    ) from exc
        if unmatched is not None:
            unmatched.append(name)
        return name

    return by_rules


def _nesting(old: str, new: str, path: tuple[Any, ...]) -> tuple[Any, ...]:
    """The new name's path: the old path's leading levels the new name still starts with, then
    the rest of the name as one level."""
    if new == old:
        return path
    kept: list[Any] = []
    prefix = ""
    for level in path[:-1]:
        candidate = f"{prefix}{level}."
        if not new.startswith(candidate) or len(new) == len(candidate):
            break
        kept.append(level)
        prefix = candidate
    return (*kept, new[len(prefix) :])


def _collision_error(title: str, collisions: dict[str, list[str]]) -> RenameError:
    # Each name's sources cut at a few names and a count: 96 keys renamed to one name is one short line.
    lines = [f"  {new!r} <- {describe_keys(olds)}" for new, olds in list(collisions.items())[:_SHOWN]]
    more = [f"  ... and {len(collisions) - _SHOWN} more"] if len(collisions) > _SHOWN else []
    return RenameError(f"{title} (nothing was written):", collisions=collisions, lines=[*lines, *more])


def _report(
    path: str, keys: Sequence[str], rules: RenameRules, used: list[int], renamed: int, unmatched: Sequence[str]
) -> None:
    """Warn about every rule that renamed nothing and about the keys no rule renamed; log how
    many keys the rules renamed."""
    if unmatched:
        warnings.warn(
            RenameWarning(
                f"{plural(len(unmatched), 'key')} of {path} matched no rename rule and "
                f"{'keeps its name' if len(unmatched) == 1 else 'keep their names'}: "
                f"{describe_keys(list(unmatched))} (rename_strict=True / --rename-strict refuses this)"
            ),
            stacklevel=4,
        )
    if callable(rules):
        _log.info("%s: %s renamed by the rename function", path, plural(renamed, "key"))
        return
    summary = f"{plural(renamed, 'key')} renamed by {sum(1 for n in used if n)} of {plural(len(used), 'rule')}"
    for i, count in enumerate(used):
        if count:
            continue
        regex, template = rules[i]
        pattern = re.compile(regex)
        why = (
            "every key it matches was taken by an earlier rule"
            if any(pattern.fullmatch(key) for key in keys)
            else "it matches no key"
        )
        warnings.warn(
            RenameWarning(f"rename rule {i} ({regex!r} -> {template!r}) renamed nothing in {path}: {why}; {summary}"),
            stacklevel=4,
        )
    _log.info("%s: %s", path, summary)


def rename_source(
    source: Source, keys: Sequence[str], rules: RenameRules, *, strict: bool = False, report: bool = True
) -> tuple[Source, tuple[str, ...]]:
    """``source`` seen under new names, restricted to ``keys``, and the new names in order.

    ``strict``: every key must match a rule (the callable must not return None). ``report``:
    warn about rules that renamed nothing and keys no rule matched (a preset checks its own).

    Raises:
        RenameError: two keys renamed to one name, an empty or non-string name, or nesting
            paths that clash (one key's path a level of another's); all of them are listed.
            With ``strict``, the keys that no rule matched (the first ones named, and their count).
    """
    used: list[int] = []
    unmatched: list[str] = []
    rename = compile_rules(rules, used, unmatched)
    new_of = {key: rename(key) for key in keys}
    if strict and unmatched:
        raise RenameError(
            f"rename_strict: {plural(len(unmatched), 'key')} of {source.path} match no rename rule "
            f"(nothing was written): {describe_keys(unmatched)}",
            collisions={key: [] for key in unmatched},
        )
    if report:
        _report(source.path, keys, rules, used, sum(1 for old, new in new_of.items() if old != new), unmatched)
    empty = sorted(old for old, new in new_of.items() if not new)
    if empty:
        raise _collision_error("rename rules give empty names", {"": empty})
    sources: dict[str, list[str]] = {}
    for old, new in new_of.items():
        sources.setdefault(new, []).append(old)
    collisions = {new: olds for new, olds in sources.items() if len(olds) > 1}
    if collisions:
        raise _collision_error("rename rules map several keys to one name", collisions)

    paths = {new: _nesting(old, new, tuple(source.mapping.get(old, (old,)))) for old, new in new_of.items()}
    leaves = {path: new for new, path in paths.items()}
    clashes: dict[str, list[str]] = {}
    for new, path in paths.items():
        for depth in range(1, len(path)):
            holder = leaves.get(path[:depth])
            if holder is not None:
                clashes.setdefault(holder, []).append(new)
    if clashes:
        raise _collision_error(
            "renamed keys clash in the output's nesting (a key would be both a value and a level holding others)",
            {f"{holder} (a value)": news for holder, news in clashes.items()},
        )

    view = RenamedSource(
        path=source.path,
        kind=source.kind,
        files=list(source.files),
        storage_options=source.storage_options,
        header_metadata=source.header_metadata,  # the file's own annotation: names do not change it
        folder=source.folder,
        index=source.index,
        inner=source,
    )
    for old, new in new_of.items():
        view.old_names[new] = old
        if old in source.entries:
            view.entries[new] = dataclasses.replace(source.entries[old], key=new)
        else:
            view.values[new] = source.values[old]
        view.mapping[new] = paths[new]
    return view, tuple(new_of[k] for k in keys)
