"""``load`` of every format ``convert`` reads: DCP (jobs/load.py), and the file formats here.

path ── detect ──────── DCP ──────────────────────────▶ jobs/load.py (then cast, if dtype=)
  │ safetensors file / HF folder (index or not), torch.save file / folder
  ▼
open_source (headers only; links only within the source's tree; torch.save: weights_only
  unless trust_pickle)  ── dequantize=True: DequantizedSource (pairs checked from headers)
  │ select keys; into=: the caller's tensors, checked (dtype after dtype=, shape)
  │ memory: the output (without into=), each thread's buffers, admitted before any read
  ▼
  │ io="auto": direct or buffered as measured on this file system, once per process
  │   (storage.read_choice; the probe's buffers set aside beside the threads' own)
  ▼
tensors whose bytes lie plainly in a file (Source.raw_ranges):
  - whole, as stored, no caller's memory, where the bounce buffers are in huge pages and the
    reads are direct: formats/bounced_read, a fresh tensor each, filled through each thread's
    ring of huge-page buffers (1 MiB reads, one device request each)
  - else formats/span_read: fresh page-aligned memory laid out as in the file, read straight
    into (O_DIRECT without a bounce buffer), four requests in flight per thread; the tensors are
    views of it (a large one owns its memory)
  - into the caller's tensors, or cast: formats/range_read (preadv in place, or O_DIRECT
    through the thread's aligned buffers; a staging buffer where a cast is needed)
the rest (dequantized pairs, strided torch.save views, object storage): Source.read on the
  same number of threads, copied (and cast) into the destination
  ▼
the source's nesting (torch.save) or its flat names (safetensors), or ``into`` itself

Longer than 300 lines because it is the one place where every file-format load is planned before
any read (keys, ``into``, ``dtype``, memory, the read choice); the readers themselves live in
``formats/``.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from collections.abc import Iterable
from typing import Any

import torch

from parallel_dcp import _compat
from parallel_dcp.engine import progress
from parallel_dcp.engine.memory import MemoryGovernor, format_bytes
from parallel_dcp.engine.pool import gc_paused
from parallel_dcp.errors import (
    InvalidStateDictError,
    KeyNotFoundError,
    MemoryLimitExceeded,
    UnsafeCheckpointError,
    describe_keys,
)
from parallel_dcp.formats import Detected, detect, open_source
from parallel_dcp.formats.aliased_targets import aliased_later
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.bounced_read import bounce_memory, bounced, read_bounced
from parallel_dcp.formats.dequantized_source import block_size_of, dequantized_source
from parallel_dcp.formats.fast_read import ReadStats
from parallel_dcp.formats.key_paths import describe_level, first_non_string, nest
from parallel_dcp.formats.quantized_pairs import dequantized_dtype_of
from parallel_dcp.formats.range_read import Piece, pieces_of, read_pieces, staging_bytes
from parallel_dcp.formats.span_read import plan_spans, read_spans, span_bytes
from parallel_dcp.formats.torch_format import read_whole
from parallel_dcp.jobs import load as dcp_load
from parallel_dcp.jobs.key_patterns import select
from parallel_dcp.jobs.load import check_target
from parallel_dcp.options import Options, usable_cores
from parallel_dcp.storage.direct_read import direct_read_memory
from parallel_dcp.storage.location import CLIENT_MEMORY, Remote, locate
from parallel_dcp.storage.read_choice import BUFFERED_MARGIN, ReadChoice, read_choice
from parallel_dcp.storage.read_probe import probe_memory

__all__ = ["DIRECT_TIE", "SPAN_REQUESTS_PER_THREAD", "load_any"]

# Reads in flight per reading thread, for reads that hold no buffer (formats/span_read): measured
# on this project's VM disk, 8 requests of 1 MiB in flight are the device's best (span_read).
SPAN_REQUESTS_PER_THREAD = 4
# They hold no memory, but past this many a node's cores gain nothing from more.
SPAN_READERS_MAX = 64
# Buffered must be measured faster than direct by more than this (now for every reader:
# storage.read_choice.BUFFERED_MARGIN; this name stays for whole tensors read in place).
DIRECT_TIE = BUFFERED_MARGIN


def load_any(
    path: str | os.PathLike[str],
    keys: str | Iterable[str] | None,
    options: Options,
    *,
    into: dict[str, Any] | None = None,
    trust_pickle: bool = False,
    stats: ReadStats | None = None,
    dtype: torch.dtype | None = None,
    dequantize: bool = False,
    block_size: int | None = None,
) -> dict[str, Any]:
    """The load pipeline above; see :func:`parallel_dcp.load` for the contract."""
    detected: Detected | None = None
    try:
        detected = detect(path, options.storage_options)  # (opened from, below: one look at a folder)
        kind = detected.kind
    except UnsafeCheckpointError:
        raise  # (a link out of the folder where its config.json is: said as it is, not "no .metadata")
    except (FileNotFoundError, ValueError):
        kind = "dcp"  # nothing readable there: the DCP reader says what is missing, as it always has
    if kind == "dcp" and not dequantize:
        if dtype is None:
            return dcp_load.load(path, keys, options, into=into, trust_pickle=trust_pickle, stats=stats)
        return _dcp_cast(path, keys, options, into, trust_pickle, stats, dtype)
    if options.retries or options.task_timeout is not None:
        raise ValueError(
            f"retries and task_timeout run a DCP load on worker processes; {path} is a {kind} source, "
            "read by threads in this process: leave them out"
        )
    with gc_paused():  # per-key objects for 50,000 keys would otherwise walk the caller's heap
        source = open_source(
            path if detected is None else detected,
            trust_pickle=trust_pickle,
            storage_options=options.storage_options,
            memory_limit=options.memory_ceiling(),
        )
        # A torch.save file with keys that are not strings (an optimizer's int keys): read whole
        # with torch.load, as before; with keys=, read as any other, nested again with its keys
        # (formats/key_paths.py). into= (filled by DCP's string names) and dequantize= are refused.
        odd = first_non_string(source.mapping, source.keys()) if kind == "torch" else None
        if odd is not None and (keys is None or into is not None or dequantize):
            source.close()
            if into is not None or dequantize:
                raise InvalidStateDictError(
                    f"{path} holds {describe_level(source.mapping[odd[0]], odd[1])}, which into= and dequantize= "
                    "cannot take: load it without them, as torch.load gives it"
                )
            return load_whole(path, options, trust_pickle, dtype)
        try:
            if dequantize:
                source = dequantized_source(
                    source, dequantized_dtype_of(source, dtype), block_size_of(source, block_size)
                )
            return _load(source, keys, options, into, dtype, stats)
        finally:
            source.close()


def load_whole(
    path: str | os.PathLike[str], options: Options, trust_pickle: bool, dtype: torch.dtype | None
) -> dict[str, Any]:
    """A single torch.save file as ``torch.load`` gives it (a state dict with int keys: an
    optimizer's), its floating tensors cast to ``dtype``: read whole, so refused where its size is
    more than the memory limit."""
    where = locate(path, options.storage_options)
    if isinstance(where, Remote) or where.is_dir():
        raise InvalidStateDictError(f"{path}: keys that are not strings are read from a local torch.save file only")
    size, limit = os.path.getsize(where), options.memory_ceiling()
    if size > limit:
        raise MemoryLimitExceeded(
            f"{path} holds keys that are not strings and is read whole: its {format_bytes(size)} are more than "
            f"the memory limit {format_bytes(limit)}: raise --memory-limit",
            limit=limit,
            measured=size,
            keys=[],
        )
    loaded = read_whole(os.path.realpath(where), trust_pickle=trust_pickle)  # the file the user named
    if not isinstance(loaded, dict):
        raise InvalidStateDictError(
            f"{path} holds a {type(loaded).__name__} with keys that are not strings inside: load it with torch.load"
        )
    return _cast_floats(loaded, dtype) if dtype is not None else loaded


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return type(value)((k, _cast_floats(v, dtype)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    return value


def _cast(stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """What ``dtype=`` makes of a tensor stored as ``stored``: floating tensors cast, others kept."""
    return dtype if dtype is not None and stored.is_floating_point else stored


def _dcp_cast(
    path: str | os.PathLike[str],
    keys: str | Iterable[str] | None,
    options: Options,
    into: dict[str, Any] | None,
    trust_pickle: bool,
    stats: ReadStats | None,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """A DCP checkpoint with ``dtype=``: loaded as stored, then cast a tensor at a time (each
    stored tensor freed once cast), or copied with the cast into ``into``."""
    if into is None:
        loaded = dcp_load.load(path, keys, options, trust_pickle=trust_pickle, stats=stats)
        flat, mapping = _compat.flatten_state_dict(loaded)
        for key, value in flat.items():
            if isinstance(value, torch.Tensor) and value.dtype != _cast(value.dtype, dtype):
                flat[key] = value.to(dtype)
        return _compat.unflatten_state_dict(flat, mapping)
    flat_into, paths = _compat.flatten_state_dict(into)
    wanted = list(flat_into) if keys is None else select(list(flat_into), keys, "into")
    loaded = dcp_load.load(path, wanted, options, trust_pickle=trust_pickle, stats=stats)
    flat, _ = _compat.flatten_state_dict(loaded)
    for key in wanted:
        value = flat.pop(key)
        if isinstance(value, torch.Tensor):
            check_target(key, flat_into.get(key), _cast(value.dtype, dtype), tuple(value.shape))
            flat_into[key].detach().copy_(value)
        else:
            _compat.set_element(into, paths[key], value)
    return into


def _selected(source: Source, keys: str | Iterable[str] | None, flat_into: dict[str, Any] | None) -> list[str]:
    """The keys to load: names or patterns (as ``convert``'s ``keys``) among the source's keys, or
    among ``into``'s; every one must be in the source."""
    stored = list(source.keys())  # the source's order (safetensors: load_file's, by offset)
    if flat_into is not None:
        selected = list(flat_into) if keys is None else select(list(flat_into), keys, "into")
        missing = [k for k in selected if k not in source.entries and k not in source.values]
        if missing:
            raise KeyNotFoundError(f"not in {source.path}: {describe_keys(missing)}", keys=missing)
        return selected
    return stored if keys is None else select(stored, keys, source.path)


def _load(
    source: Source,
    keys: str | Iterable[str] | None,
    options: Options,
    into: dict[str, Any] | None,
    dtype: torch.dtype | None,
    stats: ReadStats | None,
) -> dict[str, Any]:
    flat_into, into_paths = _compat.flatten_state_dict(into) if into is not None else (None, {})
    selected = _selected(source, keys, flat_into)
    tensors = [k for k in selected if k in source.entries]
    values = [k for k in selected if k not in source.entries]
    out_dtype = {k: _cast(source.entries[k].dtype, dtype) for k in tensors}
    if flat_into is not None:
        for key in tensors:
            check_target(key, flat_into[key], out_dtype[key], source.entries[key].shape)
    source.check(tensors)
    source.load_values(values)

    ranges = {k: r for k, r in source.raw_ranges().items() if k in out_dtype}
    mapped = [k for k in tensors if k not in ranges]
    # whole tensors as stored, into fresh memory: read where they live (formats/span_read)
    spans = plan_spans(
        []
        if flat_into is not None
        else [
            (k, where.file, where.offset, entry.dtype, entry.shape)
            for k, where in ranges.items()
            for entry in [source.entries[k]]
            if out_dtype[k] == entry.dtype and entry.nbytes and where.offset % entry.dtype.itemsize == 0
        ]
    )
    spanned = {key for span in spans for key, *_ in span.tensors}
    budget = MemoryGovernor(options.memory_ceiling())
    if flat_into is None:
        total = sum(
            source.entries[k].nbytes // source.entries[k].dtype.itemsize * out_dtype[k].itemsize
            for k in tensors
            if k not in spanned
        )
        budget.reserve(total + span_bytes(spans), f"loading {len(tensors)} tensors from {source.path}")
    if isinstance(source.location, Remote):
        budget.reserve(CLIENT_MEMORY, f"the object storage client for {source.path}")
    for key in values:
        budget.reserve(source.value_bytes(key), f"the value of {key!r}")
    targets = {
        # detached: the same memory, filled without autograd seeing an in-place write to a leaf
        k: flat_into[k].detach() if flat_into is not None else torch.empty(source.entries[k].shape, dtype=out_dtype[k])
        for k in tensors
        if k not in spanned
    }
    pieces: list[Piece] = []
    for key, where in ranges.items():
        if key not in spanned:
            pieces += pieces_of(key, where.file, where.offset, source.entries[key].dtype, targets[key])
    pieces = [p for p in pieces if p.nbytes]  # an empty tensor has nothing to read
    # where the bounce buffers are in huge pages, whole tensors read direct go through them
    # (formats/bounced_read): each reading thread's ring is admitted with its other buffers
    local = not isinstance(source.location, Remote)
    threads, bounce = _threads(options, budget, source, pieces, mapped, bool(spans) and local and bounced(options.io))
    choice = _read_choice(options, budget, source, [p.file for p in pieces] + [s.file for s in spans], threads)
    total = sum(t.nbytes for t in targets.values()) + sum(source.entries[k].nbytes for k in spanned)
    with progress.Progress(total=total, enabled=options.progress, desc="load") as bar:
        # reads that hold no buffer keep a second request in flight per thread: the device's queue
        readers = min(threads * SPAN_REQUESTS_PER_THREAD, SPAN_READERS_MAX)
        if bounce and bounced(choice.io):
            whole = [(k, s.file, offset, d, shape) for s in spans for k, offset, d, shape in s.tensors]
            targets |= read_bounced(whole, threads, choice.io, on_tick=bar.refresh)
        else:
            targets |= read_spans(spans, readers, choice.io, on_tick=bar.refresh)
        # targets that share memory across keys (a tied model): the later keys after the others,
        # one at a time in the template's order, so the last one's bytes stay (formats/aliased_targets)
        later = aliased_later(selected, [], ((k, targets[k]) for k in tensors)) if flat_into is not None else []
        for phase in [set(tensors) - set(later), *({key} for key in later)]:
            read_pieces([p for p in pieces if p.key in phase], threads, choice.io, on_tick=bar.refresh)
            _read_mapped(source, [k for k in mapped if k in phase], targets, threads)
    source.release()
    if stats is not None:
        stats.add(
            ReadStats(
                fast=len(ranges),
                fallback=len(mapped),
                fallback_keys=set(mapped),
                values=len(values),
                bytes=sum(p.nbytes for p in pieces) + sum(source.entries[k].nbytes for k in spanned),
                read_choice=choice,
            )
        )
    flat: dict[str, Any] = {**targets, **{k: source.values[k] for k in values}}
    if into is not None:
        for key in values:
            _compat.set_element(into, into_paths[key], flat[key])
        return into
    return nest({k: flat[k] for k in selected}, {k: source.mapping.get(k, (k,)) for k in selected})


def _threads(
    options: Options, budget: MemoryGovernor, source: Source, pieces: list[Piece], mapped: list[str], bounce: bool
) -> tuple[int, bool]:
    """As many reading threads as asked for (every usable core by default) whose buffers fit
    under the limit beside what is set aside; the buffers are set aside too. A read of whole
    tensors into fresh memory holds a ring of bounce buffers a thread where ``bounce`` stays
    true (formats/bounced_read: where one ring fits), else none (formats/span_read)."""
    per_thread = staging_bytes(pieces) + (direct_read_memory() if pieces and options.io != "buffered" else 0)
    largest = max((source.copied_bytes(k) for k in mapped), default=0)
    for key in mapped:
        budget.check_item(key, per_thread + source.copied_bytes(key))
    per_thread += largest
    room = budget.limit - budget.reserved
    # one ring a thread, read before the pieces and the mapped tensors (their buffers not yet held)
    bounce = bounce and max(per_thread, bounce_memory()) <= room
    if bounce:
        per_thread = max(per_thread, bounce_memory())
    wanted = options.workers if options.workers is not None else usable_cores()
    threads = max(1, min(wanted, room // per_thread if per_thread else wanted))
    budget.reserve(threads * per_thread, f"read buffers for {threads} threads")
    return threads, bounce


def _read_choice(
    options: Options, budget: MemoryGovernor, source: Source, files: list[str], threads: int
) -> ReadChoice:
    """How the files are read (storage.read_choice: for ``io="auto"``, measured once per file
    system and process). The measurement's buffers are set aside beside the threads' own (it
    runs before they read); where they do not fit, auto keeps its rule instead of measuring."""
    if not files:
        return ReadChoice("buffered", "buffered", "nothing read from files")
    if options.io == "auto" and not isinstance(source.location, Remote):
        extra = probe_memory(threads)
        if budget.reserved + extra > budget.limit:
            return ReadChoice("auto", "direct", "no room under the memory limit to measure: direct for large files")
        budget.reserve(extra, "the read measurement's buffers")
    return read_choice(options.io, source.location, files, streams=threads)


def _read_mapped(source: Source, keys: list[str], targets: dict[str, torch.Tensor], threads: int) -> None:
    """Tensors the source computes or maps (dequantized pairs, strided torch.save views), each
    read by ``Source.read`` and copied (cast) into its destination, ``threads`` at a time."""
    if not keys:
        return

    def one(key: str) -> None:
        value = source.read([key])[key]
        targets[key].copy_(value)
        progress.report(targets[key].nbytes)
        del value

    with cf.ThreadPoolExecutor(max_workers=min(threads, len(keys)), thread_name_prefix="parallel_dcp-read") as pool:
        for future in [pool.submit(one, key) for key in keys]:
            future.result()
    progress.flush()
