"""parallel_dcp: write and read PyTorch Distributed Checkpoints with a pool of worker processes.

The output is a stock DCP checkpoint: ``torch.distributed.checkpoint.load`` and every other DCP
reader open it unchanged.

    >>> import parallel_dcp, torch
    >>> result = parallel_dcp.save({"w": torch.ones(4)}, "/tmp/ckpt", overwrite=True)
    >>> parallel_dcp.load("/tmp/ckpt")["w"].sum().item()
    4.0

This module is the facade: every public name and ``__all__``. The public functions, each with its
full contract (arguments, results, errors), live in ``parallel_dcp/api/`` (one module per job);
their logic is in ``parallel_dcp/jobs/``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# First: a Ctrl-C while the command imports the rest is one line, not a traceback.
from parallel_dcp import _command_start as _command_start
from parallel_dcp._version import __version__ as __version__
from parallel_dcp.api import _check_torch
from parallel_dcp.api.convert import convert as convert
from parallel_dcp.api.convert import presets as presets
from parallel_dcp.api.inspect import diff as diff
from parallel_dcp.api.inspect import inspect as inspect
from parallel_dcp.api.load import load as load
from parallel_dcp.api.save import save as save
from parallel_dcp.api.saver import Saver as Saver
from parallel_dcp.api.verify import verify as verify
from parallel_dcp.errors import (
    CheckpointExistsError,
    CompressionUnavailableError,
    ConfigMismatchError,
    CorruptCheckpointError,
    DestinationBusyError,
    DistributedJobError,
    IncompatibleTorchError,
    InsufficientSpaceError,
    InvalidDestinationError,
    InvalidStateDictError,
    KeyNotFoundError,
    KeyPatternError,
    MemoryLimitExceeded,
    ParallelDCPError,
    PresetError,
    QuantizationError,
    RemoteTraceback,
    RenameError,
    RenameWarning,
    ResumeError,
    SourceChecksumError,
    SourceNotCheckedWarning,
    TaskTimeoutError,
    UnsafeCheckpointError,
    WorkerCrashed,
    WorkerError,
)
from parallel_dcp.options import Options

# torch and the jobs are imported on first use, not here: ``parallel-dcp --help`` and usage errors
# then answer without the seconds torch takes to import. The names below are served by
# ``__getattr__``; the public functions import their job modules when called.
if TYPE_CHECKING:
    from parallel_dcp.formats.fast_read import ReadStats
    from parallel_dcp.formats.fast_reader import FastReader
    from parallel_dcp.jobs.diff import DiffReport
    from parallel_dcp.jobs.dryrun import DryRunPlan
    from parallel_dcp.jobs.pipeline import SaveResult, WorkerStats
    from parallel_dcp.jobs.preset_defs import PRESETS, Preset
    from parallel_dcp.jobs.rename import RenameRules as RenameRules
    from parallel_dcp.jobs.verify import VerifyReport
    from parallel_dcp.partial import (
        commit,
        extract_metadata,
        load_metadata,
        merge_metadata,
        partial_load,
        partial_save,
    )

_LAZY = {
    "ReadStats": "parallel_dcp.formats.fast_read",
    "FastReader": "parallel_dcp.formats.fast_reader",
    "DiffReport": "parallel_dcp.jobs.diff",
    "DryRunPlan": "parallel_dcp.jobs.dryrun",
    "SaveResult": "parallel_dcp.jobs.pipeline",
    "WorkerStats": "parallel_dcp.jobs.pipeline",
    "RenameRules": "parallel_dcp.jobs.rename",
    "PRESETS": "parallel_dcp.jobs.preset_defs",
    "Preset": "parallel_dcp.jobs.preset_defs",
    "VerifyReport": "parallel_dcp.jobs.verify",
    **dict.fromkeys(
        ("commit", "extract_metadata", "load_metadata", "merge_metadata", "partial_load", "partial_save"),
        "parallel_dcp.partial",
    ),
}


def __getattr__(name: str) -> Any:
    """The exported classes and seed functions, imported (with torch) the first time one is asked for."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'parallel_dcp' has no attribute {name!r}")
    _check_torch()
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "PRESETS",
    "CheckpointExistsError",
    "CompressionUnavailableError",
    "ConfigMismatchError",
    "CorruptCheckpointError",
    "DestinationBusyError",
    "DiffReport",
    "DistributedJobError",
    "DryRunPlan",
    "FastReader",
    "IncompatibleTorchError",
    "InsufficientSpaceError",
    "InvalidDestinationError",
    "InvalidStateDictError",
    "KeyNotFoundError",
    "KeyPatternError",
    "MemoryLimitExceeded",
    "Options",
    "ParallelDCPError",
    "Preset",
    "PresetError",
    "QuantizationError",
    "ReadStats",
    "RemoteTraceback",
    "RenameError",
    "RenameWarning",
    "ResumeError",
    "SaveResult",
    "Saver",
    "SourceChecksumError",
    "SourceNotCheckedWarning",
    "TaskTimeoutError",
    "UnsafeCheckpointError",
    "VerifyReport",
    "WorkerCrashed",
    "WorkerError",
    "WorkerStats",
    "commit",
    "convert",
    "diff",
    "extract_metadata",
    "inspect",
    "load",
    "load_metadata",
    "merge_metadata",
    "partial_load",
    "partial_save",
    "presets",
    "save",
    "verify",
]
