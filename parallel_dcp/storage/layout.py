"""Which files a checkpoint of one kind owns, by a naming rule (what an overwrite replaces).

A :class:`Layout` says what marks a checkpoint directory and which of its files are the
checkpoint's. The names a checkpoint's files mention (``.metadata``'s records, an index's
``weight_map``) count only where they also follow the layout's naming rule: a crafted file in the
destination never gets a name outside that rule deleted. And only on this user's word
(:func:`written_by_us`): a record another user wrote in a shared directory names nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from parallel_dcp._json import loads_json
from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.storage.location import Location, Remote, check_name
from parallel_dcp.storage.safe_files import read_small
from parallel_dcp.storage.side_index import INDEX_FILE

__all__ = [
    "DCP_LAYOUT",
    "INDEX_FILE",
    "MANIFEST_FILE",
    "METADATA_FILE",
    "Layout",
    "committed_names",
    "is_dcp_shard_name",
    "is_ours",
    "listing",
    "read_record",
    "replaceable_name",
    "sharded_layout",
    "written_by_us",
]

METADATA_FILE = ".metadata"
MANIFEST_FILE = ".parallel_dcp.json"


@dataclass(frozen=True, slots=True)
class Layout:
    """How a checkpoint directory of one format looks: what marks it, and what it owns: its
    ``fixed`` names, and the shards its ``record`` (``.metadata``, the index) names."""

    name: str
    markers: tuple[str, ...]
    record: str
    fixed: tuple[str, ...]
    shards: Callable[[Location], set[str]]
    fixed_names: bool

    def holds_checkpoint(self, where: Location, names: list[str] | None = None) -> bool:
        names = listing(where) if names is None else names
        return any(marker in names for marker in self.markers)

    def owned(self, where: Location) -> set[str]:
        """The files the checkpoint at ``where`` owns (empty when there is none); each a plain name.
        The shards its record names count only when this user wrote the record and the shard."""
        names = listing(where)
        if not self.holds_checkpoint(where, names):
            return set()
        found = {name for name in self.fixed if name in names}
        if self.record in names and written_by_us(where / self.record):
            found |= {name for name in self.shards(where) if written_by_us(where / name)}
        return {check_name(n, where) for n in found}

    def kept_of_others(self, where: Location) -> list[str]:
        """The shards the checkpoint's record names that an overwrite keeps because this user did
        not write them (or the record): another user's files, which only they may delete."""
        names = listing(where)
        if isinstance(where, Remote) or self.record not in names or not self.holds_checkpoint(where, names):
            return []
        try:
            named = self.shards(where)
        except (CorruptCheckpointError, OSError):
            return []
        ours = written_by_us(where / self.record)
        return sorted(n for n in named if n in names and not (ours and written_by_us(where / n)))


def written_by_us(path: Location) -> bool:
    """The one rule for what a file found in a destination may decide: a record (an owner, job or
    done record, ``.metadata``, an index) gets a file deleted, or adopted by a resume, only when
    this user (the effective uid) owns the record and the file. Another user's files in a shared
    directory (a sticky ``/scratch``) never get this user's files deleted, and never become this
    user's checkpoint. Object storage has no owners: True there."""
    if isinstance(path, Remote):
        return True
    try:
        return is_ours(os.lstat(path))
    except OSError:
        return False


def is_ours(st: os.stat_result) -> bool:
    """:func:`written_by_us` for a file already open (its ``fstat``)."""
    return st.st_uid == os.geteuid()


# The names a checkpoint's shards can have, by layout. A name that ``.metadata`` or an index
# mentions is the checkpoint's only if it also has such a name: what an overwrite deletes is decided
# by the rule, never by a file in the destination alone (a damaged or crafted ``.metadata`` naming
# ``train_state.json`` as a shard must not get it deleted).
# DCP: ``__<rank>_<n>.distcp`` (FileSystemWriter) and ``__<task>_<save id>_<n>.distcp`` (ours).
_DCP_SHARD = re.compile(r"__[0-9]+_[0-9A-Za-z_]+\.distcp")


def is_dcp_shard_name(name: str) -> bool:
    """True for a name a DCP writer gives its shard files."""
    return _DCP_SHARD.fullmatch(name) is not None


def _shard_name_rule(suffixes: tuple[str, ...]) -> Callable[[str], bool]:
    """A Hugging Face shard name: visible, with the format's suffix."""
    return lambda name: not name.startswith(".") and name.endswith(suffixes) and "/" not in name


def _dcp_shards(where: Location) -> set[str]:
    from parallel_dcp.storage.metadata import read_metadata  # metadata_io reads through this module's names

    metadata = read_metadata(where)
    mentioned = {str(info.relative_path) for info in (metadata.storage_data or {}).values()}
    return {name for name in mentioned if is_dcp_shard_name(name)}


DCP_LAYOUT = Layout(
    "DCP checkpoint",
    (METADATA_FILE,),
    METADATA_FILE,
    (METADATA_FILE, MANIFEST_FILE, INDEX_FILE),
    _dcp_shards,
    fixed_names=False,
)


def sharded_layout(kind: str, index_name: str, single: str, suffixes: tuple[str, ...] | None = None) -> Layout:
    """The layout of a Hugging Face style directory: ``index_name`` names its shards, and of those
    only names with one of ``suffixes`` (default: ``single``'s) are the checkpoint's."""
    is_shard = _shard_name_rule(suffixes or (os.path.splitext(single)[1],))

    def shards(where: Location) -> set[str]:
        try:
            named = loads_json(read_record(where / index_name))["weight_map"].values()
            mentioned = {check_name(n, where / index_name) for n in named}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(f"{where / index_name} is not a readable index: {exc}") from exc
        return {n for n in mentioned if is_shard(n)}

    return Layout(
        f"{kind} checkpoint directory",
        (index_name, single),
        index_name,
        (index_name, single, MANIFEST_FILE),
        shards,
        fixed_names=True,
    )


# Files that may be a single-file checkpoint (``model.safetensors``, the user's ``best.pt``), and
# the numbered shard names a Hugging Face index gives (``model-00001-of-00003.safetensors``).
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")
_NUMBERED_SHARD = re.compile(r".+-[0-9]{5}-of-[0-9]{5}\.(safetensors|bin|pt|pth)")


def committed_names(where: Location, names: list[str]) -> set[str]:
    """Every name in ``where`` that a committed checkpoint of any layout names, which no owner
    record may get deleted: a DCP ``.metadata`` and its shards (every DCP shard name when it cannot
    be read), every index and the shards its ``weight_map`` names, every file that may be a
    single-file checkpoint (a weight file that is not a numbered shard of an index), and the
    manifest beside any of them."""
    protected: set[str] = set()
    if METADATA_FILE in names:
        try:
            protected |= {METADATA_FILE, *DCP_LAYOUT.shards(where)}  # whoever wrote it
        except Exception:  # a damaged .metadata cannot say which are its shards: all are kept
            protected |= {METADATA_FILE, *(n for n in names if is_dcp_shard_name(n))}
    for name in names:
        if name.startswith("."):
            continue
        if name.endswith(".index.json"):
            protected.add(name)
            # an unreadable index names nothing (its file name alone is protected, above)
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError, OSError):
                shards = loads_json(read_record(where / name))["weight_map"].values()
                protected |= {n for n in shards if isinstance(n, str)}
        elif name.endswith(_WEIGHT_FILES) and _NUMBERED_SHARD.fullmatch(name) is None:
            protected.add(name)
    if protected:
        protected.add(MANIFEST_FILE)
    if METADATA_FILE in names:
        protected.add(INDEX_FILE)
    return protected


def listing(where: Location) -> list[str]:
    if isinstance(where, Remote):
        return where.listdir()
    return sorted(os.listdir(where)) if where.is_dir() else []


def replaceable_name(name: str) -> bool:
    """A name an owner record's ``replaces`` may list: one some layout gives a checkpoint's files.
    An owner record is a file in the destination, so it may be crafted: ``replaces`` listing
    ``train_state.json`` must not get it deleted."""
    return (
        name in (METADATA_FILE, MANIFEST_FILE, INDEX_FILE)
        or is_dcp_shard_name(name)
        or _shard_name_rule((".safetensors", ".bin", ".pt", ".pth", ".index.json"))(name)
    )


def read_record(path: Location) -> bytes:
    """A small file a save wrote (owner record, manifest): local ones never through a symlink or
    from a FIFO (which would block)."""
    if isinstance(path, Remote):
        return path.read_bytes()
    return read_small(path, 64 * 2**20)
