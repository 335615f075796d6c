"""A sharded directory's index (``model.safetensors.index.json``): its shard names, its
``weight_map``, and the index checked against its shards once both are read.

transformers reads each key from the shard its index names. An index that names no key, or a key
its shard does not hold, is a damaged checkpoint: converted as it came, the output lacked those
keys without a word (an empty ``weight_map`` gave a checkpoint of no key at all).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from parallel_dcp._json import loads_json
from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.storage.location import Location, Remote, check_name, check_relative_name
from parallel_dcp.storage.safe_files import source_tree
from parallel_dcp.storage.safe_reader import read_in_tree

__all__ = ["check_index", "index_names", "index_weight_map"]

_SHOWN = 5
_INDEX_MAX_BYTES = 64 * 2**20


def check_index(index: Location, files: Sequence[str], holders: Mapping[str, str]) -> None:
    """That every key the ``index`` a folder's files were chosen by names is held by the shard it
    names. ``files``: what ``chosen_files`` gave for it (in the index's order);
    ``holders``: each key the shards hold, and its file. (A shard may hold more keys than its
    index names: they are read too, as transformers reads them.)

    Raises:
        CorruptCheckpointError: the index names no key, or keys its shards do not hold where it says.
    """
    weight_map = index_weight_map(index)
    if not weight_map:
        raise CorruptCheckpointError(f"{index} names no tensor (its weight_map is empty)")
    names = _names(weight_map, index)  # (from this one read: the index may have changed since chosen_files)
    if len(names) != len(files):
        raise CorruptCheckpointError(f"{index} changed while it was read")
    named = dict(zip(files, names, strict=True))  # a file as read -> its name in the index
    wrong = [key for key, name in weight_map.items() if named.get(holders.get(key, "")) != name]
    if not wrong:
        return
    shown = ", ".join(
        f"{key!r} (in {weight_map[key]}, says the index; "
        + (f"held by {named.get(holders[key], holders[key])})" if key in holders else "held by no shard)")
        for key in wrong[:_SHOWN]
    )
    more = f", and {len(wrong) - _SHOWN} more" if len(wrong) > _SHOWN else ""
    raise CorruptCheckpointError(f"{index} disagrees with its shards on {len(wrong)} keys: {shown}{more}")


def index_names(index: Location) -> list[str]:
    """The shard names an index's ``weight_map`` lists, each a name inside its folder: a plain
    name, or for a local folder a path below it (``sub/m-00001-of-00002.safetensors``), as
    transformers joins each name to the model folder.

    Raises:
        CorruptCheckpointError: the index is not readable, or names a file outside its folder.
    """
    return _names(index_weight_map(index), index)


def _names(weight_map: Mapping[str, str], index: Location) -> list[str]:
    """The shard names ``weight_map`` lists, in its order, once each, each checked (a plain name on
    object storage, which has no folders to keep a name inside)."""
    check = check_name if isinstance(index, Remote) else check_relative_name
    return [check(n, index) for n in dict.fromkeys(weight_map.values())]


def index_weight_map(index: Location) -> dict[str, str]:
    """An index's ``weight_map`` (key -> shard name). Raises CorruptCheckpointError: unreadable."""
    try:
        weight_map = loads_json(_read_index(index))["weight_map"]
        if not all(isinstance(name, str) for name in weight_map.values()):
            raise TypeError("a shard name that is not a string")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{index} is not a readable index: {type(exc).__name__}: {exc}") from exc
    return dict(weight_map)


def _read_index(index: Location) -> bytes:
    if isinstance(index, Remote):
        return index.read_bytes()
    assert isinstance(index, Path)
    return read_in_tree(index, source_tree(index.parent), limit=_INDEX_MAX_BYTES)
