"""``FastReader``: a drop-in ``StorageReader`` for stock ``torch.distributed.checkpoint.load``.

    dcp.load(state_dict, storage_reader=parallel_dcp.FastReader(path, workers=4))

DCP's planner still decides what each rank reads (any resharding: a DTensor shard reading part of
a stored chunk is a ``ReadItem`` with storage offsets and lengths); this reader serves each item
with :mod:`parallel_dcp.fast_read`, straight into ``planner.resolve_tensor(item)`` (compressed
records decompressed, bounded, on the same threads), and leaves to DCP's own reader what the fast
path does not fit (non-contiguous stored layouts, a target of another dtype, which stock casts).
``.metadata`` is read with the allow-list unpickler and its shard names checked; pickled values
must pass ``weights_only=True`` before the planner sees them, unless ``trust_pickle``.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from parallel_dcp.engine.chunks import lazy_bits
from parallel_dcp.engine.memory import MemoryGovernor, parse_size
from parallel_dcp.engine.pool import gc_paused
from parallel_dcp.errors import CorruptCheckpointError
from parallel_dcp.formats import fast_read
from parallel_dcp.formats.aliased_targets import AliasedTargets, check_no_aliases
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.range_read import RawRange
from parallel_dcp.formats.source_storage import read_source_items, source_metadata, source_read_choice
from parallel_dcp.options import usable_cores
from parallel_dcp.storage.io_mode import resolve_io
from parallel_dcp.storage.location import Location, Remote, RemoteFileSystem, locate, resolved_once
from parallel_dcp.storage.metadata import check_metadata, read_metadata, unpickle_value
from parallel_dcp.storage.read_choice import ReadChoice, read_choice
from parallel_dcp.storage.safe_reader import SafeFileSystem

__all__ = ["FastReader"]


def open_other_format(where: Location, storage_options: dict[str, Any] | None, trust_pickle: bool) -> Source | None:
    """The source at ``where`` when it is a format other than DCP; None for DCP (or nothing
    readable: DCP's reader then says what is missing)."""
    from parallel_dcp.formats import detect, open_source

    try:
        detected = detect(where, storage_options)
    except (FileNotFoundError, ValueError):
        return None
    if detected.kind == "dcp":
        return None
    return open_source(detected, trust_pickle=trust_pickle, storage_options=storage_options)


class FastReader(FileSystemReader):
    """A ``StorageReader`` that reads DCP checkpoints with parallel zero-copy reads, and every
    other format :func:`parallel_dcp.convert` reads (a safetensors file or Hugging Face folder, a
    torch.save file): each tensor is then one stored chunk, its bytes read straight from the file.

    Args:
        path: the checkpoint directory, or its URL (``s3://...``; ``storage_options`` as for
            :func:`parallel_dcp.save`).
        workers: reading threads per process (per rank); None uses every usable core.
        trust_pickle: hand pickled values to the planner without first checking that
            ``weights_only=True`` loads them (stock DCP unpickles them fully).
        memory_limit: bytes (or "64MiB") that ``.metadata`` and each record read whole (a
            pickled value, a record left to DCP's reader) must fit under, checked before it is
            read (MemoryLimitExceeded); None: ``.metadata`` under the default limit, records as
            stock reads them. The caller's tensors are the caller's memory, not counted.
        io: ``"auto"``, ``"direct"`` or ``"buffered"``, as for :func:`parallel_dcp.load`.

    ``stats`` (a :class:`parallel_dcp.ReadStats`) counts what the fast path and DCP's reader
    served across every ``read_data`` call; ``read_choice`` (also ``stats.read_choice``) says how
    the shards were read, and for ``io="auto"`` the cold rates measured on their file system by
    the first ``read_data`` (storage.read_choice.read_choice).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        workers: int | None = None,
        trust_pickle: bool = False,
        storage_options: dict[str, Any] | None = None,
        memory_limit: int | str | None = None,
        io: str = "auto",
    ) -> None:
        self._where: Location = resolved_once(locate(path, storage_options))  # (a linked folder: one checkpoint)
        self.io = resolve_io(io, self._where, writing=False)
        self._io_asked = io
        super().__init__(os.fspath(self._where))
        # Any other format convert reads (safetensors, torch.save) is served as one chunk per tensor.
        self._source = open_other_format(self._where, storage_options, trust_pickle)
        self._ranges: dict[str, RawRange] | None = None
        if isinstance(self._where, Remote):
            self.fs = RemoteFileSystem(self._where.options)  # type: ignore[assignment]
            self.path = self._where.url
        else:  # shards opened by the one rule (stock: Path.open, through any planted symlink)
            self.fs = SafeFileSystem()
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers if workers is not None else usable_cores()
        self.trust_pickle = trust_pickle
        self.memory_limit = None if memory_limit is None else parse_size(memory_limit)
        self.stats = fast_read.ReadStats()
        self.read_choice: ReadChoice | None = None
        self._chunks: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}
        self._metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            options = self._where.options if isinstance(self._where, Remote) else None
            self._where = resolved_once(locate(checkpoint_id, options))
            self._source, self._ranges = open_other_format(self._where, options, self.trust_pickle), None
            if not isinstance(self._where, Remote):  # (the stock reader opens its shards under this path)
                checkpoint_id = self._where
        super().reset(checkpoint_id)
        self.read_choice = None  # another checkpoint may live on another file system
        if isinstance(self._where, Remote):
            self.path = self._where.url

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """``.metadata`` through the allow-list unpickler (stock uses plain pickle)."""
        if kwargs.get("rank") is not None:
            raise NotImplementedError("FastReader reads the global .metadata only, not per-rank metadata files")
        if self._source is not None:
            metadata = source_metadata(self._source)
            assert metadata.storage_meta is not None
            metadata.storage_meta.load_id = self.load_id
            return metadata
        with gc_paused():
            metadata = read_metadata(
                self._where, memory_limit=self.memory_limit
            )  # names, sizes and offsets checked as it is read
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._source is not None:  # every rank opened the files itself: their headers are the metadata
            self._metadata = source_metadata(self._source)
            return
        check_metadata(metadata, self._where)  # every rank: the metadata may come from another rank
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata
        self._chunks = {}

    def _chunk(self, index: Any) -> tuple[torch.dtype, tuple[int, ...]]:
        assert self._metadata is not None
        meta = self._metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(meta, TensorStorageMetadata):
            raise CorruptCheckpointError(f"{self._where}: .metadata holds no tensor {index.fqn!r}")
        sizes = self._chunks.get(index.fqn)
        if sizes is None:
            sizes = self._chunks[index.fqn] = {tuple(c.offsets): tuple(c.sizes) for c in meta.chunks}
        chunk = sizes.get(tuple(index.offset or ()))
        if chunk is None:
            raise CorruptCheckpointError(f"{self._where}: .metadata has no chunk of {index.fqn!r} at {index.offset}")
        return meta.properties.dtype, chunk

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan``; tensors are committed to the planner once all are read."""
        with gc_paused():  # per-item objects would trigger collections over the caller's heap
            return self._read_data(plan, planner)

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            return self._read_items(plan, planner)
        except AliasedTargets as aliased:  # planned, nothing read: items whose targets overlap go last
            later = set(aliased.later)
        # one at a time after the others, in the plan's order, as stock's reader copies them
        first = [item for n, item in enumerate(plan.items) if n not in later]
        self._read_items(dataclasses.replace(plan, items=first), planner)
        for n in sorted(later):
            self._read_items(dataclasses.replace(plan, items=[plan.items[n]]), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_items(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._source is not None:
            if self._ranges is None:
                self._ranges = self._source.raw_ranges()
            if self.read_choice is None:  # the first read decides, measuring the files it is about to read
                self.read_choice = source_read_choice(
                    self._source, self._ranges, plan, self._io_asked, self.workers, self.memory_limit
                )
            fast = read_source_items(
                self._source, self._ranges, plan, planner, self.workers, self.read_choice.io, self.memory_limit
            )
            self.stats.add(
                fast_read.ReadStats(
                    fast=fast,
                    fallback=sum(1 for i in plan.items if i.type != LoadItemType.BYTE_IO) - fast,
                    read_choice=self.read_choice,
                )
            )
            done: Future[None] = Future()
            done.set_result(None)
            return done
        requests: list[fast_read.Request] = []
        committed: list[tuple[ReadItem, torch.Tensor]] = []
        for item in plan.items:
            info = self.storage_data.get(item.storage_index)
            if info is None:
                raise CorruptCheckpointError(f"{self._where}: .metadata records no shard for {item.storage_index}")
            if item.type == LoadItemType.BYTE_IO:
                requests.append(fast_read.Request(item, info, (), None, None))
                continue
            dtype, chunk = self._chunk(item.storage_index)
            target = planner.resolve_tensor(item).detach()
            if tuple(target.shape) != tuple(item.lengths):
                raise CorruptCheckpointError(
                    f"{item.storage_index.fqn!r}: the planner's target has shape {list(target.shape)}, "
                    f"the read item {list(item.lengths)}"
                )
            # stock casts into a target of another dtype: its reader does that copy, as it would; and
            # copies into a lazy view (x.conj()), whose memory holds the conjugate of its values
            unfit = target.dtype != dtype or lazy_bits(target, target.dtype) is not None
            requests.append(fast_read.Request(item, info, chunk, dtype, target, unfit=unfit))
            committed.append((item, target))
        check_no_aliases(plan.items, [target for _, target in committed], [item for item, _ in committed])

        def on_bytes(item: ReadItem, data: bytes) -> None:
            if not self.trust_pickle:
                unpickle_value(item.storage_index.fqn, io.BytesIO(data), trust_pickle=False)
            planner.load_bytes(item, io.BytesIO(data))

        budget = None if self.memory_limit is None else MemoryGovernor(self.memory_limit)
        if self.read_choice is None:  # the first read decides, measuring the shards it is about to read
            names = dict.fromkeys(str(r.info.relative_path) for r in requests)
            files = [] if isinstance(self._where, Remote) else [self._where / name for name in names]
            self.read_choice = read_choice(self._io_asked, self._where, files, streams=self.workers)
        read = fast_read.read_requests(self._where, requests, self.workers, on_bytes, budget, io=self.read_choice.io)
        read.read_choice = self.read_choice
        self.stats.add(read)
        # Filled by their addresses, which autograd does not see: bumped as stock's copy_ bumps them.
        torch.autograd.graph.increment_version([target for _, target in committed])
        for item, target in committed:
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future
