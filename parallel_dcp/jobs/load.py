"""The load pipeline: read any subset of a checkpoint into new tensors or into the caller's.

.metadata ── allow-list unpickler (never plain pickle) ── shard names checked ── select keys
  │ into=: the caller's tensors, checked key by key (dtype and shape, never cast)
  │ else:  torch.empty per key (pages are faulted in by the reading threads, in parallel)
  ▼
fast_read.read_requests: threads preadv each record's bytes straight into its tensor;
  records that do not fit (compressed, odd layout) and pickled values go through DCP's reader
  ▼
unflatten with planner_data → the original nesting (or the caller's dict, filled in place)

With ``retries`` or ``task_timeout`` (and no ``into``), the job needs killable workers instead:

.metadata ── select keys
  │ allocate every selected tensor in one anonymous shared mapping (before the fork)
  ▼
partition by bytes ── WorkerPool (fork)
  │ worker: partial_load(extract_metadata(its keys)) straight into the shared tensors
  │ (non-tensor values are read before the fork, unpickled with weights_only=True)
  ▼
unflatten with planner_data → the original nesting

What is read into what (the checks of ``into``, the requests, the small records' entries) is
planned in jobs/load_plan.py.

Longer than 300 lines because the fast threaded path and the process path share one set of checks
(keys, targets, memory) and one result.
"""

from __future__ import annotations

import contextlib
import io
import math
import mmap
import os
from collections.abc import Container, Iterable
from itertools import chain, compress, islice, repeat
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from parallel_dcp import _compat
from parallel_dcp.engine import progress
from parallel_dcp.engine.chunks import lazy_bits
from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.engine.partition import Item, Task, partition
from parallel_dcp.engine.pool import WorkerPool, gc_paused
from parallel_dcp.errors import (
    InvalidStateDictError,
    KeyNotFoundError,
    describe_keys,
)
from parallel_dcp.formats import fast_read, seated, small_reads
from parallel_dcp.formats.aliased_targets import AliasedTargets, aliased_later
from parallel_dcp.formats.compressed_read import bounded_reader
from parallel_dcp.formats.dcp_format import read_keys
from parallel_dcp.formats.fast_read import ReadStats
from parallel_dcp.formats.validate import flatten_structure
from parallel_dcp.jobs.key_patterns import select
from parallel_dcp.jobs.load_plan import (
    check_into_target,
    check_target,
    plan_requests,
    shard_ends,
    shard_files,
    small_records,
    small_targets,
)
from parallel_dcp.options import Options, usable_cores
from parallel_dcp.partial import extract_metadata, partial_load
from parallel_dcp.storage.direct_read import direct_read_memory
from parallel_dcp.storage.io_mode import resolve_io
from parallel_dcp.storage.location import CLIENT_MEMORY, Location, Remote, locate, resolved_once
from parallel_dcp.storage.metadata import (
    SafeLoadPlanner,
    check_shard_sizes,
    check_shards,
    read_index_or_metadata_use,
    read_metadata_columns,
    reading,
    unpickle_value,
)
from parallel_dcp.storage.prefetch import INTO_SHARE, Prefetch, plan_prefetch
from parallel_dcp.storage.read_choice import ReadChoice, known_read_choice, read_choice
from parallel_dcp.storage.side_index_read import SideIndex
from parallel_dcp.storage.side_index_use import NOT_ASKED, IndexUse

__all__ = ["check_target", "load"]

_ALIGN = 64
_NBYTES = attrgetter("nbytes")


def _nbytes(meta: TensorStorageMetadata) -> int:
    return math.prod(meta.size) * meta.properties.dtype.itemsize


def _shared_tensors(metas: dict[str, TensorStorageMetadata]) -> dict[str, torch.Tensor]:
    """Empty tensors that live in one MAP_SHARED anonymous mapping, so forked workers fill them."""
    offsets: dict[str, int] = {}
    total = 0
    for key, meta in metas.items():
        offsets[key] = total
        total += -(-_nbytes(meta) // _ALIGN) * _ALIGN
    tensors: dict[str, torch.Tensor] = {}
    if total == 0:
        return {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype) for key, meta in metas.items()}
    buffer = mmap.mmap(-1, total, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    for key, meta in metas.items():
        nbytes = _nbytes(meta)
        if nbytes == 0:
            tensors[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            continue
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offsets[key])
        tensors[key] = raw.view(meta.properties.dtype).view(tuple(meta.size))
    return tensors


def _load_handler(
    path: Location, metadata: Metadata, targets: dict[str, torch.Tensor | None], trust_pickle: bool
) -> Any:
    def run(task: Task) -> dict[str, Any]:
        # No flattening of any kind: tensors are filled in place, in shared memory.
        planner = SafeLoadPlanner(
            flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True, trust_pickle=trust_pickle
        )
        keys = [key for key in task.keys if targets[key] is not None]  # values were read before the fork
        part = {key: targets[key] for key in keys}
        with reading(path, keys):
            partial_load(extract_metadata(keys, metadata), bounded_reader(path), planner, state_dict=part)
        progress.report(task.nbytes)
        progress.flush()
        return {}

    return run


def load(
    path: str | os.PathLike[str],
    keys: str | Iterable[str] | None,
    options: Options,
    *,
    into: dict[str, Any] | None = None,
    trust_pickle: bool = False,
    stats: ReadStats | None = None,
) -> dict[str, Any]:
    """Run the load pipeline above; see :func:`parallel_dcp.load` for the contract."""
    # Building per-key objects (metadata, read items) for 50,000 keys otherwise triggers collections
    # that walk the caller's whole heap, several seconds.
    with gc_paused(), contextlib.ExitStack() as cleanup:
        try:
            return _load(path, keys, options, into, trust_pickle, stats, cleanup)
        except AliasedTargets as aliased:  # planned, nothing read: the keys whose targets overlap go last
            split = aliased
    assert into is not None
    later = set(split.later)
    load(path, [k for k in split.chosen if k not in later], options, into=into, trust_pickle=trust_pickle, stats=stats)
    for key in split.later:  # one at a time, in the template's order: the last one's bytes stay
        load(path, [key], options, into=into, trust_pickle=trust_pickle, stats=stats)
    return into


def _load(
    path: str | os.PathLike[str],
    keys: str | Iterable[str] | None,
    options: Options,
    into: dict[str, Any] | None,
    trust_pickle: bool,
    stats: ReadStats | None,
    cleanup: contextlib.ExitStack,
) -> dict[str, Any]:
    _compat.check_torch()
    location = resolved_once(locate(path, options.storage_options))  # (a linked folder: one checkpoint)
    # the shards read into the page cache while .metadata is parsed, where that helps (storage/prefetch.py)
    all_keys_here = keys is None and not (options.retries or options.task_timeout is not None)
    scatters = small_reads.scatters(location)  # small records read buffered whatever io says
    plan = plan_prefetch(location, options.io, whole=all_keys_here, allocates=into is None, small_buffered=scatters)
    fetch = cleanup.enter_context(Prefetch(location, plan))
    flattened: list[tuple[dict[str, Any], dict[str, tuple[Any, ...]]]] = []
    if plan.files and into is not None:  # an into of a few of the keys: the shards no longer asked for
        fetch.wanted(_into_bytes(into, flattened, INTO_SHARE * plan.nbytes))
    index: SideIndex | None = None
    metadata: Metadata | None
    if into is not None and not (options.retries or options.task_timeout is not None):
        # our writers' columnar side index where it matches .metadata byte for byte (no unpickling)
        metadata, columns, index, use = read_index_or_metadata_use(location, memory_limit=options.memory_ceiling())
    else:
        metadata, columns = read_metadata_columns(location, memory_limit=options.memory_ceiling())
        use = IndexUse(NOT_ASKED, "only load(into=) in this process reads it (no retries, task_timeout, dtype=)")
    if metadata is not None and into is None and (options.retries or options.task_timeout is not None):
        if stats is not None:  # (the workers count nothing else here)
            stats.add(ReadStats(index=use))
        return _load_with_processes(location, metadata, keys, options, trust_pickle)
    if into is not None and (options.retries or options.task_timeout is not None):
        raise ValueError("into= is filled by threads in this process: retries and task_timeout need worker processes")
    flat_into, into_paths = flattened[0] if flattened else _flatten_into(into) if into is not None else ({}, {})
    small: dict[str, list[fast_read.Entry]] = {}
    if into is not None:
        chosen = flat_into if keys is None else {k: flat_into[k] for k in select(list(flat_into), keys, "into")}
        # the whole small records into dense CPU targets: checked and planned in one pass over the
        # columns; only the other keys (``selected``) take the checks and requests below
        small, selected = small_targets(columns, chosen)
        _check_present(selected, index if index is not None else _entries(metadata), location)
    else:
        selected = _selected(_entries(metadata), keys, location)
    whole = columns.tensors  # (dtype, shape) of each key of one whole chunk, without touching its objects
    # the tensor keys: the whole ones known from the columns (a metadata object's first touch is
    # a cache miss), and any other tensor entry
    if index is not None:
        stored: dict[str, Any] = {}
        every = index.tensors  # every tensor key of the index is one whole chunk
        tensor_keys = [k for k in selected if k in whole or k in every]
    else:
        stored = _entries(metadata)  # (tensor_keys: TensorStorageMetadata)
        every = whole
        tensor_keys = [k for k in selected if k in whole or isinstance(stored[k], TensorStorageMetadata)]
    metas: dict[str, TensorStorageMetadata] = {k: stored[k] for k in tensor_keys} if into is None else {}
    # fresh targets that may be read as small records, and their data addresses (set below)
    dense: dict[str, tuple[torch.Tensor, int]] = {}
    if into is not None:  # each target not planned as a small record: checked
        tensor = torch.Tensor
        for key in tensor_keys:
            value = flat_into[key]
            known = every.get(key)
            if known is not None:
                dtype, shape = known
            else:
                meta = stored[key]
                dtype, shape = meta.properties.dtype, meta.size
            if not (  # the common case in a few reads; anything else gets the full check and its message
                type(value) is tensor
                and value.dtype == dtype
                and value.shape == shape
                and value.is_contiguous()
                and not value.is_meta
                and lazy_bits(value, dtype) is None
            ):
                if known is not None:
                    check_target(key, value, dtype, tuple(shape))
                else:
                    check_into_target(key, value, stored[key])
    if into is not None:  # targets that share memory across keys are read one after the other
        later = aliased_later(list(chosen), small.values(), ((k, flat_into[k]) for k in tensor_keys))
        if later:
            raise AliasedTargets(later, list(chosen))
    # Kept by reservation alone: everything the read holds is set aside before it starts (the
    # output when it allocates, each thread's buffers); no sampling (reading PSS walks every page
    # table, as long as the read itself), and a thread could not be killed anyway.
    budget = MemoryGovernor(options.memory_ceiling(), measure=False)
    if into is None:
        # each large fresh tensor with a page of room (formats/seated.py)
        output = sum(seated.room_bytes(_nbytes(m)) for m in metas.values())
        budget.reserve(output, f"loading {len(selected)} keys from {location}")
    if isinstance(location, Remote):  # this process's connection to object storage, shared by the threads
        budget.reserve(CLIENT_MEMORY, f"the object storage client for {location}")
    io_mode = resolve_io(options.io, location, writing=False)
    wanted = options.workers if options.workers is not None else usable_cores()
    room = budget.limit - budget.reserved
    tight = io_mode == "auto" and room // (fast_read.thread_memory() + direct_read_memory()) < min(
        wanted, room // fast_read.thread_memory()
    )
    if tight:
        io_mode = "buffered"  # under a tight limit, more reading threads beat aligned buffers
    per_thread = fast_read.thread_memory() + (direct_read_memory() if io_mode != "buffered" else 0)
    threads = max(1, min(wanted, room // per_thread))
    budget.reserve(threads * per_thread, f"read buffers for {threads} threads")
    rooms: dict[str, torch.Tensor] = {}
    if into is not None:
        targets = flat_into  # the caller's values: plan_requests looks up only the tensor keys it reads
    else:
        targets = {}
        for key, meta in metas.items():
            targets[key], space = seated.fresh(meta.properties.dtype, tuple(meta.size))
            if space is not None:
                rooms[key] = space
        # a seated target moves inside its room (formats/seated.py): never read as a small record
        dense = {key: (target, target.data_ptr()) for key, target in targets.items() if key not in rooms}
    values: dict[str, Any] = {}

    def on_bytes(item: ReadItem, data: bytes) -> None:
        values[item.dest_index.fqn] = unpickle_value(item.dest_index.fqn, io.BytesIO(data), trust_pickle=trust_pickle)

    if into is None:
        small = small_records(columns, selected, dense)
        planned = set(map(itemgetter(2), chain.from_iterable(small.values())))
        selected_rest = [key for key in selected if key not in planned] if planned else selected
    else:
        selected_rest = selected  # (the small records were taken out above)
    if metadata is None:  # read from the index: the entries of the keys read the general way
        metadata = index.metadata_for(selected_rest)  # type: ignore[union-attr]
    requests = plan_requests(metadata, selected_rest, targets, location, rooms)
    fetch.keep(path.name for path in shard_files(location, requests, small))
    small = {name: small[name] for name in fetch.order(small)}  # read as the prefetch reads them
    check_shard_sizes(location, shard_ends(requests, small))  # before anything is read
    # auto: direct or buffered as measured on this file system (once per process), inside the
    # threads' reserved buffers (the probe holds no more per stream than a reading thread)
    # (only the files of the tensors read as requests are measured: small records scattered into
    # their tensors read buffered anyway, pickled values are a few small reads, and the probe
    # would drop their cached pages for nothing)
    probed = shard_files(location, [r for r in requests if r.target is not None], {} if scatters else small)
    if (
        probed
        and options.io == "auto"
        and not tight
        and isinstance(location, Path)
        and known_read_choice(location) is None
    ):
        fetch.close()  # the probe times cold reads: no page of its files asked for meanwhile
    choice = (
        ReadChoice("buffered", "buffered", "a tight memory limit: more reading threads instead of aligned buffers")
        if tight
        else read_choice(options.io, location, probed, streams=threads)
    )
    io_mode = choice.io
    # (the total only for a bar shown: reading every target's size is a cache miss a key)
    total = _progress_total(targets, tensor_keys, small) if options.progress else 0
    with progress.Progress(total=total, enabled=options.progress, desc="load") as bar:
        done = fast_read.read_requests(
            location, requests, threads, on_bytes, budget, on_tick=bar.refresh, io=io_mode, small=small
        )
    done.read_choice = choice
    done.prefetch = plan
    done.index = use
    if stats is not None:
        stats.add(done)
    if into is not None:
        # Filled in place by their addresses, which autograd does not see: their version counters
        # bumped as copy_ bumps them (a graph that saved one raises at backward, as under stock).
        filled = [flat_into[key] for key in tensor_keys]
        filled += [entry[3] for entries in small.values() for entry in entries]
        torch.autograd.graph.increment_version(filled)
        if not into_paths.keys() >= values.keys():  # a tensor of ``into`` stored as a value: it is replaced
            into_paths = _flatten_into(into, tensor_paths=True)[1]
        for key, value in values.items():
            _compat.set_element(into, into_paths[key], value)
        return into
    flat: dict[str, Any] = {**targets, **values}
    planner_data = metadata.planner_data or {}
    return _compat.unflatten_state_dict(
        {k: flat[k] for k in selected}, {k: planner_data.get(k, (k,)) for k in selected}
    )


def _progress_total(targets: dict[str, Any], tensor_keys: list[str], small: dict[str, list[fast_read.Entry]]) -> int:
    """The bytes a progress bar counts: every tensor read (each small record's target, and the others')."""
    total: int = sum(targets[key].nbytes for key in tensor_keys)
    return total + sum(entry[3].nbytes for entries in small.values() for entry in entries)


def _into_bytes(into: dict[str, Any], flattened: list[Any], enough: float = math.inf) -> int:
    """The bytes of ``into``'s tensors, or a count past ``enough`` of them (the caller's question
    answered: a whole ``into`` is summed half, 0.2 us a key saved), flattened once (the result
    kept in ``flattened``); 0 for an ``into`` that does not flatten (the load's own flattening
    says why, after the parse)."""
    try:
        flattened.append(_flatten_into(into))
    except Exception:
        return 0
    values = flattened[0][0].values()
    tensors = compress(values, map(isinstance, values, repeat(torch.Tensor)))
    total = 0
    while total <= enough and (part := list(islice(tensors, 4096))):
        total += sum(map(_NBYTES, part))  # (summed without a Python step a key)
    return total


def _flatten_into(
    into: dict[str, Any], tensor_paths: bool = False
) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """``into`` flattened by DCP's rules (the keys it was saved under), in one pass; the paths of
    its values that are not tensors (tensors are filled in place, never set again; with
    ``tensor_paths``, theirs too)."""
    try:
        return flatten_structure(into, tensor_paths=tensor_paths)
    except InvalidStateDictError:  # a key that is not a string: DCP's own flattening names it as DCP does
        return _compat.flatten_state_dict(into)


def _entries(metadata: Metadata | None) -> dict[str, Any]:
    assert metadata is not None  # read from .metadata (not the side index) on this path
    return metadata.state_dict_metadata


def _selected(entries: dict[str, Any], keys: str | Iterable[str] | None, where: Location) -> list[str]:
    """The checkpoint's keys that ``keys`` select (names or patterns, as ``--keys``); all for None."""
    stored = list(entries)
    return stored if keys is None else select(stored, keys, f"the checkpoint at {where}")


def _check_present(selected: list[str], stored: Container[str], where: Location) -> None:
    missing = [k for k in selected if k not in stored]
    if missing:
        raise KeyNotFoundError(
            f"not in the checkpoint at {where}: {describe_keys(missing)}{_held_below(missing, stored)}", keys=missing
        )


def _held_below(missing: list[str], stored: Container[str]) -> str:
    """Where the checkpoint holds keys below a missing one (``nest.lst.0`` for ``nest.lst``):
    that container was flattened when saved, and ``into`` holds something there that is not (a
    tuple, an object). Said in words; "" otherwise."""
    listed = getattr(stored, "names", stored)  # (a side index lists its keys in ``names``)
    if not isinstance(listed, Iterable):
        return ""
    names = [n for n in listed if isinstance(n, str)]
    for key in missing[:8]:
        below = [n for n in names if n.startswith(f"{key}.")]
        if below:
            return (
                f"; it holds {describe_keys(sorted(below))} below {key!r}: a list or dict saved there is "
                "stored element by element, and into= has something else at that place (a tuple or another "
                "object is not looked into): give a list or dict of tensors there"
            )
    return ""


def _load_with_processes(
    path: Location, metadata: Metadata, keys: str | Iterable[str] | None, options: Options, trust_pickle: bool
) -> dict[str, Any]:
    """The pipeline with killable worker processes (for ``retries`` and ``task_timeout``)."""
    selected = _selected(metadata.state_dict_metadata, keys, path)
    tensor_metas = {k: m for k in selected if isinstance(m := metadata.state_dict_metadata[k], TensorStorageMetadata)}
    stored: dict[str, int] = {}  # bytes each key's records hold, in one pass over storage_data
    for index, info in (metadata.storage_data or {}).items():
        stored[index.fqn] = stored.get(index.fqn, 0) + int(info.length)
    values = {k: stored.get(k, 0) for k in selected}
    # A value's record is read, then unpickled: twice its stored size, for admission.
    items = [Item(k, n, n) for k in selected for n in [_nbytes(tensor_metas[k]) if k in tensor_metas else 0]]
    items = [it if it.key in tensor_metas else Item(it.key, 0, 2 * values[it.key]) for it in items]
    # The output lives in memory for good; each item also needs a read buffer of its size.
    governor = MemoryGovernor(options.memory_ceiling())
    governor.hold_coordinator()  # (its workers read under the limit beside it)
    if isinstance(path, Remote):
        governor.worker_extra = CLIENT_MEMORY  # each worker's own connection
    governor.reserve(sum(item.nbytes for item in items), f"loading {len(items)} keys from {path}")
    for key in selected:  # values are read in this process, one at a time, and kept
        if key not in tensor_metas:
            governor.check_item(key, 2 * values[key])
            governor.reserve(values[key], f"the value of {key!r}")
    workers = governor.workers_for(((it.key, it.memory) for it in items), options.worker_count(len(items)))
    tasks = partition(items, workers, max_task_memory=governor.task_budget(workers), memory_adds_up=False)
    check_shards(path, metadata, selected)
    targets: dict[str, torch.Tensor | None] = {k: None for k in selected}
    targets.update(_shared_tensors(tensor_metas))

    flat: dict[str, Any] = dict(targets)
    # Non-tensor values are read here, before the fork: small, and an unsafe one is refused by
    # name (UnsafeCheckpointError) rather than inside a worker.
    value_keys = [k for k in selected if k not in tensor_metas]
    if value_keys:
        flat.update(read_keys(path, metadata, value_keys, {k: None for k in value_keys}, trust_pickle=trust_pickle))
    tasks = [t for t in tasks if any(k in tensor_metas for k in t.keys)]
    if tasks:
        with (
            progress.Progress(total=sum(t.nbytes for t in tasks), enabled=options.progress, desc="load") as bar,
            WorkerPool(
                min(workers, len(tasks)),
                _load_handler(path, metadata, targets, trust_pickle),
                initializer=lambda: torch.set_num_threads(1),
            ) as pool,
            governor.during("reading"),
        ):
            for result in pool.run(
                tasks,
                governor=governor,
                task_timeout=options.task_timeout,
                retries=options.retries,
                on_tick=bar.refresh,
            ):
                flat.update(result.value)
                bar.refresh()
    planner_data = metadata.planner_data or {}
    mapping = {k: planner_data.get(k, (k,)) for k in selected}
    return _compat.unflatten_state_dict(flat, mapping)
