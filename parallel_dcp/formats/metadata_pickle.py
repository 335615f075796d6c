"""``.metadata`` assembled from pieces pickled in the workers, so the coordinator never pickles
(nor builds) one object per key.

Pickling a 50,000-key ``Metadata`` takes the coordinator about 0.3 s on its own, the largest
serial step of a many-small-tensor save. Each worker instead pickles the entries of its own keys
(:func:`dict_fragment`), and the coordinator splices those bytes into a frame holding the empty
dicts (:func:`assemble`). The result is an ordinary pickle that ``pickle.load`` (stock DCP's
reader) and the safe unpickler read as ``Metadata``; ``tests/test_metadata_pickle.py`` compares it
with what ``FileSystemWriter.finish`` writes.

How the splice stays correct:

- a fragment is a protocol-2 pickle of a dict with its first three opcodes (``PROTO 2``,
  ``EMPTY_DICT``, ``BINPUT 0``) and its ``STOP`` removed: what is left, ``MARK k v ... SETITEMS``
  repeated, adds its entries to whatever dict is on top of the unpickler's stack;
- each fragment comes from its own pickler, so it reads back (``BINGET``) only memo slots it
  wrote itself (``BINPUT``, with explicit indices: never protocol 4's ``MEMOIZE``, whose implicit
  index would depend on the fragments before it); a later fragment may overwrite those slots,
  and nothing after it reads them;
- the frame is pickled without a memo (``Pickler.fast``), so no fragment can overwrite a slot it
  reads back.

What a fragment holds per key is cheaper to read back than what ``pickle.dumps`` of the same
objects gives: a ``TensorStorageMetadata``, its ``ChunkStorageMetadata`` and an uncompressed
record's ``_StorageInfo`` are written as a call of their class with their fields
(``REDUCE``), not as an empty object and a state dict (``NEWOBJ``, a dict, ``BUILD``). Any
unpickler builds them equal either way (the dataclasses' ``__init__`` sets the same fields), but
the call keeps the fields inline in the object where ``BUILD`` made a dict for each one, and it
memoizes no state dict: measured on 50,000 keys, reading such a key back cost 1.25 -> 0.71 us
(tensor entry) and 0.70 -> 0.36 us (record), and every later look at their fields and their
freeing less too. A ``MetadataIndex`` stays as pickle writes it: its own ``__init__`` makes a
new ``torch.Size`` and is slower to call than ``BUILD``.
"""

from __future__ import annotations

import copyreg
import io
import itertools
import pickle
import pickletools
from collections.abc import Iterable, Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

from parallel_dcp import _compat

__all__ = ["FIELDS", "assemble", "assemble_pieces", "dict_fragment"]

# Metadata's dict fields, in the order the frame holds them.
FIELDS = ("state_dict_metadata", "planner_data", "storage_data")
_PROTOCOL = 2
_PREFIX = pickle.PROTO + bytes([_PROTOCOL]) + pickle.EMPTY_DICT + pickle.BINPUT + b"\x00"


def dict_fragment(entries: Mapping[Any, Any]) -> bytes:
    """Opcodes that add ``entries`` to the dict on top of an unpickler's stack (see the module doc)."""
    if not entries:
        return b""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=_PROTOCOL)
    pickler.dispatch_table = _calls()
    pickler.dump(dict(entries))
    data = buffer.getvalue()
    if not data.startswith(_PREFIX) or not data.endswith(pickle.STOP):
        raise RuntimeError("pickle laid out a dict in an unexpected way; cannot splice .metadata")
    return data[len(_PREFIX) : -1]


def _tensor_call(meta: TensorStorageMetadata) -> tuple[Any, ...]:
    return TensorStorageMetadata, (meta.properties, meta.size, meta.chunks)


def _chunk_call(chunk: ChunkStorageMetadata) -> tuple[Any, ...]:
    return ChunkStorageMetadata, (chunk.offsets, chunk.sizes)


def _record_call(info: Any) -> Any:
    if getattr(info, "transform_descriptors", None) is not None:  # compressed: as pickle writes it (with its field)
        return info.__reduce_ex__(_PROTOCOL)
    return type(info), (info.relative_path, info.offset, info.length)


def _calls() -> dict[type, Any]:
    """The classes written as a call of the class with their fields (see the module doc), beside
    the reductions registered with copyreg (torch's own, for its dtypes and layouts)."""
    return {
        **copyreg.dispatch_table,
        TensorStorageMetadata: _tensor_call,
        ChunkStorageMetadata: _chunk_call,
        _compat.storage_info_class(): _record_call,
    }


def _frame(storage_meta: StorageMeta | None, version: str | None) -> tuple[bytes, list[int]]:
    """A pickled ``Metadata`` with empty dict fields, and where each field's empty dict ends."""
    empty = Metadata(state_dict_metadata={}, planner_data={}, storage_data={}, storage_meta=storage_meta)
    empty.version = version
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=_PROTOCOL)
    pickler.fast = True  # no memo: nothing spliced in can shadow a slot the frame reads back
    pickler.dump(empty)
    data = buffer.getvalue()

    ends: dict[str, int] = {}
    for (op, arg, _), (following, _, at) in itertools.pairwise(pickletools.genops(data)):
        if "UNICODE" in op.name and arg in FIELDS and following.name == "EMPTY_DICT" and at is not None:
            ends[arg] = at + 1
    if sorted(ends) != sorted(FIELDS) or sorted(ends.values()) != [ends[name] for name in FIELDS]:
        raise RuntimeError("pickle laid out Metadata in an unexpected way; cannot splice .metadata")
    return data, [ends[name] for name in FIELDS]


def assemble(fragments: Iterable[tuple[Any, Any, Any]], storage_meta: StorageMeta | None, version: str | None) -> bytes:
    """The bytes of ``.metadata``: a ``Metadata`` whose ``state_dict_metadata``, ``planner_data``
    and ``storage_data`` hold the entries of every fragment triple, in order."""
    return b"".join(assemble_pieces(fragments, storage_meta, version))


def assemble_pieces(
    fragments: Iterable[tuple[Any, Any, Any]], storage_meta: StorageMeta | None, version: str | None
) -> list[Any]:
    """:func:`assemble`'s bytes as the pieces they are joined from, in order: the frame's and the
    fragments themselves (bytes, or any buffer: a worker's runs arrive as views of the buffer the
    pool read them into), so a writer can write them with no joined copy."""
    frame, ends = _frame(storage_meta, version)
    pieces: list[list[Any]] = [[], [], []]
    for triple in fragments:
        for field_pieces, fragment in zip(pieces, triple, strict=True):
            field_pieces.append(fragment)
    out: list[Any] = [frame[: ends[0]]]
    for i, field_pieces in enumerate(pieces):
        out.extend(field_pieces)
        out.append(frame[ends[i] : ends[i + 1] if i + 1 < len(ends) else len(frame)])
    return out
