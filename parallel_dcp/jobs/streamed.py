"""A conversion task written straight from its source's files, reading ahead while it writes.

    task's units ── each a whole tensor, or rows of one, lying in one run of a local safetensors
      │             file, written in its own dtype to a DCP shard; anything else: None (the task
      │             reads its units as tensors, Job.read, as before)
      ▼
    ring (storage.read_ahead) fitted into what the plan admitted for the units' reads: the task's
      │ memory was budgeted before the task ran, and the ring takes at most that
      ▼
    {unit: StreamedTensor} ── DcpTarget.write ── lean.write_part: record after record, each
                              record's bytes copied from the ring into the direct-write buffers
                              while the ring reads the next pieces (the next unit's too)

The records are those the tensors' own path writes (storage.records.class_template): the output is
the same bytes, whichever way a task went.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.engine.partition import Task
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.safetensors_format import SafetensorsSource
from parallel_dcp.jobs.targets import DcpTarget, Job, Target
from parallel_dcp.options import Options
from parallel_dcp.storage import copy_probe, io_mode
from parallel_dcp.storage.copy_choice import copy_choice
from parallel_dcp.storage.location import Remote
from parallel_dcp.storage.read_ahead import ReadAhead, Ring, Span, StreamedTensor, ring_for
from parallel_dcp.storage.read_choice import ReadChoice, read_choice
from parallel_dcp.storage.read_probe import probe_memory
from parallel_dcp.storage.records import Template, class_template

__all__ = ["STREAM_MARGIN", "StreamPlan", "measured_stream_source", "stream_source", "streamed_data", "streamed_plan"]


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """How a task is written from its source's bytes: ``order`` the units in the order the writer
    takes them, ``records`` each tensor unit's (dtype, shape, record template), ``values`` the
    other values as read, ``spans`` the tensor units' bytes in writing order, and the ``ring``."""

    order: list[str]
    records: dict[str, tuple[torch.dtype, tuple[int, ...], Template]]
    values: dict[str, Any]
    spans: list[Span]
    ring: Ring


# Under io="auto" without a measurement beside the writes (measured_stream_source: the ranks of a
# distributed conversion), a conversion reads through the O_DIRECT ring only where direct reads
# measured at least this much faster than buffered ones. Within it the mmap was faster: on this project's VM
# (read-ahead 8 MiB, probe direct 1.16 against buffered 1.14 GiB/s) a cold 1 GiB conversion at
# w=2 took 1.50 s through the mmap against 1.79 s through the ring (medians of 5, one run), though
# the ring used a fifth less CPU (0.79 against 1.00 s).
STREAM_MARGIN = 1.10


def streamed_plan(job: Job, target: Target, task: Task) -> StreamPlan | None:
    """The :class:`StreamPlan` of ``task``; None when it cannot be written from its source's bytes,
    or the memory admitted for it holds no ring."""
    source = job.source
    if (
        not isinstance(target, DcpTarget)
        or target.compression is not None
        or not isinstance(source, SafetensorsSource)
        or source.stream_io is None
    ):
        return None
    whole: list[str] = []
    chunked: list[str] = []
    values: dict[str, Any] = {}
    records: dict[str, tuple[torch.dtype, tuple[int, ...], Template]] = {}
    spans: dict[str, Span] = {}
    room = 0
    for unit in task.keys:
        chunk = job.chunks.get(unit)
        key = chunk.key if chunk is not None else unit
        entry = source.entries.get(key)
        if entry is None:
            if key not in source.values:
                return None
            values[unit] = source.values[key]
            continue
        shape = tuple(chunk.sizes) if chunk is not None else tuple(entry.shape)
        span = source.span(key, chunk)
        template = class_template(entry.dtype, shape)
        if span is None or template is None or job.out_dtype(entry.dtype, key) != entry.dtype:
            return None
        spans[unit] = span
        records[unit] = (entry.dtype, shape, template)
        (chunked if chunk is not None else whole).append(unit)
        room += job.memory(unit)  # what the plan admitted for reading it as a tensor
    if not spans:
        return None
    ring = ring_for(room, max(span.nbytes for span in spans.values()))
    if ring is None:
        return None
    # The order DcpTarget.write hands them to the writer: whole keys (lean.write_part writes the
    # values first, then the tensors in this order), then chunks.
    return StreamPlan(whole + list(values) + chunked, records, values, [spans[u] for u in whole + chunked], ring)


@contextlib.contextmanager
def streamed_data(job: Job, target: Target, task: Task) -> Iterator[dict[str, Any] | None]:
    """In a worker: ``task``'s data for ``target.write``, its tensors as :class:`StreamedTensor`
    over one :class:`ReadAhead` that lives while the block runs; None where :func:`streamed_plan`
    says no (the task then reads its units as tensors)."""
    plan = streamed_plan(job, target, task)
    if plan is None:
        yield None
        return
    source = job.source
    assert isinstance(source, SafetensorsSource) and source.stream_io is not None
    with ReadAhead(plan.spans, plan.ring, source.stream_io) as reader:
        data: dict[str, Any] = {}
        index = 0
        for unit in plan.order:
            if unit in plan.values:
                data[unit] = plan.values[unit]
                continue
            dtype, shape, template = plan.records[unit]
            data[unit] = StreamedTensor(dtype, shape, template, index, reader)
            index += 1
        yield data


def stream_source(source: Source, target: Target, options: Options, governor: MemoryGovernor) -> ReadChoice | None:
    """Set a local safetensors source converted to an uncompressed DCP checkpoint to be written
    from its files' bytes through the O_DIRECT ring (:meth:`SafetensorsSource.stream_reads`) where
    direct reads are the device path: ``io="direct"``, or ``io="auto"`` where the measured read
    choice (storage.read_choice: cold direct against cold buffered, once per file system and
    process) found direct reads faster than buffered ones by at least :data:`STREAM_MARGIN`.
    Otherwise the source stays with the library's mmap, whose pages the kernel reads ahead while
    the writer works. Returns the read choice, or None where the conversion is not of that kind.

    The measurement runs here, before any worker exists, and only where its buffers fit under the
    limit; otherwise auto keeps the mmap.
    """
    if (
        not isinstance(source, SafetensorsSource)
        or not isinstance(target, DcpTarget)
        or target.compression is not None
        or isinstance(source.location, Remote)
    ):
        return None
    streams = options.worker_count(len(source.entries))
    if options.io == "auto" and governor.reserved + probe_memory(streams) > governor.limit:
        return ReadChoice("auto", "buffered", "no room under the memory limit to measure: the mmap")
    choice = read_choice(options.io, source.location, source.files, streams=streams)
    direct, buffered = choice.direct_bytes_per_s, choice.buffered_bytes_per_s
    clearly = direct is not None and buffered is not None and direct >= STREAM_MARGIN * buffered
    if options.io == "direct" or (choice.reads == "direct" and clearly):
        source.stream_reads(choice.io)
    return choice


def measured_stream_source(
    job: Job,
    target: Target,
    options: Options,
    governor: MemoryGovernor,
    directory: str | os.PathLike[str],
    workers: int,
    save_id: str,
) -> ReadChoice | None:
    """Under ``io="auto"``, for a job converting a local safetensors source to an uncompressed
    local DCP checkpoint: set the source to be written from its files' bytes through the O_DIRECT
    ring (:meth:`SafetensorsSource.stream_reads`) where the ring measured faster than the mmap
    beside the conversion's own writes into ``directory`` (its staging directory, which exists:
    called after every check of the job and its destination, before any worker starts), else
    keep the mmap (storage.copy_choice: once per source and destination file system and
    process; the probe's scratch files are named as temporary files of the save ``save_id``).
    Returns the choice; None where the job is not of that kind (nothing measured). A source checked
    against its checksums keeps the mmap, unmeasured: the hash pass and the reads share its pages.

    The measurement runs only where its buffers fit under the limit; otherwise auto keeps the mmap.
    """
    source = job.source
    if (
        options.io != "auto"
        or not isinstance(source, SafetensorsSource)
        or not isinstance(target, DcpTarget)
        or target.compression is not None
        or isinstance(source.location, Remote)
        or isinstance(target.path, Remote)
        or not any(job.out_dtype(entry.dtype, entry.key) == entry.dtype for entry in source.entries.values())
    ):
        return None  # nothing this job would stream
    if job.checks is not None:  # (jobs/source_check.py) the ring's O_DIRECT reads pass the page
        # cache, so checking its files would read them from storage twice; the mmap reads them once
        return ReadChoice("auto", "buffered", "the source is checked against its checksums: the mmap")
    refusal = io_mode.direct_refusal(source.location, probe=False)
    if refusal is not None:
        return ReadChoice("buffered", "buffered", refusal)
    sizes = sorted(((os.path.getsize(f), f) for f in source.files), reverse=True)
    large = [f for size, f in sizes if size >= io_mode.DIRECT_MIN_BYTES]
    if not large:
        return ReadChoice("auto", "buffered", f"no file of at least {io_mode.DIRECT_MIN_BYTES >> 20} MiB: the mmap")
    direct_writes = target.uses_direct(sizes[0][0])
    if governor.reserved + copy_probe.probe_memory(workers, direct_writes=direct_writes) > governor.limit:
        return ReadChoice("auto", "buffered", "no room under the memory limit to measure: the mmap")
    choice = copy_choice(large, directory, workers, direct_writes=direct_writes, save_id=save_id)
    if choice.reads == "direct":
        source.stream_reads(choice.io)
    return choice
