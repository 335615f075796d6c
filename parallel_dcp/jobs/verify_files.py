"""Where an output's checksums are, whatever its layout: what ``verify`` hashes its files against.

    checkpoint directory (DCP, sharded) ── .parallel_dcp.json beside its files
    torch.save file  model.pt          ── model.pt.manifest.json beside it (a sidecar)
    safetensors file model.safetensors ── its own header's __metadata__: the tensor index's digest
                                          (checked here) and the data section's (hashed by the pool)

A single local file named through a symlink (a "latest" link, a run folder pointing into a
checkpoint store) is read wherever it leads, so its record is the one of the file it leads to:
the name is resolved once (realpath, when the source's files are listed), and the sidecar beside
the resolved file, or its header, is read from there by the one rule (never through a link: the
resolved name is none). A sidecar beside the link's own name, where the file it leads to has
none, is not used: it was written for whatever file that name held then (a link repointed since,
``ln -sf step2000.pt latest.pt`` over a file we once wrote, leaves it beside another file), so it
proves nothing about this one; a conversion says it did not check (:func:`record_beside_link`),
and ``verify`` names it.

A folder's file that is a link within the source's tree (a Hugging Face cache snapshot's links into
its blobs/) is read where it leads, by conversions and ``verify`` alike (:func:`links_within`); a
link out of the tree is refused, and a DCP shard is read by its own name (DCP's reader follows no
link).

Every record is read by :mod:`parallel_dcp.storage.manifest` (one algorithm, one document).

Longer than 300 lines because which record belongs to a file, and why a record found beside a
link's name is not used, are one rule: kept together so that every file is either checked or said.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from parallel_dcp.errors import CorruptCheckpointError, UnsafeCheckpointError
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.safetensors_format import embedded_checksums
from parallel_dcp.jobs.snapshot_records import snapshot_record, snapshot_sidecar, snapshot_tree
from parallel_dcp.storage.location import Location, Remote
from parallel_dcp.storage.manifest import MANIFEST_FILE, FileDigest, read_manifest, sidecar_name
from parallel_dcp.storage.safe_files import resolve_in_tree, source_tree

__all__ = [
    "Recorded",
    "add_record",
    "documentation_file",
    "links_within",
    "no_checksums_problem",
    "own_record",
    "record_beside_link",
    "recorded_checksums",
    "shown_as",
    "stale_record",
]


@dataclass
class Recorded:
    """The checksums an output carries.

    Attributes:
        directory: where the recorded files are (a single file's real folder: not through a link).
        files: each file's recorded size and checksum (of its bytes from ``starts[name]`` on).
        record: where they are recorded, as an error names it ("model.pt.manifest.json").
        starts: for a file whose record covers only its data section: where that begins.
        problems: what the record itself shows (a header that differs from the one recorded).
        records: a folder whose files carry their own records (no record of its own), or the
            files its record does not list that carry one (jobs/unrecorded.py): each file's
            ("its header", "pytorch_model.bin.manifest.json"), read beside the file.
    """

    directory: Location
    files: dict[str, FileDigest]
    record: str
    starts: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    records: dict[str, str] = field(default_factory=dict)

    def record_of(self, name: str) -> str:
        """Where file ``name``'s checksum is recorded, as an error names it."""
        return self.records.get(name, self.record)


def recorded_checksums(source: Source, *, warn_stale: bool = True) -> Recorded | None:
    """The checksums ``source``'s files carry; None when they carry none. A single local file's
    are those of the file its name resolves to (``directory`` is that file's folder): its own
    (header, sidecar), else its folder's entry for it (a shard named alone), else, for a file of
    a Hugging Face cache snapshot, the record the snapshot holds beside its name
    (:func:`~parallel_dcp.jobs.snapshot_records.snapshot_record`), also where the name reaches the
    snapshot's link through links of its own (each link on the way is tried). A folder's are its
    ``.parallel_dcp.json``'s (read as its files are: a link only within its tree,
    :func:`links_within`), else its shards' own (a folder is no way round a file's record).
    ``warn_stale``: a stale record is warned of (else only None: ``verify`` reports it).

    Raises:
        CorruptCheckpointError: a record exists but cannot be read, or names other files.
    """
    location = source.location
    if location.is_dir():
        files = read_manifest(location, current_only=True, tree=links_within(source), warn_stale=warn_stale)
        if files is not None:
            return Recorded(location, files, MANIFEST_FILE)
        return _own_records(source) if source.kind != "dcp" and not isinstance(location, Remote) else None
    if isinstance(location, Remote):
        return _file_record(source.kind, location, location.name) or _folder_record(location)
    read = _file_read(source)
    if (own := _file_record(source.kind, read, read.name)) is not None:
        return own
    if (folder := _folder_record(read)) is not None:
        return folder
    # (the name typed may be the user's own link to a snapshot's file, ``~/m.pt -> hub/models--X/
    # snapshots/<rev>/model.pt -> ../../blobs/<sha>``: the snapshot's link on the way decides)
    for link in _links_on_the_way(Path(os.path.abspath(source.location))):
        if (found := snapshot_record(link, read, source.kind)) is not None:
            return Recorded(read.parent, {read.name: found[0]}, found[1])
    return None


def _file_read(source: Source) -> Path:
    """The file a single local source's reads open: its name resolved once, when its files were
    listed (formats/base.py shard_files), never again here; a link repointed since (``ln -sf
    step2.pt latest.pt`` by a training loop) must not make the check hash another file than the
    one the job converts."""
    return Path(source.files[0]) if len(source.files) == 1 else Path(os.path.realpath(source.location))


def _folder_record(file: Location) -> Recorded | None:
    """A file with no record of its own that is a shard of a folder whose ``.parallel_dcp.json``
    records it (one shard of a Hugging Face folder parallel_dcp wrote, named alone): that entry;
    None where the folder records no such file."""
    files = read_manifest(file.parent, current_only=True)
    if files is None or file.name not in files:
        return None
    return Recorded(file.parent, {file.name: files[file.name]}, MANIFEST_FILE)


def _file_record(kind: str, location: Location, name: str) -> Recorded | None:
    """The record one file carries of itself (``location``: never a link), under ``name``: a
    safetensors file's header entry, a torch.save file's sidecar beside it; None where it has none."""
    if kind == "safetensors":
        found = embedded_checksums(location)
        if found is None:
            return None
        start, index, data, index_now = found
        recorded = Recorded(location.parent, {name: data}, "its header")
        recorded.starts[name] = start
        if index.digest is not None and index_now.digest != index.digest:
            recorded.problems.append(
                f"file {name}: its header (tensor names, dtypes, shapes, offsets) is not the one its "
                f"checksum was taken of: {index_now.digest} != {index.digest} recorded (a corrupted header, or a "
                'rewrite that kept its "parallel_dcp" metadata entry)'
            )
        return recorded
    files = read_manifest(location.parent, of_file=location.name)
    if files is None:
        return None
    return Recorded(location.parent, {name: files[location.name]}, sidecar_name(location.name))


def _own_records(source: Source) -> Recorded | None:
    """A local Hugging Face folder with no record of its own whose shards carry theirs (a
    ``model.safetensors`` written by ``convert ckpt folder/model.safetensors``, its checksums in
    its header; a ``pytorch_model.bin`` with its sidecar): each shard's record, by the shard's
    name in the folder, so that a file is checked whichever way it is reached (named, or its
    folder). A shard that is a link within the tree has the record of the file it leads to,
    as a single file named through a link does (in a Hugging Face cache snapshot, the sidecar the
    snapshot holds beside it: :func:`~parallel_dcp.jobs.snapshot_records.snapshot_sidecar`). None
    where no shard carries one.
    """
    folder = Path(os.fspath(source.location))
    tree = source_tree(folder)
    read = set(source.files)  # (resolved: formats/base.py shard_files)
    recorded = Recorded(folder, {}, "")
    for name in sorted(os.listdir(folder)):
        try:
            real = resolve_in_tree(folder / name, tree)
        except (UnsafeCheckpointError, FileNotFoundError):
            continue  # (not a file the job reads: its shards were resolved so, or refused)
        if os.fspath(real) not in read:
            continue
        if (own := own_record(source.kind, folder, name, real)) is not None:
            add_record(recorded, name, own)
    if not recorded.files:
        return None
    recorded.record = recorded.records[next(iter(recorded.files))] if len(recorded.files) == 1 else "their own records"
    return recorded


def own_record(kind: str, folder: Path, name: str, real: Path) -> Recorded | None:
    """The record file ``name`` of ``folder`` (a file of ``kind`` read at ``real``: where a link
    within the tree leads) carries of itself: a safetensors file's header entry, a torch.save
    file's sidecar beside the file read, or, in a Hugging Face cache snapshot, the sidecar the
    snapshot holds beside its link; None where it has none."""
    if (own := _file_record(kind, real, name)) is None and kind != "safetensors":
        digest = snapshot_sidecar(folder / name, real)
        own = Recorded(folder, {name: digest}, sidecar_name(name)) if digest is not None else None
    return own


def add_record(recorded: Recorded, name: str, own: Recorded) -> None:
    """Adds file ``name``'s own record (:func:`own_record`) to ``recorded``, a folder's."""
    recorded.files |= own.files
    recorded.starts |= own.starts
    recorded.records[name] = own.record
    recorded.problems += own.problems


def links_within(source: Source) -> Path | None:
    """The tree within which a local source folder's files may be links that its reads follow
    (:func:`~parallel_dcp.storage.safe_files.resolve_in_tree`: formats/base.py shard_files opens a
    Hugging Face folder's shards so); None where no link is followed: a DCP directory (its reader
    opens each shard by its own name, a link refused), a single file (its name resolved once, by
    :func:`recorded_checksums`), object storage."""
    location = source.location
    if isinstance(location, Remote) or not location.is_dir() or source.kind == "dcp":
        return None
    return source_tree(location)


def record_beside_link(source: Source) -> str | None:
    """Where a single file named through a symlink has no record of the file it leads to but one
    beside the link's name (a torch.save sidecar; an entry of the ``.parallel_dcp.json`` beside it,
    as an old ``local_dir`` download leaves beside its links into the cache): why that one is not
    used, naming the link, the file and the record; None otherwise."""
    location = source.location
    if isinstance(location, Remote) or location.is_dir():
        return None
    real = _file_read(source)
    links = _links_on_the_way(Path(location))
    sidecar = source.kind != "safetensors" and not os.path.lexists(real.parent / sidecar_name(real.name))
    if sidecar and (beside := _sidecar_beside_link(links, real)) is not None:
        return beside
    for link in links:  # (the record beside a link lists a file of the link's name: not this one, maybe)
        try:
            listed = read_manifest(link.parent, current_only=True, warn_stale=False)
        except (CorruptCheckpointError, OSError):
            listed = None
        if listed is not None and link.name in listed:
            return (
                f"it is a link to {real}; the {MANIFEST_FILE} beside the link ({link.parent}) records a file of its "
                "name, but is not used: it was written for the file that name held then, which need not be this one "
                "(a link repointed since). Compare it with the checkpoint it was made from: verify --against SOURCE"
            )
    return None


def _sidecar_beside_link(links: list[Path], real: Path) -> str | None:
    """A torch.save sidecar beside a link on the way to ``real`` (which has none): why it is not used."""
    # (beside any link on the way: run/latest.pt -> ../ckpt/mid.pt -> ../store/real.pt, the record
    # left beside ckpt/mid.pt when the file was moved to the store and linked back)
    records = ((link, link.parent / sidecar_name(link.name)) for link in links)
    link, beside_link = next(((link, record) for link, record in records if os.path.lexists(record)), (None, None))
    if link is None or beside_link is None:
        return None
    advice = "Compare"
    if snapshot_tree(link, real) is not None and not beside_link.is_symlink():  # (a linked one there is used)
        return (
            f"it is a file of a Hugging Face cache snapshot, a link to {real}; {beside_link} beside it is not "
            "used: it is not one of the snapshot's files (the cache writes each file of a revision as a link into "
            "its blobs/; this one is a plain file, put there since), so it need not be this file's record. Compare "
            "it with the checkpoint it was made from: verify --against SOURCE"
        )
    if real.name == link.name:  # (the record names the file it was written for: only one of that name)
        advice = f"If {real} was moved there and linked back, move the record beside it; otherwise compare"
    return (
        f"it is a link to {real}, which has no {sidecar_name(real.name)} beside it; {beside_link} beside the link "
        "is not used: it was written for the file that name held then, which need not be this one (a link "
        f"repointed since). {advice} it with the checkpoint it was made from: verify --against SOURCE"
    )


def _links_on_the_way(name: Path) -> list[Path]:
    """The symlinks a name passes through to its file, itself first (``run/latest.pt ->
    ../ckpt/mid.pt -> ../store/real.pt``: both); at most 40, the kernel's own bound."""
    links: list[Path] = []
    while name.is_symlink() and len(links) < 40:
        links.append(name)
        name = Path(os.path.normpath(Path(os.path.realpath(name.parent)) / os.readlink(name)))
    return links


def documentation_file(name: str) -> bool:
    """A recorded side file that no conversion or load reads (a model card, .gitattributes, a
    licence): a change to it is reported as a warning, not as damage of the checkpoint (the hub
    edits model cards after an upload: the web UI's "Edit model card", its metadata commits), by
    ``verify`` and by a conversion that copies it (jobs/side_file_checks.py)."""
    base = os.path.basename(name).lower()
    return base.endswith(".md") or base == ".gitattributes" or base.startswith("license")


def shown_as(named: str | os.PathLike[str], read: str | os.PathLike[str]) -> str:
    """How a message names a file read at ``read`` that was ``named`` so (what the user typed, or a
    folder's entry): both, where the name is a link to it, so that the user finds what they typed
    and the file that was found damaged ("run/latest.pt -> /store/model.pt"); else the name alone
    (a plain file, though a folder on its way be a link: ``/data -> /mnt/data``)."""
    named, read = os.fspath(named), os.fspath(read)
    plain = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(named))), os.path.basename(named))
    if os.path.abspath(named) == os.path.abspath(read) or plain == os.path.abspath(read):
        return named
    return f"{named} -> {read}"


def stale_record(source: Source) -> bool:
    """Whether a local checkpoint directory that :func:`recorded_checksums` found no record for
    holds a ``.parallel_dcp.json`` all the same: a stale one (it belongs to another save than its
    ``.metadata``: a save stopped between its commit's two renames), so no file was checked."""
    location = source.location
    return not isinstance(location, Remote) and location.is_dir() and os.path.lexists(location / MANIFEST_FILE)


def no_checksums_problem(source: Source) -> str:
    """What ``verify`` reports for a single file that carries no checksums."""
    name = source.location.name
    if (beside_link := record_beside_link(source)) is not None:
        return f"{name}: no checksums: {beside_link}"
    # (looked for beside the file read: for a link, where it leads, not beside the name typed)
    real = _file_read(source) if not isinstance(source.location, Remote) else Path(name)
    beside = "beside it" if real in (Path(name), Path(os.path.abspath(source.location))) else f"beside {real}"
    where = "in its header" if source.kind == "safetensors" else f"in {sidecar_name(real.name)} {beside}"
    return (
        f"{name}: no checksums (parallel_dcp writes them {where}; a folder's shards', in the "
        f"{MANIFEST_FILE} beside them): a flipped byte cannot be found "
        "without them; compare the file with its source: verify --against SOURCE"
    )
