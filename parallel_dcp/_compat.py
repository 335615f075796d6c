"""Guarded access to the private torch and fsspec names that parallel_dcp relies on.

This is the only module that names them (``tests/test_architecture.py`` holds every other module
to that). :func:`check_torch` looks every one of them up when ``parallel_dcp`` is imported, so a
torch or fsspec upgrade that moves or renames one fails at once with a clear
:class:`IncompatibleTorchError` naming it and the installed version, instead of an
``AttributeError`` from deep inside a worker, or an ``UnsafeCheckpointError`` for a class the
metadata allow-list no longer finds.

Longer than 300 lines because every use of a private name lives here, with the fallback for a torch
without it: the layout check's guard (:class:`LayoutGuard`, torch.compile's ``TensorGuards``) too.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from parallel_dcp.errors import IncompatibleTorchError

MIN_TORCH = "2.4"

_F = TypeVar("_F", bound=Callable[..., Any])


def _private(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise IncompatibleTorchError(
            f"parallel_dcp needs {module}.{name}, which torch {torch.__version__} does not have; "
            f"parallel_dcp supports torch >= {MIN_TORCH} (tested on 2.13). "
            "Install a supported torch or report this torch version."
        ) from exc


# The private classes and functions a DCP ``.metadata`` pickle refers to, beside public ones: the
# metadata allow-list (storage/metadata.py) admits them by these names.
METADATA_PRIVATE_NAMES: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({"_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
}


def strip_protocol(fs: Any, url: str) -> str:
    """The path an fsspec filesystem's calls take for ``url`` (``bucket/key`` for ``s3://...``)."""
    stripped: str = type(fs)._strip_protocol(url)
    return str(stripped)


class NoExistingCheckpointProbe:
    """Mixed into a ``FileSystemWriter`` that never commits (a shard writer): its probe for a
    ``.metadata`` beside it, which only feeds an "overwriting" warning, always says there is none
    (on object storage the live checkpoint's ``.metadata`` is there during an overwrite)."""

    def _metadata_exists(self) -> bool:
        return False


def storage_prefix(prefix: str) -> Any:
    """Build the ``storage_data`` that tells ``FileSystemWriter`` which file prefix to use."""
    return _private("torch.distributed.checkpoint.filesystem", "_StoragePrefix")(prefix)


def storage_info_class() -> Any:
    """DCP's ``_StorageInfo``: where one record of a shard lies, as ``FileSystemWriter`` records it
    (``cls(relative_path, offset, length)``). Look it up once per job, not once per key."""
    return _private("torch.distributed.checkpoint.filesystem", "_StorageInfo")


def storage_info(relative_path: str, offset: int, length: int, transform_descriptors: list[str] | None = None) -> Any:
    """One ``_StorageInfo`` (see :func:`storage_info_class`); ``transform_descriptors`` (such as
    ``["stream.zstd/1"]``, a compressed record) is left out when None, as stock leaves it out."""
    cls = storage_info_class()
    if transform_descriptors is None:
        return cls(relative_path, offset, length)
    return cls(relative_path, offset, length, transform_descriptors=transform_descriptors)


def check_transform_descriptors() -> None:
    """Compressed records need a ``_StorageInfo`` with ``transform_descriptors`` (torch >= 2.7).

    Raises:
        IncompatibleTorchError: this torch's DCP cannot record (or read) compressed records.
    """
    fields = getattr(storage_info_class(), "__dataclass_fields__", {})
    if "transform_descriptors" not in fields:
        raise IncompatibleTorchError(
            f"compressed checkpoints need torch's DCP _StorageInfo.transform_descriptors, which torch "
            f"{torch.__version__} does not have (tested on 2.13)"
        )


def empty_state_dict_load_planner() -> Any:
    """The planner that loads every key of a metadata into an empty dict."""
    return _private("torch.distributed.checkpoint.default_planner", "_EmptyStateDictLoadPlanner")()


def flatten_state_dict(state_dict: Any) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """DCP's own flattening, so that our keys and ``planner_data`` match what DCP readers expect."""
    return _private("torch.distributed.checkpoint._nested_dict", "flatten_state_dict")(state_dict)  # type: ignore[no-any-return]


def unflatten_state_dict(flat: dict[str, Any], mapping: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """Restore nesting from ``planner_data``."""
    return _private("torch.distributed.checkpoint._nested_dict", "unflatten_state_dict")(flat, mapping)  # type: ignore[no-any-return]


def set_element(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """DCP's own setter of a nested element (as ``DefaultLoadPlanner.load_bytes`` uses it)."""
    _private("torch.distributed.checkpoint._traverse", "set_element")(root, path, value)


def dcp_method_logger(**kwargs: Any) -> Callable[[_F], _F]:
    """DCP's event logger where torch has it; logging only, so a plain pass-through otherwise."""
    try:
        from torch.distributed.checkpoint.logger import _dcp_method_logger
    except ImportError:
        return lambda func: func
    return _dcp_method_logger(**kwargs)  # type: ignore[no-any-return,return-value]


def set_crc32(enabled: bool) -> None:
    """Turn the per-record CRC32 of ``torch.save`` on or off for the calling thread.

    DCP writes every tensor as a ``torch.save`` zip record, and the CRC32 of those records costs
    about two thirds of a save's time while no DCP reader ever checks it. Older torch always
    computes it; there this is a no-op.
    """
    setter = getattr(torch.serialization, "set_crc32_options", None)
    if setter is not None:
        setter(enabled)


def checkpoint_offset(storage: Any) -> int | None:
    """Where the bytes of a storage that ``torch.load(map_location="meta")`` built start in its
    file (torch records it as ``_checkpoint_offset``); None when this torch does not say."""
    offset = getattr(storage, "_checkpoint_offset", None)
    return offset if isinstance(offset, int) else None


@functools.cache
def check_torch() -> None:
    """Fail early, in the caller, if any private name this module uses is missing."""
    _private("torch.distributed.checkpoint.filesystem", "_StoragePrefix")
    _private("torch.distributed.checkpoint.filesystem", "_StorageInfo")
    _private("torch.distributed.checkpoint.default_planner", "_EmptyStateDictLoadPlanner")
    _private("torch.distributed.checkpoint._nested_dict", "flatten_state_dict")
    _private("torch.distributed.checkpoint._nested_dict", "unflatten_state_dict")
    _private("torch.distributed.checkpoint._traverse", "set_element")
    for module, names in METADATA_PRIVATE_NAMES.items():
        for name in names:
            _private(module, name)
    _private("torch.distributed.checkpoint.filesystem", "FileSystemWriter")
    if not hasattr(_private("torch.distributed.checkpoint.filesystem", "FileSystemWriter"), "_metadata_exists"):
        raise IncompatibleTorchError(
            f"parallel_dcp needs FileSystemWriter._metadata_exists, which torch {torch.__version__} does not have"
        )
    _check_fsspec()


def _check_fsspec() -> None:
    import fsspec
    from fsspec.spec import AbstractFileSystem

    if not callable(getattr(AbstractFileSystem, "_strip_protocol", None)):
        raise IncompatibleTorchError(
            f"parallel_dcp needs fsspec's AbstractFileSystem._strip_protocol, which fsspec {fsspec.__version__} "
            "does not have; install a supported fsspec (tested on 2026.9)"
        )


# multiprocess's fork server and resource tracker (parallel_dcp.Saver starts them, and stops them
# again unless they ran before).
def fork_server_pid() -> int | None:
    """The fork server's process id while it runs."""
    import multiprocess.forkserver

    pid = getattr(getattr(multiprocess.forkserver, "_forkserver", None), "_forkserver_pid", None)
    return pid if isinstance(pid, int) else None


def running_servers() -> tuple[bool, bool]:
    """Whether the fork server and the resource tracker (which the fork server starts) run now."""
    import multiprocess.forkserver
    import multiprocess.resource_tracker

    server = getattr(multiprocess.forkserver, "_forkserver", None)
    tracker = getattr(multiprocess.resource_tracker, "_resource_tracker", None)
    return getattr(server, "_forkserver_pid", None) is not None, getattr(tracker, "_pid", None) is not None


def stop_fork_server(running_before: tuple[bool, bool]) -> None:
    """Stop the fork server and the resource tracker, each unless it ran before we used it (it
    may serve the caller's own processes, shared memory or semaphores), so no process is left.
    Each starts again on its next use."""
    import multiprocess.forkserver
    import multiprocess.resource_tracker

    server_before, tracker_before = running_before
    if not server_before:
        server: Any = getattr(multiprocess.forkserver, "_forkserver", None)
        stop = getattr(server, "_stop", None)
        if stop is not None:
            try:
                stop()
            except FileNotFoundError:
                # At the interpreter's exit (a Saver never closed), multiprocess may have removed
                # its temporary folder, the server's socket with it, before this runs: the server
                # was stopped all the same, only its socket's name is left to forget.
                server._forkserver_address = None
    if not tracker_before:
        stop = getattr(getattr(multiprocess.resource_tracker, "_resource_tracker", None), "_stop", None)
        if stop is not None:
            stop()


def forget_inherited_fork_server() -> None:
    """In a forked child: drop the parent's fork server (it is the parent's child, not ours: using
    it fails, and our copy of its "alive" descriptor would keep it running after the parent stops
    it). The child's next use starts its own. Run after every fork (os.register_at_fork)."""
    import multiprocess.forkserver

    server = getattr(multiprocess.forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", None) is None:
        return
    alive = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(alive, int):
        with contextlib.suppress(OSError):
            os.close(alive)
    server._forkserver_address = None
    server._forkserver_alive_fd = None
    server._forkserver_pid = None
    server._lock = threading.Lock()


# Tensors per TensorGuards of a LayoutGuard: a chunk's objects (each tensor's Python object, its
# TensorImpl, its storage) stay in the cache from the layout check's data_ptr pass to the guard's
# (jobs/plan_reuse.py): 28.3 -> 20.8 ms for both over 50,000 small tensors, cache cold, against
# each pass over all of them in turn.
GUARD_CHUNK = 512


class LayoutGuard:
    """A check, in C++, that a list of objects are tensors laid out as the ``tensors`` it was made
    from (:func:`layout_guard`): ``guard(later)`` checks them all; ``guard.part(later, k)`` only
    ``later[k * chunk:(k + 1) * chunk]`` (ties into that range included), so that a caller can
    check chunk by chunk beside its own passes over the same tensors. A list is as ``tensors``
    where every part says True."""

    def __init__(
        self,
        guards: list[Any],
        uniques: list[list[int] | None],
        ties: list[list[tuple[int, int]]],
        count: int,
        chunk: int,
    ) -> None:
        self._guards, self._uniques, self._ties = guards, uniques, ties
        self.count, self.chunk = count, chunk

    def __call__(self, later: Sequence[Any]) -> bool:
        return len(later) == self.count and all(self.part(later, k) for k in range(len(self._guards)))

    def part(self, later: Sequence[Any], k: int) -> bool:
        """Whether ``later``'s ``k``-th chunk (and each tie into it) is as ``tensors``' was
        (``later``: the whole list, of ``count`` objects)."""
        if not all(later[i] is later[place] for i, place in self._ties[k]):
            return False
        unique = self._uniques[k]
        try:
            if unique is None:  # no tie in this chunk: its places in order
                return bool(self._guards[k].check(*later[k * self.chunk : (k + 1) * self.chunk]))
            return bool(self._guards[k].check(*map(later.__getitem__, unique)))
        except Exception:  # a tensor it cannot read
            return False


def layout_guard(
    tensors: Sequence[torch.Tensor], sizes: Sequence[Sequence[int]], strides: Sequence[Sequence[int]]
) -> LayoutGuard | None:
    """A check, in C++ passes, that a list of objects are tensors laid out as ``tensors`` are:
    ``check(later)`` is True only where ``later[i]`` has the exact type of ``tensors[i]``, its dtype,
    device, dispatch keys and ``requires_grad``, and the shape ``sizes[i]`` and strides
    ``strides[i]`` (which the caller took from ``tensors[i]``); False where anything differs, or
    the check itself fails (the caller then compares as it would without one). torch.compile's own
    guard on a frame's tensors (``torch._C._dynamo.guards.TensorGuards``), one per
    ``GUARD_CHUNK`` places (see :class:`LayoutGuard`), which keeps no reference to the tensors;
    None where this torch has none, or it refuses these tensors.

    A Python pass over the tensors costs 0.1-0.2 us a tensor in each attribute read (a method call
    and an object made per tensor: ``dtype``, ``shape``, ``stride()``); this reads them all at once
    (jobs/plan_reuse.py's layout check, 50,000 tensors per save).

    TensorGuards answers False for a tensor object passed twice (two keys of one tensor: tied
    weights); each object is passed once, at its first place, and a later list must hold one
    object at the places where ``tensors`` did (else False: a tie undone is the Python check's to
    judge)."""
    first: dict[int, int] = {}
    places = [first.setdefault(id(tensor), i) for i, tensor in enumerate(tensors)]
    chunk, count = GUARD_CHUNK, len(tensors)
    guards: list[Any] = []
    uniques: list[list[int] | None] = []
    ties: list[list[tuple[int, int]]] = []
    try:
        from torch._C._dynamo.guards import TensorGuards

        for start in range(0, count, chunk):
            span = range(start, min(start + chunk, count))
            unique = [i for i in span if places[i] == i]
            ties.append([(i, places[i]) for i in span if places[i] != i])
            uniques.append(None if len(unique) == len(span) else unique)
            # Per tensor, a list of its sizes (strides); torch's stub says one optional SymInt each.
            each_size: Any = [list(sizes[i]) for i in unique]
            each_stride: Any = [list(strides[i]) for i in unique]
            guards.append(
                TensorGuards(
                    *[tensors[i] for i in unique], dynamic_dims_sizes=each_size, dynamic_dims_strides=each_stride
                )
            )
    except Exception:  # an older torch, or tensors it cannot describe: no fast check
        return None
    return LayoutGuard(guards, uniques, ties, count, chunk)
