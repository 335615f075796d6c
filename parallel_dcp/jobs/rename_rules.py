"""Rename rules as the command line gives them (``--rename REGEX=TEMPLATE``, ``--rename-file``):
parsed and checked without torch, so a bad rule is a usage error at once (see cli/flags.py).
:mod:`parallel_dcp.jobs.rename` applies them."""

from __future__ import annotations

import os
import re

from parallel_dcp._json import loads_json
from parallel_dcp.errors import RenameError

__all__ = ["check_regex", "parse_rule", "read_rules_file"]


def check_regex(regex: str, where: str) -> None:
    """Raises RenameError (naming ``where``) when ``regex`` is not a Python regular expression."""
    try:
        re.compile(regex)
    except re.error as exc:
        raise RenameError(f"{where}: bad regular expression {regex!r}: {exc}") from exc


def parse_rule(text: str) -> tuple[str, str]:
    """``"REGEX=TEMPLATE"`` (the CLI's ``--rename``) split at its last ``=``.

    Templates cannot hold ``=`` this way (regexes may: ``(?=...)``); use a rules file for those.

    Raises:
        RenameError: no ``=``, or an empty regex.
    """
    regex, sep, template = text.rpartition("=")
    if not sep or not regex:
        raise RenameError(f"a rename rule is REGEX=TEMPLATE, got {text!r}")
    return regex, template


def read_rules_file(path: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """Rules from a JSON file holding a list of ``[regex, template]`` pairs.

    Raises:
        RenameError: the file cannot be read, is not JSON, or not a list of pairs of strings.
    """
    try:
        with open(path, encoding="utf-8") as f:
            value = loads_json(f.read())
    except OSError as exc:  # said in words: "no such file or directory", not "[Errno 2] ..."
        reason = (exc.strerror or str(exc)).lower()
        raise RenameError(f"cannot read {os.fspath(path)}: {reason}") from exc
    except ValueError as exc:
        raise RenameError(f"rename rules file {os.fspath(path)} is not JSON: {exc}") from exc
    if not isinstance(value, list):
        raise RenameError(f"rename rules file {os.fspath(path)} must hold a JSON list of [regex, template] pairs")
    rules = []
    for i, pair in enumerate(value):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
            raise RenameError(f"rename rules file {os.fspath(path)}: entry {i} is {pair!r}, not [regex, template]")
        rules.append((pair[0], pair[1]))
    return rules
