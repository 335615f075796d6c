"""Verify a checkpoint: checksums from the manifest, every tensor read back, optionally compared.

    files ── manifest sizes + xxh3 checksums, hashed by the pool ─────────────┐
    keys  ── dtypes and shapes compared from headers first; then each tensor  ├─▶ VerifyReport
             read back by the pool (and from --against, compared bit for bit, ┘
             NaNs included), whole or in row ranges, under the memory limit

A tensor whose reads (here and in the reference) do not fit in what one task may use under the
memory limit is compared in row ranges, read from both sides exactly as conversions read them, so
``verify`` works under any limit that ``convert`` works under. Every problem is reported (not only
the first), sorted; a worker that cannot read a key reports it as a problem rather than failing.
Keys are matched by name, and where a torch.save source keeps a mapping key that is not a string
(an optimizer's int index) by that key's type too (jobs/key_types.py).

Longer than 300 lines because checksum checks, header comparison and the chunked, memory-bounded
bit-for-bit comparison form one job.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from parallel_dcp.engine.chunks import MIN_MEMORY_CHUNK_BYTES, Chunk, ChunkUnit, chunk_count, split
from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.engine.partition import Item, Task, partition
from parallel_dcp.engine.pool import WorkerPool
from parallel_dcp.errors import CorruptCheckpointError, UnsafeCheckpointError, dtype_name, plural
from parallel_dcp.formats import open_source
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.dcp_format import DcpSource
from parallel_dcp.formats.validate import empty_mapping
from parallel_dcp.jobs.diff import values_equal
from parallel_dcp.jobs.inspect import side_index
from parallel_dcp.jobs.kept_float32 import keys_kept
from parallel_dcp.jobs.key_types import key_type_changes, why_key_types_matter
from parallel_dcp.jobs.unrecorded import with_own_records
from parallel_dcp.jobs.verify_files import (
    Recorded,
    documentation_file,
    links_within,
    no_checksums_problem,
    recorded_checksums,
    shown_as,
    stale_record,
)
from parallel_dcp.jobs.verify_pass import one_pass_handler, record_problems, records_by_file, size_change
from parallel_dcp.options import Options
from parallel_dcp.storage.direct_read import PIECE_BYTES, direct_read_memory
from parallel_dcp.storage.io_mode import resolve_io
from parallel_dcp.storage.location import CLIENT_MEMORY, Location, Remote, is_url, locate
from parallel_dcp.storage.manifest import MANIFEST_FILE, FileDigest, file_digest
from parallel_dcp.storage.read_choice import ReadChoice, read_choice
from parallel_dcp.storage.safe_files import resolve_in_tree
from parallel_dcp.storage.side_index_use import DAMAGED, UNSAFE, IndexUse

__all__ = ["VerifyReport", "verify"]


@dataclass
class VerifyReport:
    """What ``verify`` checked and every problem it found; ``ok`` when there are none."""

    path: str
    format: str
    files_checked: int = 0
    keys_checked: int = 0
    bytes_checked: int = 0
    manifest: bool = False
    # A DCP directory's record that belongs to another save than its .metadata: not used.
    manifest_stale: bool = False
    against: str | None = None
    problems: list[str] = field(default_factory=list)
    # Set when every problem is a floating dtype that a cast explains (the checkpoint holds the
    # reference cast to this dtype, as ``convert --dtype`` writes it): verify again with it.
    suggested_dtype: str | None = None
    # How the one pass read the shards (io="auto": as measured on their file system); None when
    # it did not run.
    read_choice: ReadChoice | None = None
    # A DCP checkpoint's side index: valid for its .metadata, or why a load(into=) reads .metadata
    # (absent or stale is legitimate: stock DCP writes none and ignores ours); None for other formats.
    side_index: IndexUse | None = None
    # Worth a look, not a failure (``ok`` stays True): a damaged or unsafe side index.
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "ok": self.ok,
            "manifest": self.manifest,
            "manifest_stale": self.manifest_stale,
            "against": self.against,
            "files_checked": self.files_checked,
            "keys_checked": self.keys_checked,
            "bytes_checked": self.bytes_checked,
            "problems": self.problems,
            "suggested_dtype": self.suggested_dtype,
            "read_io": self.read_choice.reads if self.read_choice is not None else None,
            "side_index": self.side_index.as_dict() if self.side_index is not None else None,
            "warnings": self.warnings,
        }


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """None when ``a`` and ``b`` (same dtype and shape) are equal bit for bit, else the flat index
    of the first element that differs."""
    if a.numel() == 0:
        return None
    bits_a = a.contiguous().reshape(-1).view(torch.uint8)
    bits_b = b.contiguous().reshape(-1).view(torch.uint8)
    if torch.equal(bits_a, bits_b):
        return None
    return int((bits_a != bits_b).nonzero()[0, 0]) // a.element_size()


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The reference as a conversion with ``dtype`` writes it (floating tensors only)."""
    if dtype is None or not tensor.dtype.is_floating_point or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


@dataclass(frozen=True, slots=True)
class _Plan:
    """What one verify compares: units (keys, or row ranges of large keys) and the chunks."""

    items: list[Item]
    chunks: dict[str, Chunk]


class _Checker:
    """Reads units of a checkpoint (and of its reference) in a worker and compares them."""

    def __init__(
        self,
        source: Source,
        reference: Source | None,
        dtype: torch.dtype | None,
        chunks: dict[str, Chunk],
        keep: frozenset[str] = frozenset(),
    ):
        self.source = source
        self.reference = reference
        self.dtype = dtype
        self.chunks = chunks
        self.keep = keep  # keys the cast leaves (what transformers keeps in float32)

    def _read(self, side: Source, unit: str) -> torch.Tensor:
        chunk = self.chunks.get(unit)
        return side.read_chunk(chunk) if chunk is not None else side.read([unit])[unit]

    def __call__(self, task: Task) -> list[tuple[str, int, str]]:
        """(key, element, problem) for every unit of ``task`` that differs or cannot be read."""
        problems = []
        for unit in task.keys:  # one unit at a time: memory is the largest unit, not the task
            chunk = self.chunks.get(unit)
            key = chunk.key if chunk is not None else unit
            offset = math.prod(chunk.shape[1:]) * chunk.start if chunk is not None and chunk.dim == 0 else 0
            try:
                mine = self._read(self.source, unit)
                if self.reference is not None:
                    cast = None if key in self.keep else self.dtype
                    first = _first_difference(mine, _cast(self._read(self.reference, unit), cast))
                    if first is not None:
                        where = "" if chunk is None or chunk.dim == 0 else f" of rows {chunk.start}:{chunk.stop}"
                        problems.append(
                            (key, offset + first, f"data differs (first at element {offset + first}{where})")
                        )
            except Exception as exc:
                problems.append((key, offset, f"cannot be read: {type(exc).__name__}: {exc}"))
            finally:
                self.source.release()
                if self.reference is not None:
                    self.reference.release()
        return problems


def _hash_handler(
    directory: Location,
    recorded: dict[str, FileDigest],
    starts: dict[str, int],
    tree: Path | None,
    shown: dict[str, str] | None = None,
) -> Any:
    """Hashes files against their record; ``starts``: files recorded from that byte on (a
    safetensors file's data section, recorded in its own header); ``tree``: a folder's file that is a
    link within it is hashed where it leads, as conversions read it (verify_files.links_within;
    None: none followed), and a problem names both ("NAME -> FILE"); ``shown``: how a problem
    names a file (a single file named through a link: "LINK -> FILE"), else by its name."""

    def run(task: Task) -> list[str]:
        problems = []
        for name in task.keys:
            # A file in a copied folder (1_Pooling/config.json) is opened from the output's
            # realpath one component at a time: a folder swapped for a symlink is refused.
            nested = "/" in name and not isinstance(directory, Remote)
            path = Path(os.path.realpath(directory)) / name if nested else directory / name
            label = (shown or {}).get(name, name)
            if not (path.exists() if isinstance(path, Remote) else os.path.lexists(path)):
                problems.append(f"file {label}: missing")
                continue
            want = recorded[name]
            try:  # a symlink (but one within the tree) or a FIFO in place of a file is named, never read through
                named = path
                if tree is not None and (read := resolve_in_tree(path, tree)) != path:
                    path, label = read, f"{label} -> {read}"  # (a nested one too: 1_Pooling/config.json -> ../store/x)
                linked = nested or path != named  # (a realpath now: a folder on its way swapped since is refused)
                found = file_digest(path, checksum=want.digest is not None, start=starts.get(name, 0), no_links=linked)
            except (CorruptCheckpointError, FileNotFoundError) as exc:  # (a dangling link names itself)
                problems.append(f"file {label}: {exc}")
                continue
            if found.size != want.size and name in starts:
                problems.append(
                    f"file {label}: {found.size} bytes of tensor data, its header records {want.size} "
                    f"({size_change(found.size, want.size)})"
                )
            elif found.size != want.size:
                problems.append(
                    f"file {label}: {found.size} bytes, the manifest records {want.size} "
                    f"({size_change(found.size, want.size)})"
                )
            elif want.digest is not None and found.digest != want.digest:
                problems.append(f"file {label}: checksum {found.digest} != {want.digest} recorded (corrupted)")
        return problems

    return run


def _labelled(problem: str, shown: dict[str, str]) -> str:
    """A record's own problem ("file NAME: ...") naming the file as verify's others do ("LINK -> FILE")."""
    for name, label in shown.items():
        if problem.startswith(f"file {name}: "):
            return f"file {label}: {problem[len(f'file {name}: ') :]}"
    return problem


def _shown_files(source: Source, checksums: Recorded) -> dict[str, str]:
    """How verify's problems name a single local file named through a link: "LINK -> FILE" (its
    record names the file the link leads to; the user typed the link)."""
    if source.location.is_dir() or isinstance(source.location, Remote):
        return {}
    named = os.path.abspath(source.location)
    read = {name: Path(os.fspath(checksums.directory)) / name for name in checksums.files}
    return {name: f"{source.location.name} -> {path}" for name, path in read.items() if shown_as(named, path) != named}


def _run(tasks: list[Task], handler: Any, options: Options, governor: MemoryGovernor, workers: int) -> list[Any]:
    problems: list[Any] = []
    if not tasks:
        return problems
    with WorkerPool(min(workers, len(tasks)), handler, initializer=lambda: torch.set_num_threads(1)) as pool:
        for result in pool.run(tasks, governor=governor, task_timeout=options.task_timeout, retries=options.retries):
            problems.extend(result.value)
    return problems


def _run_pairs(
    tasks: list[Task], handler: Any, options: Options, governor: MemoryGovernor, workers: int
) -> list[tuple[list[str], list[tuple[str, str]]]]:
    """As :func:`_run`, for handlers that return one (files, keys) pair per task."""
    if not tasks:
        return []
    with WorkerPool(min(workers, len(tasks)), handler, initializer=lambda: torch.set_num_threads(1)) as pool:
        return [
            r.value
            for r in pool.run(tasks, governor=governor, task_timeout=options.task_timeout, retries=options.retries)
        ]


def verify(
    path: str | os.PathLike[str],
    against: str | os.PathLike[str] | None,
    options: Options,
    dtype: torch.dtype | None = None,
    *,
    trust_pickle: bool = False,
    deep: bool = True,
    dequantize: bool = False,
    block_size: int | None = None,
) -> VerifyReport:
    """See :func:`parallel_dcp.verify`."""
    if dequantize and against is None:
        raise ValueError("dequantize= dequantizes the reference (against=) before comparing: it needs against")
    if dtype is not None and against is None:
        raise ValueError("dtype= casts the reference (against=) before comparing: it needs against")
    for where in (path, against):
        if where is not None:
            locate(where, options.storage_options)  # a bad URL fails here; its filesystem is loaded
    governor = MemoryGovernor(options.memory_ceiling())
    governor.hold_coordinator()  # (its workers hash and read back under the limit beside it)
    if any(is_url(where) for where in (path, against)):
        governor.worker_extra = CLIENT_MEMORY  # each worker's own connection
    source = open_source(
        path, storage_options=options.storage_options, trust_pickle=trust_pickle, memory_limit=options.memory_ceiling()
    )
    try:
        reference = (
            open_source(
                against,
                storage_options=options.storage_options,
                trust_pickle=trust_pickle,
                memory_limit=options.memory_ceiling(),
            )
            if against is not None
            else None
        )
        if reference is not None and dequantize:  # compared with what convert(dequantize=True) writes
            from parallel_dcp.formats.dequantized_source import block_size_of, dequantized_source
            from parallel_dcp.formats.quantized_pairs import dequantized_dtype_of

            # (as convert does: other tensors are cast only when dtype is given; the weights to the
            # dtype given, else the one the reference's config.json names, else bfloat16)
            target = dequantized_dtype_of(reference, dtype)
            reference = dequantized_source(reference, target, block_size_of(reference, block_size))
        try:
            report = _verify(source, reference, options, governor, dtype, deep=deep or reference is not None)
        finally:
            if reference is not None:
                reference.close()
    finally:
        source.close()
    report.side_index = side_index(source.location, source.kind, options.memory_ceiling())
    if report.side_index is not None and report.side_index.reason in (DAMAGED, UNSAFE):  # a load reads .metadata
        report.warnings.append(f"{report.side_index.state()} (a load reads .metadata instead)")
    return report


def _record_problems(source: Source) -> list[tuple[str, str]]:
    """(key, problem) for each record of a local DCP checkpoint whose head disagrees with
    ``.metadata`` (verify_pass.record_problems); none for any other source, or a shard it cannot
    open (the read-back names that)."""
    if not isinstance(source, DcpSource) or source.metadata is None or not isinstance(source.location, Path):
        return []
    found: list[tuple[str, str]] = []
    for name, stored in (records_by_file(source.metadata) or {}).items():
        with contextlib.suppress(OSError, UnsafeCheckpointError):
            found += record_problems(os.fspath(source.location), name, stored)
    return found


def _header_problem(
    source: Source, reference: Source, key: str, dtype: torch.dtype | None, keep: frozenset[str] = frozenset()
) -> str | None:
    """What differs between ``key`` here and in the reference, from headers alone (None: nothing)."""
    dtype = None if key in keep else dtype
    mine, theirs = key in source.entries, key in reference.entries
    if mine != theirs:
        other = source.values[key] if not mine else reference.values[key]
        return f"one is a tensor, the other a {type(other).__name__}"
    if not mine:
        a, b = source.values[key], reference.values[key]
        return None if values_equal(a, b) else f"value {a!r} != {b!r}"
    entry, ref = source.entries[key], reference.entries[key]
    expected = dtype if dtype is not None and ref.dtype.is_floating_point else ref.dtype
    if entry.dtype != expected:
        return f"dtype {dtype_name(entry.dtype)} != {dtype_name(expected)}" + (
            f" ({dtype_name(ref.dtype)} cast to {dtype_name(dtype)})" if expected != ref.dtype else ""
        )
    if entry.shape != ref.shape:
        return f"shape {entry.shape} != {ref.shape}"
    return None


def _cost(source: Source, reference: Source | None, key: str, chunk: Chunk | None, dtype: torch.dtype | None) -> int:
    """Memory a worker needs to compare ``key`` (or ``chunk`` of it): both reads, and the cast."""
    cost = source.chunk_memory(chunk) if chunk is not None else source.copied_bytes(key)
    if reference is not None:
        entry = reference.entries[key]
        cost += reference.chunk_memory(chunk) if chunk is not None else reference.copied_bytes(key)
        if dtype is not None and entry.dtype.is_floating_point and entry.dtype != dtype:
            elements = math.prod(chunk.sizes if chunk is not None else entry.shape)
            cost += elements * dtype.itemsize
    return cost


def _plan(
    source: Source,
    reference: Source | None,
    keys: list[str],
    dtype: torch.dtype | None,
    room: int,
    governor: MemoryGovernor,
) -> _Plan:
    """Each key whole when its comparison fits in ``room`` bytes, else in row ranges that do
    (each tensor's ranges admitted by the governor before they are built)."""
    items: list[Item] = []
    chunks: dict[str, Chunk] = {}
    for key in keys:
        entry = source.entries[key]
        cost = _cost(source, reference, key, None, dtype)
        threshold = entry.nbytes
        pieces: list[Chunk] = []
        while cost > room and threshold > MIN_MEMORY_CHUNK_BYTES:
            threshold = max(MIN_MEMORY_CHUNK_BYTES, threshold // 2)
            governor.admit_units(key, chunk_count(entry, threshold), entry.nbytes, keep=False)
            pieces = split(entry, threshold)
            if not pieces:
                break
            cost = max(_cost(source, reference, key, c, dtype) for c in pieces)
        if not pieces:
            items.append(Item(key, entry.nbytes, _cost(source, reference, key, None, dtype)))
            continue
        governor.admit_units(key, len(pieces), entry.nbytes)
        for piece in pieces:
            unit = ChunkUnit(piece)  # equal to no key, whatever its name
            chunks[unit] = piece
            items.append(Item(unit, piece.nbytes(entry.dtype.itemsize), _cost(source, reference, key, piece, dtype)))
    return _Plan(items, chunks)


def _verify(
    source: Source,
    reference: Source | None,
    options: Options,
    governor: MemoryGovernor,
    dtype: torch.dtype | None,
    *,
    deep: bool = True,
) -> VerifyReport:
    against = reference.path if reference is not None else None
    report = VerifyReport(path=source.path, format=source.kind, against=against)
    # A Hugging Face output of a conversion with dtype holds what transformers keeps in float32 uncast.
    keep = (
        keys_kept(reference, list(reference.entries), dtype, governor.limit)
        if reference is not None and source.kind != "dcp"
        else frozenset()
    )
    checksums = recorded_checksums(source, warn_stale=False)  # (a stale record: reported below, not warned of)
    unchecked: list[str] = []
    if checksums is not None:  # (files read that the record does not list: checked by their own, or named)
        checksums, unchecked = with_own_records(source, checksums)
    directory = checksums.directory if checksums is not None else None
    recorded = checksums.files if checksums is not None else None
    starts = checksums.starts if checksums is not None else {}
    workers = options.worker_count(max(1, len(source.entries)))
    shown = _shown_files(source, checksums) if checksums is not None else {}
    file_problems = [_labelled(p, shown) for p in checksums.problems] if checksums is not None else []
    if checksums is None and reference is None and not source.location.is_dir():
        file_problems.append(no_checksums_problem(source))
    report.warnings += [  # (a conversion reads them unchecked, with a warning: not damage of what was recorded)
        f"file {name}: not in the manifest and carries no record of its own, so it was not checked (added "
        "after the manifest was written; a conversion reads it, unchecked, with a warning)"
        for name in unchecked
    ]
    # A stale record (a save stopped between its commit's two renames) is no corruption: OK, but
    # said so, not "no manifest" (there is one, unused); its warning says why.
    report.manifest_stale = checksums is None and stale_record(source)
    if report.manifest_stale:
        report.warnings.append(
            f"{source.location / MANIFEST_FILE} belongs to another save than its .metadata (a save was stopped "
            "between its commit and the manifest's rename): it is stale and was not used, so no file was checked "
            "against checksums (compare with its source: verify --against SOURCE)"
        )

    # One pass (verify_pass.py): each shard read once, hashed and its records checked on the way.
    records = (
        records_by_file(source.metadata)
        if recorded is not None and deep and reference is None and isinstance(source, DcpSource)
        and source.metadata is not None and not isinstance(directory, Remote) and not starts
        and not any("/" in name for name in recorded)  # files in folders: hashed one by one, below
        else None
    )  # fmt: skip
    one_pass: list[tuple[str, str]] = []
    if recorded is not None:
        assert directory is not None
        report.manifest = True
        if records is not None:
            resolve_io(options.io, directory, writing=False)  # io="direct" where refused: an error before any read
            assert isinstance(directory, Path)  # one pass: local checkpoints only
            shards = [directory / name for name in recorded]
            report.read_choice = read_choice(options.io, directory, shards, streams=workers)
            io = report.read_choice.io
            held = direct_read_memory() if io != "buffered" else PIECE_BYTES
            sizes = [Item(name, d.size, held) for name, d in recorded.items()]
            handler = one_pass_handler(os.fspath(directory), recorded, records, io)
            tasks = partition(sizes, workers, memory_adds_up=False)
            with governor.during("checking the shard files' checksums and records", "files"):
                for files, bad_keys in _run_pairs(tasks, handler, options, governor, workers):
                    file_problems += files
                    one_pass += bad_keys
        else:
            sizes = [Item(name, d.size, 0) for name, d in recorded.items()]
            tasks = partition(sizes, workers, memory_adds_up=False)
            assert checksums is not None
            handler = _hash_handler(directory, recorded, starts, links_within(source), shown)
            with governor.during("checking the shard files' checksums", "files"):
                hashed = _run(tasks, handler, options, governor, workers)
            documents = [name for name in recorded if documentation_file(name)]
            for problem in hashed:
                if not any(problem.startswith((f"file {n}:", f"file {n} -> ")) for n in documents):
                    file_problems.append(problem)
                    continue
                head, found = problem.split(": ", 1)
                for hint in (" (bytes appended?)", " (truncated?)", " (corrupted)"):
                    found = found.replace(hint, "")
                report.warnings.append(
                    f"{head}: not as recorded ({found}): documentation, which no conversion or load reads (a model "
                    "card edited on the hub after the upload), so the checkpoint is not failed for it"
                )
        report.files_checked = len(recorded)

    keys = list(source.entries) + [k for k in source.values if k not in source.entries]
    key_problems: dict[str, tuple[int, str]] = {}
    for key, found in one_pass:
        key_problems.setdefault(key, (0, found))
    if reference is not None:
        theirs = set(reference.entries) | set(reference.values)
        # (an empty mapping a torch.save file holds and another format drops is no difference)
        for k in keys:
            if k not in theirs and not empty_mapping(source.values.get(k)):
                key_problems[k] = (0, f"not in {against}")
        for k in theirs - set(keys):
            if not empty_mapping(reference.values.get(k)):
                key_problems[k] = (0, f"in {against} but missing here")
        keys = [k for k in keys if k in theirs]
    report.keys_checked = len(keys) if deep else 0  # --no-deep reads no key back
    try:  # damaged shards are found before reading; unsafe values are refused by name
        source.check(keys)
    except CorruptCheckpointError as exc:
        report.problems = sorted(file_problems) + [
            f"{k or repr(k)}: {key_problems[k][1]}" for k in sorted(key_problems)
        ]
        report.problems.append(str(exc))
        return report
    if records is None and deep:  # records not checked on the way: their heads, against .metadata
        for key, found in _record_problems(source):
            key_problems.setdefault(key, (0, found))
    for side in (source, reference):
        if side is not None:
            side.load_values(k for k in keys if k not in side.entries and k in side.values)
    typed: dict[str, tuple[str, str, str]] = {}
    if reference is not None:
        for k in keys:
            if (problem := _header_problem(source, reference, k, dtype, keep)) is not None:
                key_problems[k] = (0, problem)
        typed = key_type_changes(source, reference, keys)  # (same names and bytes, keys of other types)
        for k, (here, there, where) in typed.items():
            said = f"{here} {where} here, {there} in {against}"
            key_problems[k] = (0, f"{key_problems[k][1]}; {said}" if k in key_problems else said)
    tensors = [k for k in keys if k in source.entries and k not in key_problems] if deep else []
    if records is not None:  # read back in the one pass already
        report.bytes_checked = sum(source.entries[k].nbytes for k in tensors)
        tensors = []

    # As many workers as leave each task room for a row range of at least MIN_MEMORY_CHUNK_BYTES.
    while workers > 1 and governor.unit_room(workers) < 3 * MIN_MEMORY_CHUNK_BYTES:
        workers -= 1
    plan = _plan(
        source,
        reference,
        tensors,
        dtype,
        governor.unit_room(workers),
        governor,
    )
    workers = governor.workers_for(((it.key, it.memory) for it in plan.items), workers)
    tasks = partition(plan.items, workers, max_task_memory=governor.task_budget(workers), memory_adds_up=False)
    reading = "comparing keys with the reference" if reference is not None else "reading keys back"
    with governor.during(reading):
        checked = _run(tasks, _Checker(source, reference, dtype, plan.chunks, keep), options, governor, workers)
    for key, element, problem in checked:
        if key not in key_problems or element < key_problems[key][0]:
            key_problems[key] = (element, problem)
    report.bytes_checked += sum(it.nbytes for it in plan.items)
    # (keys exact, as the report's JSON gives them; the command line escapes what it prints)
    report.problems = sorted(file_problems) + [f"{k or repr(k)}: {key_problems[k][1]}" for k in sorted(key_problems)]
    if typed:  # why, once
        kinds = (source.kind, reference.kind if reference is not None else "")
        report.problems.append(f"key types ({plural(len(typed), 'key')} above): {why_key_types_matter(kinds)}")
    if reference is not None and dtype is None and not file_problems:
        report.suggested_dtype = _cast_explains(source, reference, list(key_problems))
    return report


def _cast_explains(source: Source, reference: Source, differing: list[str]) -> str | None:
    """The dtype that explains every difference when each differing key is a floating tensor
    stored as one floating dtype in place of the reference's (same shape): a ``convert --dtype``."""
    found = set()
    for key in differing:
        mine, theirs = source.entries.get(key), reference.entries.get(key)
        if mine is None or theirs is None or mine.shape != theirs.shape or mine.dtype == theirs.dtype:
            return None
        if not (mine.dtype.is_floating_point and theirs.dtype.is_floating_point):
            return None
        found.add(mine.dtype)
    return str(found.pop()).removeprefix("torch.") if len(found) == 1 else None
