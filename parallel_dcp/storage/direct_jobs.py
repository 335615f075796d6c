"""The aligned reads of one direct read (storage/direct_read.py): which pages go straight into the
destination's memory and which through a bounce buffer.

A destination whose address and file offset are equal modulo ALIGN takes the file's whole pages
in place (O_DIRECT needs both aligned); its partial first and last pages, and destinations aligned
otherwise, are read into a bounce buffer and copied out. Neighbouring bounced bytes share one read;
every read is at most ``most`` bytes (the request size), in file order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parallel_dcp.storage.direct_write import address
from parallel_dcp.storage.io_mode import ALIGN

__all__ = ["Job", "plan_direct"]


@dataclass(slots=True)
class Job:
    """One aligned read of the file's bytes ``at``..``at + length``: straight into ``into`` (the
    destination's own memory, aligned as the file) or into a bounce buffer, whose bytes are then
    copied into ``parts`` ((file offset, view) each); ``needed``: the file must hold the bytes up
    to here (an aligned read may come back short only beyond them, at the end of the file)."""

    at: int
    length: int
    needed: int
    into: memoryview | None = None
    parts: list[tuple[int, memoryview]] = field(default_factory=list)


def plan_direct(offset: int, views: list[memoryview], most: int, *, in_place: bool = True) -> list[Job]:
    """The aligned reads that fill ``views`` (the file's bytes from ``offset``, one after the
    other), in file order, each at most ``most`` bytes: the whole pages of a view whose memory is
    aligned as the file (its address and file offset equal modulo ALIGN) are read straight into
    it; its first and last partial page, and views aligned otherwise, through a bounce buffer
    (neighbouring such bytes share one read). ``in_place=False``: every byte through a bounce
    buffer, wherever its view lies (fresh memory in 4 KiB pages, which a bounced read into huge
    pages outruns: formats/bounced_read.py)."""
    jobs: list[Job] = []
    bounce: Job | None = None

    def bounced(position: int, view: memoryview) -> None:
        nonlocal bounce
        while view.nbytes:
            if bounce is None or position >= bounce.at + most:
                bounce = Job(_down(position), 0, 0)
                jobs.append(bounce)
            n = min(view.nbytes, bounce.at + most - position)
            bounce.parts.append((position, view[:n]))
            bounce.needed = position + n
            bounce.length = _up(bounce.needed) - bounce.at
            position, view = position + n, view[n:]

    position = offset
    for view in views:
        end = position + view.nbytes
        first, last = _up(position), _down(end)
        if not in_place or (address(view) - position) % ALIGN or first >= last:
            bounced(position, view)
            position = end
            continue
        if first > position:
            bounced(position, view[: first - position])
        bounce = None  # bytes after these pages start a bounce read of their own
        for at in range(first, last, most):
            n = min(most, last - at)
            jobs.append(Job(at, n, at + n, into=view[at - position : at - position + n]))
        if end > last:
            bounced(last, view[last - position :])
        position = end
    return jobs


def _down(n: int) -> int:
    return n - n % ALIGN


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
