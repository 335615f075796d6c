"""What the planner tries before it refuses a memory limit, and the smallest limit it advises.

    plan at the limit ──fits──▶ the plan
        │ MemoryLimitExceeded
        ▼
    io="auto" that would write direct: buffered writes (no aligned buffers to hold) ──fits──▶ plan
        │
        ▼
    chunks 2, 4, ... times smaller (down to 1 MiB) ──fits──▶ plan
        │
        ▼
    refuse, advising the smallest whole number of MiB under which the same job plans (searched
    with the same fallbacks: planning there succeeds, 1 MiB under it fails), whatever limit was given.

Planning writes nothing, so trying again costs only the coordinator's time, and only on the way to
a refusal or under a tight limit.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Protocol, TypeVar

from parallel_dcp.engine.chunks import MIN_MEMORY_CHUNK_BYTES
from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.errors import MemoryLimitExceeded
from parallel_dcp.storage.location import Remote

__all__ = ["plan_with_fallbacks", "smallest_limit", "without_advice"]

P = TypeVar("P")
MiB = 1024 * 1024
# Chunks at most this many times smaller than the room allows (the last try is 1 MiB chunks).
_MOST_DIVISOR = 64
# The advice searches limits up to this (a job that plans under none of them is refused as it is).
_MOST_ADVISED = 1 << 50
_ADVICE = re.compile(r"(: )?raise --memory-limit( to at least [0-9.]+ [KMGT]?i?B)?.*$", re.DOTALL)


class _Target(Protocol):  # what this module needs of a jobs.targets.Target (importing it would be circular)
    io: str
    direct_capable: bool

    @property
    def path(self) -> object: ...


def plan_with_fallbacks(
    attempt: Callable[[MemoryGovernor, int], P], target: _Target, governor: MemoryGovernor, *, can_shrink: bool
) -> P:
    """``attempt(governor, divisor)``, falling back as the module docstring says.

    Raises:
        MemoryLimitExceeded: no fallback fits; its message advises :func:`smallest_limit`.
    """
    try:
        return _try_all(attempt, target, governor, can_shrink)
    except MemoryLimitExceeded as refused:
        least = smallest_limit(attempt, target, governor, can_shrink, start=max(refused.measured, governor.limit))
        if least is None or least <= governor.limit:
            raise
        raise MemoryLimitExceeded(
            f"{without_advice(str(refused))}: raise --memory-limit to at least {least // MiB} MiB (the smallest "
            "limit this job plans under)",
            limit=governor.limit,
            measured=least,
            keys=refused.keys,
            worker=refused.worker,
        ) from None


def _try_all(
    attempt: Callable[[MemoryGovernor, int], P], target: _Target, governor: MemoryGovernor, can_shrink: bool
) -> P:
    planned, io = governor.planned_units, target.io
    last: MemoryLimitExceeded | None = None  # the most frugal attempt's refusal: what is reported
    for mode in _modes(target):
        target.io = mode
        divisor = 1
        while True:
            governor.planned_units = planned  # a failed attempt's units were never built
            try:
                return attempt(governor, divisor)
            except MemoryLimitExceeded as exc:
                last = exc
                if not can_shrink or divisor >= _MOST_DIVISOR:
                    break
                divisor *= 2
    target.io = io
    assert last is not None
    raise last


def _modes(target: _Target) -> list[str]:
    """The I/O modes to try: as resolved, then buffered where "auto" may have chosen direct."""
    local = target.direct_capable and not isinstance(target.path, Remote)
    return [target.io, "buffered"] if target.io == "auto" and local else [target.io]


def smallest_limit(
    attempt: Callable[[MemoryGovernor, int], object],
    target: _Target,
    governor: MemoryGovernor,
    can_shrink: bool,
    *,
    start: int,
) -> int | None:
    """The smallest whole number of MiB under which ``attempt`` plans (with every fallback), found
    by doubling from ``start`` and bisecting; None when none up to ``_MOST_ADVISED`` does."""

    def plans(mib: int) -> bool:
        trial = copy.copy(governor)
        trial.limit = mib * MiB
        io = target.io
        try:
            _try_all(attempt, target, trial, can_shrink)
        except MemoryLimitExceeded:
            return False
        finally:
            target.io = io
        return True

    high = max(1, -(-start // MiB))
    while not plans(high):
        if high * MiB >= _MOST_ADVISED:
            return None
        high *= 2
    low = 0  # planning at 0 MiB never succeeds
    while high - low > 1:
        middle = (low + high) // 2
        if plans(middle):
            high = middle
        else:
            low = middle
    return high * MiB


def without_advice(message: str) -> str:
    """``message`` without its closing "raise --memory-limit ..." advice (replaced by a searched one)."""
    return _ADVICE.sub("", message).rstrip(" ;:,")


assert MiB == MIN_MEMORY_CHUNK_BYTES  # the advice's grain is the smallest chunk
