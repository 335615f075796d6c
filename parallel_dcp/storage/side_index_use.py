"""Whether the side index was used, and why not: what a load read its plan from (issue 32).

    load(into=) in this process, local ── side_index_read.examine_index ──┬─ IndexUse(None, size)   the index
                                                                          └─ IndexUse(reason, ...)  .metadata
    any other load path ────────────────────────────────────────────────────── IndexUse("not_asked")  .metadata
    inspect / verify ── side_index_read.index_state: the same look, for the checkpoint as it is now

``reason`` is one of :data:`REASONS` (stable strings, for programs); ``detail`` says which file,
check or figure (for people: its words may change). Nothing here changes what is read: the look
that decides is the reader's own (storage/side_index_read.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from parallel_dcp.engine.memory import format_bytes
from parallel_dcp.storage.side_index import INDEX_FILE

__all__ = ["ABSENT", "DAMAGED", "NOT_ASKED", "OVER_BUDGET", "REASONS", "STALE", "UNSAFE", "IndexUse"]

ABSENT = "absent"  # no index beside .metadata (stock wrote it, or entries an index cannot describe)
STALE = "stale"  # an index bound to other .metadata bytes (stock rewrote the checkpoint: legitimate)
DAMAGED = "damaged"  # an index that fails a check (``detail`` names it)
UNSAFE = "unsafe"  # a symlink, FIFO or anything not a regular file in its place: never followed
OVER_BUDGET = "over_budget"  # reading it could need more than the memory limit
NOT_ASKED = "not_asked"  # this load path reads .metadata whatever lies beside it
REASONS = (ABSENT, STALE, DAMAGED, UNSAFE, OVER_BUDGET, NOT_ASKED)

_WORDS = {
    ABSENT: "no side index",
    STALE: "side index stale",
    DAMAGED: "side index damaged",
    UNSAFE: "side index unsafe",
    OVER_BUDGET: "side index over the memory limit",
    NOT_ASKED: "side index not asked for",
}


@dataclass(frozen=True, slots=True)
class IndexUse:
    """What a load read its plan from: the side index ``.parallel_dcp.columns`` (``reason`` None,
    ``nbytes`` its size), or ``.metadata`` and why not the index (``reason`` one of
    :data:`REASONS`, ``detail`` which check or figure; ``nbytes`` the index's size where one was
    opened, else 0). For ``inspect`` and ``verify``: ``used`` means a ``load(into=)`` would use it."""

    reason: str | None
    detail: str = ""
    nbytes: int = 0

    def __post_init__(self) -> None:
        if self.reason is not None and self.reason not in REASONS:
            raise ValueError(f"reason {self.reason!r} is not one of {REASONS}")

    @property
    def used(self) -> bool:
        return self.reason is None

    @property
    def source(self) -> str:
        """The file the plan came from: ``.parallel_dcp.columns`` or ``.metadata``."""
        return INDEX_FILE if self.reason is None else ".metadata"

    @property
    def present(self) -> bool | None:
        """Whether an index lies beside ``.metadata`` (None: not looked for)."""
        return None if self.reason == NOT_ASKED else self.reason != ABSENT

    def state(self) -> str:
        """The index's state in words: ``"side index valid for its .metadata (1.2 MiB)"``, or the
        reason and its detail (``"side index stale: bound to ..."``)."""
        if self.reason is None:
            return f"side index valid for its .metadata ({format_bytes(self.nbytes)})"
        return _WORDS[self.reason] + (f": {self.detail}" if self.detail else "")

    def summary(self) -> str:
        """What the load read its plan from, in one line (the CLI's read stats)."""
        if self.reason is None:
            return f"plan from the side index ({format_bytes(self.nbytes)})"
        return f"plan from .metadata ({self.state()})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "used": self.used,
            "present": self.present,
            "reason": self.reason,
            "detail": self.detail,
            "bytes": self.nbytes,
        }
