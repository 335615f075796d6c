"""Optional peers: NVIDIA's multi-process DCP writer, run when its package is installed.

``nvidia_resiliency_ext.checkpointing.async_ckpt`` (nvidia-resiliency-ext, tested with 0.4.1)
holds ``FileSystemWriterAsync``: it deals the write items into n buckets, forks n processes that
each write one file with DCP's ``_write_item`` (torch.save records, CRC on, always fsynced), and
commits ``.metadata`` from the caller. It is what Megatron-LM's ``torch_dist`` checkpoints use.
It is driven here as its own synchronous path does: plan, call the save function in this process,
finalize. That path needs a ``torch.distributed`` process group; a one-rank gloo group on an
in-process ``HashStore`` serves (no sockets are connected).

megatron-core ships its own copy of the same writer; its ``save_state_dict_async_finalize`` calls
``torch.cuda.current_device()``, so it cannot run on a CPU-only torch. It gets a row that says so.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import queue
from typing import Any

import torch
import torch.distributed as dist

from parallel_dcp.benchmark.measure import Case

__all__ = ["close", "peer_cases"]

_NVRX = "nvidia_resiliency_ext.checkpointing.async_ckpt"
_MEGATRON = "megatron.core.dist_checkpointing.strategies"
_SYNC_NOTE = "always fsyncs its data files (use_fsync=True is fixed inside)"
# Whether this module started the process group (then it also ends it).
_state = {"own_group": False}


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _import(package: str) -> tuple[Any, Any] | str:
    """(filesystem_async, state_dict_saver) of ``package``, or why they cannot be imported."""
    try:
        return (
            importlib.import_module(f"{package}.filesystem_async"),
            importlib.import_module(f"{package}.state_dict_saver"),
        )
    except ImportError as exc:
        return f"not installed ({exc.name or exc})"
    except Exception as exc:  # a peer that breaks on import is reported, not fatal
        return f"cannot be imported ({type(exc).__name__}: {exc})"


def _ensure_process_group() -> None:
    if dist.is_initialized():
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one rank talks to nobody; keep it on loopback
    store = dist.HashStore()  # type: ignore[attr-defined]  # exported at run time, not in the stubs
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    _state["own_group"] = True


def close() -> None:
    """End the process group this module started, if any."""
    if _state["own_group"] and dist.is_initialized():
        dist.destroy_process_group()
    _state["own_group"] = False


def _nvrx_save(modules: tuple[Any, Any], state_dict: Any, out: str, writers: int, sync: bool) -> None:
    filesystem_async, saver = modules
    _ensure_process_group()
    if filesystem_async._results_queue is None:
        # Its result queue lives in a spawned Manager process so that an asynchronous caller
        # process can hand results back; the save function runs in this process here, so a
        # plain queue carries the one message and no Manager process outlives the benchmark.
        filesystem_async._results_queue = queue.Queue()
    writer = filesystem_async.FileSystemWriterAsync(out, thread_count=writers, sync_files=sync)
    planned = saver.save_state_dict_async_plan(state_dict, writer)
    writer, metadata, wrapper = planned[0] if isinstance(planned[0], tuple) else planned
    save_fn, _preload_fn, args = writer.get_save_function_and_args()
    if save_fn is not None:  # _preload_fn copies GPU tensors to the host: none here
        save_fn(*args)
    saver.save_state_dict_async_finalize(writer, metadata, wrapper)


def _nvrx_case(state_dict: Any, writers: int, sync: bool, modules: tuple[Any, Any] | str) -> Case:
    name = f"nvrx w={writers}"
    if isinstance(modules, str):
        reason = f"nvidia-resiliency-ext {modules}: pip install nvidia-resiliency-ext"
        return Case(name=name, family="nvrx", procs=writers, run=_not_run, core=False, unavailable=reason)
    found = modules

    def run(out: str) -> None:
        _nvrx_save(found, state_dict, out, writers, sync)

    return Case(
        name=name,
        family="nvrx",
        procs=writers,
        run=run,
        baseline=f"stock dcp t={writers}",
        limit=f"plain write x{writers}",
        note="" if sync else _SYNC_NOTE,
        core=False,
    )


def _megatron_case() -> Case:
    modules = _import(_MEGATRON)
    if isinstance(modules, str):
        reason = f"megatron-core {modules}; its writer is a copy of the nvrx one"
    elif not torch.cuda.is_available():
        reason = (
            f"megatron-core {_version('megatron-core')}: save_state_dict_async_finalize calls "
            "torch.cuda.current_device(), and this torch has no CUDA; its writer is a copy of the nvrx one"
        )
    else:
        reason = "megatron-core: its FileSystemWriterAsync is a copy of the nvrx one, measured there"
    return Case(name="megatron-core", family="megatron-core", procs=0, run=_not_run, core=False, unavailable=reason)


def _not_run(out: str) -> None:
    raise RuntimeError("not run")


def peer_cases(state_dict: Any, workers: list[int], sync: bool) -> list[Case]:
    """The nvrx writer at every count in ``workers`` (or one row saying why not), and the megatron-core row."""
    modules = _import(_NVRX)
    if isinstance(modules, str):
        cases = [_nvrx_case(state_dict, max(workers), sync, modules)]
    else:
        cases = [_nvrx_case(state_dict, n, sync, modules) for n in workers]
    return [*cases, _megatron_case()]


def versions() -> dict[str, str]:
    """Installed versions of the peers' packages (``"?"`` when absent)."""
    return {name: _version(name) for name in ("nvidia-resiliency-ext", "megatron-core")}
