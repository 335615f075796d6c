"""The ``.metadata`` entries a DCP target's commit builds itself (the workers pickle the rest)."""

from __future__ import annotations

from typing import Any, Protocol

from parallel_dcp.engine.chunks import Chunk
from parallel_dcp.formats import lean, metadata_pickle
from parallel_dcp.formats.base import Source
from parallel_dcp.partial import merge_metadata


class Job(Protocol):  # what this module reads of a jobs.targets.Job (importing it would be a cycle)
    @property
    def source(self) -> Source: ...
    @property
    def keys(self) -> tuple[str, ...]: ...
    @property
    def chunks(self) -> dict[str, Chunk]: ...


__all__ = ["remaining_entries"]


def remaining_entries(job: Job, results: list[Any]) -> list[tuple[int, tuple[bytes, bytes, bytes]]]:
    """The ``.metadata`` entries no worker pickled, one piece per key at its place in the job:
    chunks of split tensors (one entry per tensor, its chunks from several parts) and tasks that
    went through DCP's planner (DTensor, ...)."""
    leftovers = [r for r in results if isinstance(r, lean.LeanPart) and (r.values or r.tensors)]
    parts = [lean.build(leftovers)] if leftovers else []
    parts += [(r[0], [r[1]]) for r in results if not isinstance(r, lean.LeanPart)]
    if not parts:
        return []
    merged = merge_metadata([m for m, _ in parts]) if len(parts) > 1 else parts[0][0]
    stored: dict[str, list[Any]] = {}
    for _, writes in parts:
        for ws in writes:
            for w in ws:
                stored.setdefault(w.index.fqn, []).append(w)
    place: dict[str, int] = {}
    for i, unit in enumerate(job.keys):
        chunk = job.chunks.get(unit)
        place.setdefault(chunk.key if chunk else unit, i)
    return [
        (
            place.get(key, len(job.keys)),
            (
                metadata_pickle.dict_fragment({key: entry}),
                # Nesting comes from the whole source, not from the parts (which were saved flat).
                metadata_pickle.dict_fragment({key: job.source.mapping.get(key, (key,))}),
                metadata_pickle.dict_fragment({w.index: w.storage_data for w in stored.get(key, [])}),
            ),
        )
        for key, entry in merged.state_dict_metadata.items()
    ]
