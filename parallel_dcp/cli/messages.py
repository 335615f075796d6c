"""What the command prints besides its results: the library's errors, warnings and notes as
``parallel-dcp: ...`` lines, in the command line's spelling (flags for keywords), names escaped."""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from typing import Any

from parallel_dcp.errors import printable

__all__ = ["as_flags", "log_to_stderr", "message", "print_notes", "show_warning"]


def print_notes(exc: BaseException) -> None:
    """What the job added to its error (a conversion's finished tasks kept for --resume)."""
    for note in getattr(exc, "__notes__", []):
        print(f"parallel-dcp: {message(str(note))}", file=sys.stderr)


# The library's messages name keyword arguments and flags together (``pass overwrite=True
# (--overwrite)``, ``convert(..., resume=True)``); on the command line only the flag means anything.
_KEYWORD_AND_FLAG = re.compile(r"(?:\w+\(\.\.\., )?\b(\w+)=(?:True|False|\.\.\.)?\)? ?\((--[\w-]+)\)")
_FLAG_AND_KEYWORD = re.compile(r"(--[\w-]+) \((?:\w+\(\.\.\., )?\w+=\w*\)?\)")
_WORD_AND_FLAG = re.compile(r"\b(\w+) \((--[\w-]+)\)")
_KEYWORD_TRUE = re.compile(r"\b(\w+)=True\b")
# ``io="direct" (--io direct)``: a keyword with a quoted value, and the flag with its value.
_VALUE_AND_FLAG = re.compile(r"\b\w+=([\"'])[^\"']*\1 \((--[\w-]+ [^()]+)\)")
_FLAG_KEYWORDS = {"overwrite", "resume", "trust_pickle", "distributed", "dry_run"}


def as_flags(text: str) -> str:
    """``text`` with each keyword argument it names replaced by its command-line flag."""
    text = _VALUE_AND_FLAG.sub(r"\2", text)
    text = _KEYWORD_AND_FLAG.sub(r"\2", text)
    text = _FLAG_AND_KEYWORD.sub(r"\1", text)
    text = _WORD_AND_FLAG.sub(lambda m: m[2] if m[2] == "--" + m[1].replace("_", "-") else m[0], text)
    return _KEYWORD_TRUE.sub(lambda m: f"--{m[1].replace('_', '-')}" if m[1] in _FLAG_KEYWORDS else m[0], text)


def message(text: str) -> str:
    """A library message as the command line shows it: flags for keywords, control characters
    in names escaped (line breaks the message itself makes are kept)."""
    return "\n".join(printable(line) for line in as_flags(text).split("\n"))


def show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    """A warning as one line, ``parallel-dcp: warning: ...`` (no source path, no line of code)."""
    text = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    with contextlib.suppress(OSError, ValueError):  # stderr is gone: nowhere to warn
        print(f"parallel-dcp: warning: {printable(as_flags(text))}", file=sys.stderr)


class _Notes(logging.Handler):
    """The library's notes (the ``parallel_dcp`` logger: rename summaries) as ``parallel-dcp: ...``
    lines on the stderr of the moment (names escaped)."""

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(OSError, ValueError):
            print(f"parallel-dcp: {printable(as_flags(record.getMessage()))}", file=sys.stderr)


def log_to_stderr(quiet: bool) -> logging.Handler | None:
    """Show the library's notes for this command (none with ``-q``); returns the handler to remove."""
    if quiet:
        return None
    logger = logging.getLogger("parallel_dcp")
    handler = _Notes(logging.INFO)
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    return handler
