"""The primitives everything else is built on: save, commit and load *parts* of a DCP checkpoint.

``torch.distributed.checkpoint`` assumes a process group: every rank plans, rank 0 merges and
writes ``.metadata``. These functions run one rank's share in a single process with no process
group, so a coordinator can hand disjoint key sets to independent workers and commit once:

    metadata, writes = partial_save(part, writer, part_idx=i)    # in each worker, unique i
    merged = merge_metadata([metadata_0, metadata_1, ...])         # in the coordinator
    commit(merged, [writes_0, writes_1, ...], writer)              # writes .metadata: the commit

and the reverse, to read any subset of a checkpoint:

    metadata = load_metadata(reader)
    part = partial_load(extract_metadata(keys, metadata), reader)

They work with any ``StorageWriter`` / ``StorageReader``; with ``FileSystemWriter`` the part
index becomes the file prefix ``__{part_idx}_``, so parts never collide.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable, Sequence
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from parallel_dcp import _compat

StateDict = dict[str, Any]

__all__ = [
    "commit",
    "extract_metadata",
    "load_metadata",
    "merge_metadata",
    "partial_load",
    "partial_save",
]


def _logger_kwargs(storage: StorageWriter | StorageReader) -> dict[str, Any]:
    checkpoint_id = getattr(storage, "checkpoint_id", None)
    return {} if checkpoint_id is None else {"checkpoint_id": checkpoint_id}


def partial_save(
    state_dict: StateDict,
    storage_writer: StorageWriter,
    planner: SavePlanner | None = None,
    part_idx: int = 0,
    *,
    file_tag: str = "",
) -> tuple[Metadata, list[WriteResult]]:
    """Write one part of a checkpoint, in this process, without a process group.

    Args:
        state_dict: the keys of this part. Parts of one checkpoint must hold disjoint keys.
        storage_writer: where to write; it is set up as a coordinator of a one-rank job.
        planner: a ``SavePlanner``; ``DefaultSavePlanner()`` when None.
        part_idx: this part's unique index. It replaces the rank in the storage prefix
            (``__{part_idx}_`` for ``FileSystemWriter``), so two parts never write the same
            file. A retried part must reuse its index, so it rewrites its own files.
        file_tag: added to the prefix (``__{part_idx}_{file_tag}_``) so that the files of one
            save never share a name with those of another in the same place (object storage,
            where a save writes beside the checkpoint it replaces).

    Returns:
        ``(metadata, write_results)``: this part's ``Metadata`` (``storage_data`` not yet set)
        and its ``WriteResult`` list. Pass both, with those of the other parts, to
        :func:`merge_metadata` and :func:`commit`.

    Raises:
        ValueError: ``part_idx`` is negative.
        Whatever the writer raises; DCP wraps some errors in ``CheckpointException``, a
        ``BaseException``. Nothing is committed by this call, whatever happens.
    """
    if part_idx < 0:
        raise ValueError(f"part_idx must be >= 0, got {part_idx}")
    planner = DefaultSavePlanner() if planner is None else planner
    log = _compat.dcp_method_logger(**_logger_kwargs(storage_writer))

    @log
    def local_step() -> SavePlan:
        storage_meta = storage_writer.storage_meta()
        if "storage_meta" in inspect.signature(planner.set_up_planner).parameters:
            planner.set_up_planner(state_dict=state_dict, storage_meta=storage_meta, is_coordinator=True)
        else:  # planners written before torch added storage_meta
            planner.set_up_planner(state_dict, True)  # type: ignore[call-arg,arg-type]
        storage_writer.set_up_storage_writer(True)
        return storage_writer.prepare_local_plan(planner.create_local_plan())

    @log
    def global_step(local_plan: SavePlan) -> tuple[SavePlan, Metadata]:
        plans, metadata = planner.create_global_plan([local_plan])
        plans = storage_writer.prepare_global_plan(plans)
        # The writer numbered this single plan as rank 0; the part index makes it unique.
        plan = dataclasses.replace(
            plans[0], storage_data=_compat.storage_prefix(f"__{part_idx}_{file_tag}_" if file_tag else f"__{part_idx}_")
        )
        return plan, metadata

    @log
    def write_data(plan: SavePlan) -> list[WriteResult]:
        writes = storage_writer.write_data(planner.finish_plan(plan), planner)
        writes.wait()
        return writes.value()

    plan, metadata = global_step(local_step())
    return metadata, write_data(plan)


def commit(
    global_metadata: Metadata,
    all_writes: Sequence[Sequence[WriteResult]],
    storage_writer: StorageWriter,
) -> Metadata:
    """Commit a checkpoint: the writer records where every part's data lies and writes metadata.

    For ``FileSystemWriter`` this writes ``.metadata.tmp`` and renames it to ``.metadata``; its
    presence is what makes the directory a checkpoint, so call this only after every part
    succeeded.

    Args:
        global_metadata: the merged metadata of all parts (:func:`merge_metadata`).
        all_writes: every part's ``WriteResult`` list, one list per part.
        storage_writer: the writer; ``finish`` fills ``storage_data`` from ``all_writes``.

    Returns:
        The committed metadata.
    """
    log = _compat.dcp_method_logger(**_logger_kwargs(storage_writer))

    @log
    def finish_checkpoint() -> Metadata:
        storage_writer.finish(metadata=global_metadata, results=[list(w) for w in all_writes])
        return global_metadata

    return finish_checkpoint()


def merge_metadata(metadatas: Iterable[Metadata]) -> Metadata:
    """Merge the metadata of disjoint parts into one.

    ``state_dict_metadata``, ``planner_data`` and ``storage_data`` are unions. Keys must be
    disjoint across parts, except that parts may hold different chunks of one tensor (same size
    and dtype, different offsets): its ``chunks`` are then joined. Any other key found in two
    parts raises ``ValueError`` rather than letting one silently shadow the other.

    Raises:
        ValueError: no metadata was given, or two parts hold the same key.
    """
    metadatas = list(metadatas)
    if not metadatas:
        raise ValueError("merge_metadata needs at least one Metadata")
    state_dict_metadata: dict[str, Any] = {}
    planner_data: dict[str, Any] = {}
    storage_data: dict[Any, Any] = {}
    for metadata in metadatas:
        for key, meta in metadata.state_dict_metadata.items():
            seen = state_dict_metadata.get(key)
            if seen is None:
                state_dict_metadata[key] = meta
            elif (
                isinstance(seen, TensorStorageMetadata)
                and isinstance(meta, TensorStorageMetadata)
                and _chunks_of_one_tensor(seen, meta)
            ):
                # a split tensor: its chunks come from several parts
                state_dict_metadata[key] = dataclasses.replace(seen, chunks=[*seen.chunks, *meta.chunks])
            else:
                raise ValueError(f"parts are not disjoint: {key!r} appears in two parts")
        planner_data.update(metadata.planner_data or {})
        storage_data.update(metadata.storage_data or {})
    return Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=planner_data,
        storage_data=storage_data or None,
    )


def _chunks_of_one_tensor(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` describe disjoint chunks of the same tensor."""
    if not (isinstance(a, TensorStorageMetadata) and isinstance(b, TensorStorageMetadata)):
        return False
    if a.size != b.size or a.properties.dtype != b.properties.dtype:
        return False
    offsets = {tuple(c.offsets) for c in a.chunks}
    return all(tuple(c.offsets) not in offsets for c in b.chunks)


def load_metadata(storage_reader: StorageReader) -> Metadata:
    """Read a checkpoint's global metadata through ``storage_reader``.

    Note that ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle``: only read
    checkpoints you trust this way.
    """
    log = _compat.dcp_method_logger(**_logger_kwargs(storage_reader))

    @log
    def read_metadata() -> Metadata:
        return storage_reader.read_metadata()

    return read_metadata()


def partial_load(
    metadata: Metadata,
    storage_reader: StorageReader,
    planner: LoadPlanner | None = None,
    *,
    state_dict: StateDict | None = None,
    trust_pickle: bool = False,
) -> StateDict:
    """Load the keys that ``metadata`` describes (see :func:`extract_metadata`) into a new dict.

    Args:
        metadata: the metadata of the keys to load, with their ``storage_data``.
        storage_reader: where to read from.
        planner: a ``LoadPlanner``; by default one that fills an empty dict with every key of
            ``metadata``, with the nesting that ``planner_data`` records, and unpickles
            non-tensor values with ``weights_only=True`` (DCP's own planners use
            ``weights_only=False``, which runs a hostile checkpoint's code).
        trust_pickle: let the default planner unpickle values that need more than
            ``weights_only=True`` (only for checkpoints you trust).
        state_dict: a dict to load into, whose preallocated tensors are filled in place (use
            it with a planner such as ``DefaultLoadPlanner``); a new empty dict when None.

    Returns:
        The loaded state dict; non-tensor values are unpickled.

    Raises:
        UnsafeCheckpointError: (default planner) a value needs more than ``weights_only=True``.
    """
    from parallel_dcp.storage.metadata import safe_empty_planner

    state_dict = {} if state_dict is None else state_dict
    planner = safe_empty_planner(trust_pickle) if planner is None else planner
    log = _compat.dcp_method_logger(**_logger_kwargs(storage_reader))

    @log
    def local_step() -> Any:
        planner.set_up_planner(state_dict, metadata, True)
        storage_reader.set_up_storage_reader(metadata, True)
        return storage_reader.prepare_local_plan(planner.create_local_plan())

    @log
    def global_step(local_plan: Any) -> Any:
        plans = planner.create_global_plan([local_plan])
        return storage_reader.prepare_global_plan(plans)[0]

    @log
    def read_data(plan: Any) -> None:
        reads = storage_reader.read_data(planner.finish_plan(plan), planner)
        reads.wait()

    read_data(global_step(local_step()))
    return state_dict


def extract_metadata(keys: Iterable[str], metadata: Metadata) -> Metadata:
    """Return the part of ``metadata`` that describes ``keys`` (flattened names) only.

    ``state_dict_metadata``, ``storage_data`` and ``planner_data`` are filtered together, so the
    result can drive :func:`partial_load` of just those keys.

    Raises:
        KeyError: a key is not in the checkpoint (all missing keys are named).
    """
    wanted = set(keys)
    missing = wanted - metadata.state_dict_metadata.keys()
    if missing:
        raise KeyError(f"not in the checkpoint: {sorted(missing)[:8]}")
    planner_data = metadata.planner_data or {}
    return Metadata(
        state_dict_metadata={k: v for k, v in metadata.state_dict_metadata.items() if k in wanted},
        storage_data={i: s for i, s in (metadata.storage_data or {}).items() if i.fqn in wanted},
        planner_data={k: v for k, v in planner_data.items() if k in wanted},
    )
