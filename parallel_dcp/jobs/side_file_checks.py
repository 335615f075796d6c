"""The files a conversion copies beside the weights, checked against the record of the folder they come from.

    files_to_copy (jobs/copy_files.py): the source folder's side files, or copy_files_from's,
      │   each pinned to a path with no link on its way; the folder they come from (Copies.folder)
      ▼
    coordinator, before any task runs: side_file_records ── the folder's own .parallel_dcp.json
      │   (read by the rule its files are read by: a hub snapshot's is a link into blobs/); each
      │   copied file it lists hashed (file_digest, opened by the one rule, as the commit opens it)
      │     other bytes, config.json, tokenizer files, 1_Pooling/config.json, ...: SourceChecksumError
      │         naming it and both ways out, as a changed recorded index (source_check.changed_file);
      │         nothing written
      │     other bytes, documentation (*.md, .gitattributes, LICENSE*): copied, with a warning
      │     not listed (put there after the record was written): copied unchecked, as before
      ▼
    the commit: read_copies hands the bytes it read for the output to RecordedCopy.check, which
        hashes them against the same record: a file rewritten since the check (same size or not)
        is refused there, and nothing is committed

Documentation follows verify's rule (verify_files.documentation_file): no conversion or load reads
a model card, and the hub edits model cards after an upload, so a changed one is not damage of the
checkpoint; it is copied as it is, and the warning says so. Every other listed file is read by the
client that loads the output (transformers reads config.json and the tokenizer files,
sentence-transformers the module folders'), so other bytes there are refused: copied, the output's
own new record would bless them. Files on object storage are not checked (a source there is not:
source_check.py).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from parallel_dcp.errors import CorruptCheckpointError, SourceChecksumError, SourceNotCheckedWarning
from parallel_dcp.jobs.source_check import changed_file
from parallel_dcp.jobs.verify_files import Recorded, documentation_file, shown_as
from parallel_dcp.storage.location import Location, Remote
from parallel_dcp.storage.manifest import MANIFEST_FILE, FileDigest, Hasher, file_digest, read_manifest
from parallel_dcp.storage.safe_files import source_tree

__all__ = ["RecordedCopy", "side_file_records"]

_DOCUMENTATION = (
    "copied as it is: documentation, which no conversion or load reads (a model card edited on the hub after "
    "the upload); verify of the source reports it as a warning"
)
_AT_THE_COMMIT = (
    "; read so at the commit, after the job had found it as recorded before its tasks ran: it changed while the job ran"
)


@dataclass(frozen=True, slots=True)
class RecordedCopy:
    """A copied file that its folder's record lists: its name there, where it is read (the pinned
    path the commit reads), how a message names it (``shown``: "LINK -> FILE" for a hub snapshot's
    link), the record, and whether it is documentation (other bytes warned of, not refused)."""

    name: str
    read: Path
    shown: str
    recorded: Recorded
    documentation: bool

    def check(self, data: bytes) -> None:
        """At the commit: ``data``, the bytes read for the output, are the ones recorded.

        Raises:
            SourceChecksumError: they are not, and the file is not documentation.

        Warns:
            SourceNotCheckedWarning: they are not, and the file is documentation (copied as read).
        """
        want = self.recorded.files[self.name]
        hasher = Hasher(checksum=want.digest is not None)
        hasher.update(data)
        if (found := hasher.result()) != want:
            self.differs(found, at_the_commit=True)

    def differs(self, found: FileDigest, *, at_the_commit: bool = False) -> None:
        """The file's bytes are ``found``, not the ones recorded: refused (documentation: warned of)."""
        also = _AT_THE_COMMIT if at_the_commit else ""
        if not self.documentation:
            also += ", and nothing was committed" if at_the_commit else ""
            raise SourceChecksumError(changed_file(self.recorded, self.name, self.read, found, self.shown, also))
        message = changed_file(self.recorded, self.name, self.read, found, self.shown, also, advice=_DOCUMENTATION)
        warnings.warn(message, SourceNotCheckedWarning, stacklevel=3)


def side_file_records(
    copies: Mapping[str, Location],
    folder: Location,
    *,
    own_source: bool,
    would_copy: Callable[[str], bool],
) -> dict[str, RecordedCopy]:
    """In the coordinator, before any task runs: each file of ``copies`` (chosen from ``folder``)
    that the folder's own record lists, hashed against it by the rule the commit reads it by;
    returns those, by name, for the commit to check the bytes it reads again (:meth:`RecordedCopy.check`);
    none for a folder on object storage or without a record of its own. A record that cannot be
    read, or a stale one, is warned of, but for the source's own folder (``own_source``), whose
    source check warns of it already. A listed file the copy would take (``would_copy``) that is
    gone from the folder is missing from the output too, whose own record would then bless it.

    Raises:
        SourceChecksumError: a listed file other than documentation has other bytes, or is gone.

    Warns:
        SourceNotCheckedWarning: a listed documentation file has other bytes (copied as it is), or
            is gone; copy_files_from's record cannot be read, or is stale.
    """
    if isinstance(folder, Remote):
        return {}
    recorded = _record_of(folder, own_source)
    if recorded is None:
        return {}
    checked = {}
    for name, path in copies.items():
        want = recorded.files.get(name)
        if want is None or not isinstance(path, Path):
            continue  # (not listed: put there after the record, copied unchecked as before)
        copy = RecordedCopy(name, path, shown_as(folder / name, path), recorded, documentation_file(name))
        found = file_digest(path, checksum=want.digest is not None, no_links=True)  # (a pinned path: no link)
        if found == want:
            checked[name] = copy
        else:
            copy.differs(found)  # (documentation: warned of, copied as the commit reads it)
    for name in recorded.files:
        if name not in copies and would_copy(name) and not os.path.lexists(folder / name):
            _gone(recorded, name, folder)
    return checked


def _gone(recorded: Recorded, name: str, folder: Path) -> None:
    """``name``, which ``recorded`` lists and the copy would take, is not in ``folder``: refused
    (documentation: warned of), as ``verify`` of the folder fails on it ("missing")."""
    where = f"{folder / name}: listed in {recorded.record_of(name)}, but gone from the folder"
    if documentation_file(name):
        warnings.warn(f"{where}; the output has none ({_DOCUMENTATION})", SourceNotCheckedWarning, stacklevel=3)
        return
    raise SourceChecksumError(
        f"{where}: the output would lack it, and its own record would not say so (verify of the source fails on "
        "it). Restore it (a file of a Hugging Face cache: download it again), or, if it was removed on purpose, "
        "convert with --no-source-checks (check_source=False)"
    )


def _record_of(folder: Path, own_source: bool) -> Recorded | None:
    """``folder``'s own ``.parallel_dcp.json`` (a link only within its tree, as its files are read:
    a hub snapshot's), None where it has none, or none that can be used (warned of but for the
    source's own)."""
    try:
        files = read_manifest(folder, current_only=True, tree=source_tree(folder), warn_stale=not own_source)
    except (CorruptCheckpointError, PermissionError) as exc:
        if not own_source:
            warnings.warn(
                f"{folder}: the files copied from it are not checked against its record: {exc}",
                SourceNotCheckedWarning,
                stacklevel=4,
            )
        return None
    return Recorded(folder, files, MANIFEST_FILE) if files is not None else None
