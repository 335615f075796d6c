"""Where a job writes: a DCP directory, a sharded safetensors/torch directory, or a single file.

A target plans the tasks (which keys each worker writes), writes one task in a worker, and
commits in the coordinator through its destination's :class:`~parallel_dcp.storage.staging.Staging`
(DCP: ``.metadata``; sharded: the index JSON; both: then the manifest).

Longer than 300 lines because it holds the three kinds of output (DCP directory, sharded
directory, single file) and what they share; each target is one class of planning, writing and
committing. The job they write is :mod:`parallel_dcp.jobs.job`'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from functools import partial
from operator import itemgetter
from pathlib import Path
from typing import Any

import torch

from parallel_dcp.engine.memory import ITEM_MEMORY_BYTES, LEAN_TASK_MEMORY_BYTES, TASK_MEMORY_BYTES
from parallel_dcp.engine.partition import CapRange, Item, Task, partition
from parallel_dcp.engine.pool import gc_paused
from parallel_dcp.errors import printable
from parallel_dcp.formats import FILE_FORMATS, FORMATS, lean
from parallel_dcp.formats.base import FileFormat, Source, index_json
from parallel_dcp.formats.dcp_format import ChunkSavePlanner
from parallel_dcp.jobs.copy_files import Copies, read_copies
from parallel_dcp.jobs.dcp_commit import metadata_files, outgoing_part
from parallel_dcp.jobs.dcp_entries import remaining_entries
from parallel_dcp.jobs.file_writes import write_local, write_remote
from parallel_dcp.jobs.job import Job
from parallel_dcp.options import DEFAULT_SHARD_SIZE, Options
from parallel_dcp.partial import partial_save
from parallel_dcp.storage.compression import Compression
from parallel_dcp.storage.direct_write import direct_write_memory
from parallel_dcp.storage.io_mode import resolve_io, uses_direct
from parallel_dcp.storage.location import Remote, locate, upload_memory
from parallel_dcp.storage.manifest import FileDigest, Hasher, manifest_bytes, sidecar_name
from parallel_dcp.storage.ownership import DCP_LAYOUT, MANIFEST_FILE, METADATA_FILE, sharded_layout, temp_name
from parallel_dcp.storage.protocol import Staging, WriteLocation
from parallel_dcp.storage.resume import IdentityCheck
from parallel_dcp.storage.side_index import INDEX_FILE
from parallel_dcp.storage.staging import check_directory, check_file, stage_directory, stage_file
from parallel_dcp.storage.writers import ShardWriter

AnyStaging = Staging  # kept for callers that imported the old union

__all__ = [
    "CARRIED_METADATA_MAX_BYTES",
    "DcpTarget",
    "FileTarget",
    "Job",
    "ShardedTarget",
    "Target",
    "carried_metadata",
    "prepare_io",
    "target_for",
    "task_file_names",
    "warn_metadata_left_out",
]  # (Job: jobs/job.py)


class Target(ABC):
    """An output: ``kind`` is its format's name; ``tensors_only`` when the format holds tensors
    only; ``splits_tensors`` when one tensor may be written as several chunks (DCP);
    ``holds_empty`` when it keeps an empty mapping as a value (torch.save; see
    formats/validate.empty_mapping); ``keeps_nesting`` when it writes the source's nesting, keys
    that are not strings included (one torch.save file; see formats/key_paths.py)."""

    kind: str
    path: Path | Remote
    tensors_only = False
    dtypes: frozenset[torch.dtype] | None = None  # the tensor dtypes its format holds (None: all)
    reserved_keys: frozenset[str] = frozenset()  # names its format keeps for itself
    splits_tensors = False
    holds_empty = False
    keeps_nesting = False
    merge_seconds: float = 0.0  # of the last commit: joining the tasks' results (SaveResult.phases)
    plans: Any = None  # a Saver's memo of its last layout (jobs/plan_reuse.py: PlanReuse)
    # The destination's resolved I/O mode (see prepare_io); ``direct_capable``: this kind of output
    # writes its files through storage.direct_write when the mode says so.
    io: str = "buffered"
    direct_capable = False

    def check_holds(self, job: Job) -> None:
        """Refuse, before anything is written, keys the format reserves (safetensors'
        ``__metadata__``: a tensor of that name replaced the header's metadata, and no reader could
        open the file) and tensors whose output dtype it cannot hold."""
        reserved = [k for k in job.keys if k in self.reserved_keys]
        if reserved:
            raise ValueError(
                f"{self.kind} reserves the key {printable(reserved[0])} for its own header; "
                "rename it (rename=, --rename) or leave it out (keys=, --keys)"
            )
        if self.dtypes is None:
            return
        entries = job.source.entries
        found: dict[torch.dtype, list[str]] = {}
        for key in job.keys:
            if key in entries and (out := job.out_dtype(entries[key].dtype, key)) not in self.dtypes:
                found.setdefault(out, []).append(key)
        if found:
            said = "; ".join(
                f"{str(dt).removeprefix('torch.')} ({', '.join(printable(k) for k in keys[:3])}"
                f"{f' and {len(keys) - 3} more' if len(keys) > 3 else ''})"
                for dt, keys in found.items()
            )
            raise ValueError(
                f"{self.kind} cannot hold these dtypes: {said}; leave those keys out with keys= (--keys), "
                "cast floating ones with dtype= (--dtype), or write DCP or torch.save"
            )

    def uses_direct(self, nbytes: int) -> bool:
        """Whether a file of about ``nbytes`` this target writes goes through O_DIRECT."""
        return self.direct_capable and not isinstance(self.path, Remote) and uses_direct(self.io, nbytes)

    @abstractmethod
    def stage(self, overwrite: bool, protect: list[str] | None = None, resume: IdentityCheck | None = None) -> Staging:
        """Check the destination and take hold of it (before any write); ``protect``: the source's
        files, which the job must never replace or delete; ``resume``: continue the dead conversion
        whose job record it accepts (:mod:`parallel_dcp.jobs.resume`)."""

    @abstractmethod
    def check_destination(self) -> None:
        """What :meth:`stage` refuses of the destination before writing, checked without taking
        hold of it and writing nothing (a dry run's check)."""

    def output_names(self, tasks: list[Task]) -> list[str]:
        """The fixed file names the tasks write (none for DCP, whose names carry the save id)."""
        return []

    def io_memory(self, nbytes: int) -> int:
        """Memory one task's output stream holds for a file of ``nbytes``: upload buffers on
        object storage, the aligned buffers of a direct write, nothing for a buffered local file."""
        if isinstance(self.path, Remote):
            return upload_memory(nbytes)
        return direct_write_memory(nbytes) if self.uses_direct(nbytes) else 0

    @abstractmethod
    def plan(self, job: Job, workers: int, budget: int) -> list[Task]:
        """Disjoint tasks covering ``job.keys``, each needing at most ``budget`` bytes of memory
        where its items allow."""

    @abstractmethod
    def write(self, job: Job, task: Task, data: dict[str, Any], staging: WriteLocation, options: Options) -> Any:
        """In a worker: write one task at ``staging``; the result goes back to the coordinator."""

    def outgoing(self, job: Job, result: Any) -> Any:
        """In the worker, after :meth:`write` (and the task's done record): what is sent back."""
        return result

    @abstractmethod
    def commit(self, job: Job, tasks: list[Task], results: list[Any], staging: AnyStaging, options: Options) -> int:
        """In the coordinator, after every task: finish the output; returns the number of files it
        consists of (what ``inspect`` lists: shards and ``.metadata`` or the index; not the manifest)."""


def prepare_io(target: Target, options: Options, *, probe: bool = True) -> Options:
    """Resolve ``options.io`` for ``target``'s destination (probing O_DIRECT there once, unless
    not ``probe``: a dry run writes nothing) and note it on the target; the options with the
    resolved mode.

    Raises:
        InvalidDestinationError: ``io="direct"`` where the destination cannot take O_DIRECT.
    """
    target.io = resolve_io(options.io, target.path, writing=True, probe=probe)
    return dataclasses.replace(options, io=target.io)


_new_tuple = tuple.__new__


_FILE_BYTES_PER_ITEM = 512  # a safetensors header entry, a zip record's headers: hundreds of bytes


def file_bytes(nbytes: int, items: int) -> int:
    """The most a file of ``items`` items of ``nbytes`` comes to (the direct-write buffers it fills)."""
    return nbytes + _FILE_BYTES_PER_ITEM * items


def _items(job: Job) -> list[Item]:
    sizes = job.sizes()
    if type(job.source).transient_bytes is Source.transient_bytes:  # reads through no buffer: all 0
        # The tuples made directly (Item's generated __new__ is a Python call per key).
        return [_new_tuple(Item, (key, nbytes, memory, 0)) for key, (nbytes, memory) in sizes.items()]
    transient = job.transient
    return [Item(key, nbytes, memory, transient(key)) for key, (nbytes, memory) in sizes.items()]


def _whole_file_memory(items: list[Item]) -> int:
    """What a task writing ``items`` as one file holds: each item's bytes or its read, whichever
    is larger, and the largest read buffer (freed before the next read)."""
    held = sum(max(it.nbytes, it.memory - it.transient) + ITEM_MEMORY_BYTES for it in items)
    return held + max((it.transient for it in items), default=0)


def _where(path: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> Path | Remote:
    found = locate(path, storage_options)
    # Normalised as the staging normalises it (os.path.abspath): results name the file it writes,
    # ``a/copy.safetensors`` rather than ``a/model/../copy.safetensors``.
    return found if isinstance(found, Remote) else Path(os.path.abspath(found))


def _digest_of(data: bytes, options: Options) -> FileDigest:
    hasher = Hasher(checksum=options.checksums)
    hasher.update(data)
    return hasher.result()


class DcpTarget(Target):
    """A stock DCP checkpoint directory: one ``__<task>_0.distcp`` per task, then ``.metadata``."""

    kind = "dcp"
    splits_tensors = True
    direct_capable = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        *,
        compression: Compression | None = None,
    ) -> None:
        self.path = _where(path, storage_options)
        self.compression = compression

    def stage(self, overwrite: bool, protect: list[str] | None = None, resume: IdentityCheck | None = None) -> Staging:
        return stage_directory(self.path, overwrite=overwrite, layout=DCP_LAYOUT, protect=protect or [], resume=resume)

    def check_destination(self) -> None:
        check_directory(self.path, layout=DCP_LAYOUT)

    def io_memory(self, nbytes: int) -> int:
        """The output stream's buffers, and the compressor's (one record at a time per task)."""
        compressor = self.compression.memory() if self.compression is not None else 0
        return super().io_memory(nbytes) + compressor

    def plan(self, job: Job, workers: int, budget: int) -> list[Task]:
        plain = job.source.plain_tensors()
        if self.plans is not None:  # a Saver's: the partition of a layout it planned before, kept
            decision = (self.io, str(self.compression), type(self.path), plain)
            kept: list[Task] = self.plans.tasks(
                job, workers, budget, _items, self._room, partial(self._plan, plain), decision
            )
            return kept
        return self._plan(plain, _items(job), workers, budget)

    def _room(self, nbytes: int, budget: int) -> int:  # items of nbytes, one file per task: one stream
        return max(1, budget - self.io_memory(nbytes))

    def _plan(
        self, plain: bool, items: list[Item], workers: int, budget: int, caps: CapRange | None = None
    ) -> list[Task]:
        cap = self._room(sum(map(itemgetter(1), items)), budget)
        tasks = partition(items, workers, max_task_memory=cap, caps=caps)
        # A task on the lean path (plain tensors) holds no DCP planner: a smaller fixed cost. It was
        # measured for local files; an upload to object storage keeps the full figure.
        local = not isinstance(self.path, Remote)
        saved = TASK_MEMORY_BYTES - LEAN_TASK_MEMORY_BYTES if local and plain else 0
        return [
            dataclasses.replace(t, memory=t.memory - saved + self.io_memory(file_bytes(t.nbytes, len(t.keys))))
            for t in tasks
        ]

    def write(self, job: Job, task: Task, data: dict[str, Any], staging: WriteLocation, options: Options) -> Any:
        writer = ShardWriter(
            staging.root,
            sync_files=options.sync_files,
            checksums=options.checksums,
            expected_bytes=task.nbytes,
            compression=self.compression,
            direct=self.uses_direct(task.nbytes),
        )
        whole = {unit: value for unit, value in data.items() if unit not in job.chunks}
        chunks = [(job.chunks[u], v) for u, v in data.items() if u in job.chunks]
        try:
            if lean.lean_eligible(data.values()):
                # (a DCP source's values unpickle weights-only and its tensors are plain: always here)
                stated = job.source.stated_properties()
                return lean.write_part(writer, whole, chunks, task.index, staging.save_id, stated)
            planner = ChunkSavePlanner(chunks)
            metadata, writes = partial_save(whole, writer, planner, part_idx=task.index, file_tag=staging.save_id)
        except BaseException as exc:
            original = writer.original_error()
            if original is not None:  # say what the file system said, not "unexpected pos ..."
                where = staging.root / original.filename if isinstance(original.filename, str) else staging.root
                raise OSError(original.errno, f"{original.strerror} writing {where}") from exc
            raise
        return metadata, writes, writer.digests()

    def outgoing(self, job: Job, result: Any) -> Any:
        # The worker pickles its keys' .metadata entries: the coordinator only splices them.
        return outgoing_part(job.source.mapping, job.positions, result)

    def commit(self, job: Job, tasks: list[Task], results: list[Any], staging: AnyStaging, options: Options) -> int:
        digests: dict[str, FileDigest] = {}
        for result in results:
            digests.update(result.digests if isinstance(result, lean.LeanPart) else result[2])
        with gc_paused():  # thousands of small objects where tasks went through DCP's planner
            began = time.perf_counter()
            # The workers pickled their whole keys' entries; what is left is built here. Each
            # piece goes where its first unit is in the job, so .metadata keeps the job's order.
            runs = [run for r in results if isinstance(r, lean.LeanPart) for run in r.runs]
            remaining = remaining_entries(job, results)
            runs += remaining
            runs.sort(key=lambda run: run[0])
            self.merge_seconds = time.perf_counter() - began
            files = metadata_files(
                self.path, results, runs, staging.save_id, checksum=options.checksums, indexed=not remaining
            )
        digests[METADATA_FILE] = files.digest
        manifest = manifest_bytes(digests, job.source.fingerprint(), save_id=staging.save_id)
        # .metadata is the commit; the manifest follows it (see storage.staging: a stale manifest
        # is recognised by its save id); the side index is renamed in before .metadata. The
        # .metadata pieces are written as they are, never joined (jobs/dcp_commit.py).
        extras = {MANIFEST_FILE: manifest} | ({INDEX_FILE: files.index} if files.index is not None else {})
        staging.commit(marker=(METADATA_FILE, files.pieces), extras=extras)
        return len(digests)  # the shards and .metadata, as inspect lists them


class ShardedTarget(Target):
    """A Hugging Face style directory: shards of at most ``shard_size`` bytes plus the index JSON.

    One task writes one shard, holding all of its tensors at once, so a shard is also kept under
    the memory each worker may use (``memory_limit / workers``).
    """

    direct_capable = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        kind: str,
        shard_size: int = DEFAULT_SHARD_SIZE,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.path = _where(path, storage_options)
        self.format = FILE_FORMATS[kind]
        self.kind = kind
        self.tensors_only = self.format.tensors_only
        self.dtypes = self.format.dtypes
        self.reserved_keys = self.format.reserved_keys
        self.holds_empty = kind == "torch"
        self.shard_size = shard_size
        self._index_name = self.format.index_name
        self._shard_names = self.format.shard_names
        single = self.format.shard_names(1)[0]
        self._count = 1
        self._layout = sharded_layout(kind, self._index_name, single, self.format.suffixes)
        # Files copied beside the shards (config.json, tokenizer files): name -> where to read it;
        # set by the conversion before it runs (see parallel_dcp.jobs.copy_files).
        self.copies = Copies()
        # A quantized output always has its index (stock's quantized reader pairs weights and
        # scales through it), and may carry files besides the shards (config.json).
        self.always_index = False
        self.extra_files: dict[str, bytes] = {}

    def stage(self, overwrite: bool, protect: list[str] | None = None, resume: IdentityCheck | None = None) -> Staging:
        return stage_directory(
            self.path, overwrite=overwrite, layout=self._layout, protect=protect or [], resume=resume
        )

    def check_destination(self) -> None:
        check_directory(self.path, layout=self._layout)

    def output_names(self, tasks: list[Task]) -> list[str]:
        return [*self._shard_names(len(tasks)), self._index_name, *self.copies, MANIFEST_FILE]

    def plan(self, job: Job, workers: int, budget: int) -> list[Task]:
        """Shards filled up to ``shard_size`` bytes in the source's key order, as Hugging Face's own
        sharding does (a tensor larger than that gets a shard of its own); a shard also ends early
        when the memory its worker needs to hold it would go over ``budget``."""
        room = max(1, budget - TASK_MEMORY_BYTES)
        shards: list[list[Item]] = [[]]
        size = memory = 0
        for item in _items(job):  # the source's order, as save_pretrained keeps it
            need = max(item.nbytes, item.memory) + ITEM_MEMORY_BYTES
            # the output stream's buffers for the shard with this item in it (its file's size)
            io = self.io_memory(file_bytes(size + item.nbytes, len(shards[-1]) + 1))
            if shards[-1] and (size + item.nbytes > self.shard_size or memory + need + io > room):
                shards.append([])
                size = memory = 0
            shards[-1].append(item)
            size += item.nbytes
            memory += need
        tasks = [
            Task(
                index=i,
                keys=tuple(it.key for it in shard),
                nbytes=sum(it.nbytes for it in shard),
                # (the buffers its own file fills: one tensor over shard_size gets a shard of its own)
                memory=TASK_MEMORY_BYTES
                + self.io_memory(file_bytes(sum(it.nbytes for it in shard), len(shard)))
                + _whole_file_memory(shard),
            )
            for i, shard in enumerate(shards)
            if shard
        ]
        self._count = len(tasks)  # workers are forked after planning: they name shards from it
        return tasks

    def write(self, job: Job, task: Task, data: dict[str, Any], staging: WriteLocation, options: Options) -> Any:
        name = self._shard_names(self._count)[task.index]
        where = staging.file(name)  # a hidden temporary name until the commit renames it (local)
        file_format = _carrying(self.format, job.source)
        if isinstance(where, Remote):
            return {name: write_remote(where, file_format, data, task.nbytes, options)}
        return {name: write_local(where, data, None, options, file_format, direct=self.uses_direct(task.nbytes))}

    def commit(self, job: Job, tasks: list[Task], results: list[Any], staging: AnyStaging, options: Options) -> int:
        digests: dict[str, FileDigest] = {}
        for result in results:
            digests.update(result)
        index = b""
        if len(tasks) > 1 or self.always_index:
            names = self._shard_names(len(tasks))
            weight_map = {key: names[task.index] for task in tasks for key in task.keys}
            index = index_json(weight_map, sum(job.out_bytes(k) for k in job.keys)).encode()
        if index:
            digests[self._index_name] = _digest_of(index, options)
        shards = sorted(digests.keys() - {self._index_name})
        # Files the conversion made (a quantized config.json) win over the source's copies.
        copied = read_copies(self.copies) | self.extra_files
        # Files in copied folders (1_Pooling/config.json) are recorded apart from the plain names.
        digests.update((name, _digest_of(data, options)) for name, data in copied.items() if "/" not in name)
        folders = {name: _digest_of(data, options) for name, data in copied.items() if "/" in name}
        manifest = manifest_bytes(digests, job.source.fingerprint(), staging.save_id, folders)
        # Shards are renamed into place, then the index (the commit), then the copied files and
        # the manifest. Shard names are fixed: between the first rename and the index's, new
        # shards sit beside the old index (the documented window of an overwrite).
        staging.commit(
            staged=shards,
            marker=(self._index_name, index) if index else None,
            extras={**copied, MANIFEST_FILE: manifest},
        )
        return len(tasks) + bool(index)  # the shards and the index, as inspect lists them


class FileTarget(Target):
    """One file written by one worker (``torch.save`` or ``save_file`` need the whole dict at once)."""

    direct_capable = True

    def __init__(self, path: str | os.PathLike[str], kind: str, storage_options: dict[str, Any] | None = None) -> None:
        self.path = _where(path, storage_options)
        self.format = FILE_FORMATS[kind]
        self.kind = kind
        self.tensors_only = self.format.tensors_only
        self.dtypes = self.format.dtypes
        self.reserved_keys = self.format.reserved_keys
        self.holds_empty = kind == "torch"
        self.keeps_nesting = kind == "torch"

    @property
    def sidecar(self) -> str | None:
        """The sidecar manifest's name, for a format whose file cannot hold its own checksums."""
        return sidecar_name(self.path.name) if self.format.write_verifiable is None else None

    def stage(self, overwrite: bool, protect: list[str] | None = None, resume: IdentityCheck | None = None) -> Staging:
        companions = [self.sidecar] if self.sidecar is not None else []
        return stage_file(self.path, overwrite=overwrite, protect=protect or [], resume=resume, companions=companions)

    def check_destination(self) -> None:
        check_file(self.path)

    def plan(self, job: Job, workers: int, budget: int) -> list[Task]:
        items = _items(job)
        nbytes = sum(it.nbytes for it in items)
        memory = TASK_MEMORY_BYTES + _whole_file_memory(items) + self.io_memory(file_bytes(nbytes, len(items)))
        return [Task(index=0, keys=job.keys, nbytes=nbytes, memory=memory)]

    def write(self, job: Job, task: Task, data: dict[str, Any], staging: WriteLocation, options: Options) -> Any:
        # A format that keeps nesting (torch.save) writes the source's; flat ones ignore it.
        mapping = {key: job.source.mapping.get(key, (key,)) for key in task.keys}
        where = staging.file(self.path.name)  # beside the destination, under a hidden name (local)
        writer = self.format.write
        if self.format.write_verifiable is not None:  # the file carries its own checksums
            writer = partial(self.format.write_verifiable, checksums=options.checksums)
            options = dataclasses.replace(options, checksums=False)  # no sidecar: count, do not hash again
        file_format = _carrying(dataclasses.replace(self.format, write=writer), job.source)
        if isinstance(where, Remote):
            return write_remote(where, file_format, data, task.nbytes, options, mapping)
        return write_local(where, data, mapping, options, file_format, direct=self.uses_direct(task.nbytes))

    def commit(self, job: Job, tasks: list[Task], results: list[Any], staging: AnyStaging, options: Options) -> int:
        # A format that cannot hold its checksums gets its manifest beside it, renamed into place
        # right after the file (as a directory's manifest follows its marker).
        extras = {}
        if self.sidecar is not None and results:
            extras[self.sidecar] = manifest_bytes(
                {self.path.name: results[0]}, job.source.fingerprint(), staging.save_id
            )
        staging.commit(staged=[self.path.name], extras=extras)  # one atomic rename (local); the upload (remote)
        return 1


def _carrying(file_format: FileFormat, source: Source) -> FileFormat:
    """``file_format`` writing ``source``'s own header metadata into each file, where the format
    holds such metadata and the source has some (safetensors' ``__metadata__``, from a safetensors
    source: ``format`` and parallel_dcp's checksums are written over it, never taken from it)."""
    carried = carried_metadata(source)
    if not file_format.carries_metadata or not carried:
        return file_format
    write: Callable[..., None] = file_format.write  # (such a format's writer takes metadata=)
    return dataclasses.replace(file_format, write=partial(write, metadata=carried))


def carried_metadata(source: Source) -> dict[str, str]:
    """The source's header metadata an output carries on: none where it is larger than
    :data:`CARRIED_METADATA_MAX_BYTES` (:func:`warn_metadata_left_out` says so before planning)."""
    metadata = source.header_metadata
    return metadata if metadata and _json_size(metadata) <= CARRIED_METADATA_MAX_BYTES else {}


def warn_metadata_left_out(target: Target, source: Source) -> None:
    """In the caller, before anything is written: a source's header metadata too large to carry
    into ``target``'s files (its header must stay readable) is left out, with a warning."""
    file_format = getattr(target, "format", None)
    if file_format is None or not file_format.carries_metadata or not source.header_metadata:
        return
    size = _json_size(source.header_metadata)
    if size > CARRIED_METADATA_MAX_BYTES:
        warnings.warn(
            f"{source.path}: its safetensors __metadata__ ({size:,} bytes) is not carried into the output: "
            f"more than {CARRIED_METADATA_MAX_BYTES:,} bytes of it could push the output's header past the "
            "100,000,000 bytes the safetensors library reads",
            stacklevel=3,
        )


def _json_size(metadata: dict[str, str]) -> int:
    return len(json.dumps(metadata, separators=(",", ":")).encode())


# The most of a source's safetensors ``__metadata__`` a conversion carries on (model cards and
# training notes are kilobytes; the whole header, tensor index included, must stay under the
# library's 100,000,000 bytes).
CARRIED_METADATA_MAX_BYTES = 1024 * 1024


def target_for(
    path: str | os.PathLike[str],
    to: str | None,
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    storage_options: dict[str, Any] | None = None,
    compression: Compression | None = None,
) -> Target:
    """The target a destination path and ``to`` name (``compression``: DCP outputs only).

    ``to=None`` goes by the path: ``*.safetensors`` is one safetensors file, ``*.pt``/``*.pth``/
    ``*.bin`` one torch.save file, anything else a DCP directory. With ``to="safetensors"`` or
    ``"torch"``, a path without those suffixes is a sharded directory.

    Raises:
        ValueError: an unknown ``to``, a suffix that contradicts it, or compression for an output
            that is not DCP.
    """
    name = os.fspath(path)
    by_suffix = next((kind for kind, f in FILE_FORMATS.items() if name.endswith(f.suffixes)), None)
    if to is None:
        to = by_suffix or "dcp"
    if to not in FORMATS:
        raise ValueError(f"unknown output format {to!r}: use {', '.join(FORMATS)}")
    if by_suffix is not None and by_suffix != to:
        raise ValueError(f"{name} names a {by_suffix} file but the output format is {to}")
    if compression is not None and to != "dcp":
        raise ValueError(f"compression applies to DCP outputs only; {name} is a {to} output")
    if to == "dcp":
        return DcpTarget(path, storage_options, compression=compression)
    if by_suffix is not None:
        return FileTarget(path, to, storage_options)
    return ShardedTarget(path, to, shard_size, storage_options)


def task_file_names(target: Target, task: Task, save_id: str) -> dict[str, str]:
    """The files task ``task`` writes: name on disk -> name in its result (a resume's records,
    a retried task's clean-up)."""
    if isinstance(target, DcpTarget):
        name = lean.file_name(task.index, save_id)
        return {name: name}
    if isinstance(target, ShardedTarget):
        name = target._shard_names(target._count)[task.index]
        return {temp_name(name, save_id): name}
    assert isinstance(target, FileTarget) and isinstance(target.path, Path)
    return {temp_name(target.path.name, save_id): target.path.name}
