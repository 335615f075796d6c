"""What a DCP save's commit writes beside its shards, from the runs its workers sent: ``.metadata``
in pieces, its digest for the manifest, and the side index (jobs/targets.py ``DcpTarget.commit``).

The workers' pickled ``.metadata`` runs (formats/lean.py) travel out of band (:func:`out_of_band`):
each worker puts them in a memory file the coordinator maps (engine/messages.py), and they stay
there: ``.metadata`` is the frame's pieces and views of those runs (formats/metadata_pickle.py
``assemble_pieces``), written by gathered writes (storage/safe_files.py ``write_all``), never
joined; it is hashed once, in pieces, for both the manifest's checksum and the side index's
binding (the same xxh3_64). Measured on a Saver's later save of 50,000 small keys (15 MB of runs),
each copy of those bytes cost the coordinator 2-5 ms: pickled in band they were copied from the
pipe, out of the reply, out of the result, and joined, then hashed twice; receiving the results
and committing took 31-38 ms of its CPU, now 11.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import xxhash
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import StorageMeta

from parallel_dcp.formats import lean, metadata_pickle
from parallel_dcp.storage.location import Location, Remote
from parallel_dcp.storage.manifest import FileDigest
from parallel_dcp.storage.side_index import Segment, index_for, int64_column

__all__ = ["MetadataFiles", "in_band", "metadata_files", "out_of_band", "outgoing_part"]


@dataclass(frozen=True, slots=True)
class MetadataFiles:
    """``.metadata``'s bytes as pieces in order, its digest, and its side index (None: none)."""

    pieces: list[Any]
    digest: FileDigest
    index: bytes | None


def out_of_band(result: Any) -> Any:
    """``result`` (in the worker, as it goes home) with a lean part's runs and its side-index
    columns wrapped in ``pickle.PickleBuffer`` (its int64 columns too, as their raw bytes: a numpy
    array in a pickle costs the coordinator ~10 us hot to rebuild, three a run): the pool sends
    them beside the pickle (engine/messages.py ``pickled_result``); anything else as it is. The
    coordinator gets them back as read-only views, or bytes where they travelled in the pickle;
    storage/side_index.py reads the int64 ones as such."""
    if not isinstance(result, lean.LeanPart) or not result.runs:
        return result
    wrap = pickle.PickleBuffer
    runs = [(at, (wrap(a), wrap(b), wrap(c))) for at, (a, b, c) in result.runs]
    columns = result.columns
    if columns is not None:
        columns = [cast(Segment, tuple(map(wrap, segment))) for segment in columns]
    return dataclasses.replace(result, runs=runs, columns=columns)


def in_band(result: Any) -> Any:
    """``result`` as :func:`out_of_band` had it before: its views (or wrapped bytes) copied back to
    bytes, and its int64 columns to arrays (which carry their byte order to another rank), for a
    pickle with no buffers beside it (``torch.distributed``'s gather to rank 0)."""
    if not isinstance(result, lean.LeanPart) or not result.runs:
        return result
    runs = [(at, (bytes(a), bytes(b), bytes(c))) for at, (a, b, c) in result.runs]
    columns = result.columns
    if columns is not None:
        columns = [cast(Segment, (*map(bytes, segment[:5]), *map(int64_column, segment[5:]))) for segment in columns]
    return dataclasses.replace(result, runs=runs, columns=columns)


def outgoing_part(mapping: Mapping[str, Any], positions: Callable[[], Mapping[str, int]], result: Any) -> Any:
    """In the worker: ``result`` with a lean part's whole keys pickled (:func:`lean.encode`, with
    each key's ``mapping`` and the job's ``positions()``), unless they are already, and its runs
    set to travel out of band (:func:`out_of_band`)."""
    plain = isinstance(result, lean.LeanPart) and (bool(result.values) or any(t[5] is None for t in result.tensors))
    return out_of_band(lean.encode(result, mapping, positions()) if plain else result)


def metadata_files(
    path: Location, results: list[Any], runs: list[Any], save_id: str, *, checksum: bool, indexed: bool
) -> MetadataFiles:
    """``.metadata`` of the ordered ``runs`` (each (place, fragment triple)), with what
    ``FileSystemWriter.finish`` records besides the entries, as pieces (formats/metadata_pickle.py
    ``assemble_pieces``); its digest (checksum unless not ``checksum``); and where ``indexed`` (no
    entries were built in the coordinator) the side index from the columns ``results`` sent."""
    storage_meta = StorageMeta(checkpoint_id=str(path), save_id=save_id)
    pieces = metadata_pickle.assemble_pieces([run for _, run in runs], storage_meta, CURRENT_DCP_VERSION)
    columns = _columns(path, results) if indexed else None
    hasher = xxhash.xxh3_64() if checksum or columns is not None else None
    size = 0
    for piece in pieces:
        view = memoryview(piece)
        size += view.nbytes
        if hasher is not None:
            hasher.update(view)
    digest = FileDigest(size, hasher.hexdigest() if hasher is not None and checksum else None)
    index = None
    if columns is not None and hasher is not None:
        index = index_for(columns, size, hasher.intdigest(), save_id)
    return MetadataFiles(pieces, digest, index)


def _columns(path: Location, results: list[Any]) -> Sequence[tuple[str, Segment]] | None:
    """Each run's (shard file name, columns), in ``.metadata``'s order; None where a part sent
    none (compressed, DCP's planner, an unknown dtype) or the checkpoint is on object storage
    (its reader unpickles)."""
    if isinstance(path, Remote):
        return None
    pieces: list[tuple[int, tuple[str, Segment]]] = []
    for result in results:
        if not isinstance(result, lean.LeanPart) or result.columns is None:
            return None
        pieces += [(run[0], (result.file, seg)) for run, seg in zip(result.runs, result.columns, strict=True)]
    pieces.sort(key=lambda piece: piece[0])
    return [piece for _, piece in pieces]
