"""One exception tree for everything parallel_dcp raises.

Every error a user can see derives from :class:`ParallelDCPError`, so one ``except`` catches
them all. Errors that come from a worker carry the diagnosis with them: the task's keys, the
worker's exit code or signal, and the worker's own traceback as ``__cause__``.

Longer than 300 lines because the tree is one place by design: a user reads every error the
package can raise, and what each one carries, in one file.
"""

from __future__ import annotations

import re
import signal
import unicodedata
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CheckpointExistsError",
    "CompressionUnavailableError",
    "ConfigMismatchError",
    "CorruptCheckpointError",
    "DestinationBusyError",
    "DistributedJobError",
    "IncompatibleTorchError",
    "InsufficientSpaceError",
    "InvalidDestinationError",
    "InvalidStateDictError",
    "KeyNotFoundError",
    "KeyPatternError",
    "MemoryLimitExceeded",
    "ParallelDCPError",
    "QuantizationError",
    "RemoteTraceback",
    "ResumeError",
    "SourceChecksumError",
    "SourceNotCheckedWarning",
    "StalePlan",
    "TaskTimeoutError",
    "UnsafeCheckpointError",
    "WorkerCrashed",
    "WorkerError",
]

_KEYS_SHOWN = 10  # names an error lists before '... and N more' (describe_keys)
# A row range of one tensor, as the planners name it: ``key[dim:start:stop]`` (a ``'`` is added
# when a key already has that name).
_CHUNK_UNIT = re.compile(r"(?P<key>.*)\[(?P<dim>\d+):(?P<start>\d+):(?P<stop>\d+)\]'*", re.DOTALL)
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """``text`` with every control or format character escaped (``\\x1b``, ``\\n``, ``\\u202e``), so
    that a name read from a checkpoint can neither drive a terminal nor forge a line of output."""
    if text.isprintable():
        return text
    out = []
    for char in text:
        if unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn") and char != " ":
            code = ord(char)
            out.append(_ESCAPES.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"))
        else:
            out.append(char)
    return "".join(out)


def key_name(key: str) -> str:
    """A key in a listing: escaped as :func:`printable`, and the empty key (what ``load`` names a
    torch.save file's object that is not a mapping) shown as ``''``, not as nothing."""
    return printable(key) if key else "''"


def dtype_name(dtype: object) -> str:
    """A dtype as the CLI spells it (``bfloat16``, not ``torch.bfloat16``), in every message."""
    return str(dtype).removeprefix("torch.")


def plural(count: int, singular: str, many: str | None = None) -> str:
    """``"1 file"``, ``"2 files"``: ``count`` and the noun it takes."""
    return f"{count} {singular if count == 1 else (many or singular + 's')}"


def describe_unit(name: str, *, quote: bool = True) -> str:
    """A unit of work as a user reads it: a key (quoted, control characters escaped) or, for a row
    range ``key[dim:start:stop]``, which rows of which dimension it covers, in words. ``quote``:
    ``repr`` the key (in messages); else only escape it (in listings)."""
    match = _CHUNK_UNIT.fullmatch(name)
    key = match["key"] if match is not None else name
    shown = repr(key) if quote else printable(key)
    if match is None:
        return shown
    dim, start, stop = int(match["dim"]), int(match["start"]), int(match["stop"])
    return f"{shown} (one chunk: rows {start} to {stop - 1} along dimension {dim})"


def describe_keys(keys: Sequence[str]) -> str:
    """Return a short, readable list of keys: the first few and a count of the rest."""
    shown = ", ".join(describe_unit(k) for k in keys[:_KEYS_SHOWN])
    rest = len(keys) - _KEYS_SHOWN
    return f"[{shown}, ... and {rest} more]" if rest > 0 else f"[{shown}]"


def describe_exit(exitcode: int | None) -> str:
    """Name a process exit status the way a user reads it: ``SIGKILL(-9)`` or ``exit code 3``."""
    if exitcode is None:
        return "no exit status"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "signal"
        return f"{name}({exitcode})"
    return f"exit code {exitcode}"


class ParallelDCPError(Exception):
    """Base class of every error parallel_dcp raises.

    Every message is built here, once: control and format characters in it are escaped
    (:func:`printable`), so a name read from disk (a shard name with a line break, a planted lock
    record) can never forge a line of output nor drive a terminal. A message that lists things
    passes them as ``lines``: each shown on a line of its own, escaped the same way.
    """

    def __init__(self, *args: Any, lines: Sequence[str] = ()) -> None:
        escaped = tuple(printable(arg) if isinstance(arg, str) else arg for arg in args)
        if lines:
            first = escaped[0] if escaped else ""
            escaped = (str(first) + "".join("\n" + printable(line) for line in lines), *escaped[1:])
        super().__init__(*escaped)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from the message as built (its lines kept), not by escaping it again.
        return (_restore, (type(self), self.args, self.__dict__))


def _restore(cls: type[ParallelDCPError], args: tuple[Any, ...], state: dict[str, Any]) -> ParallelDCPError:
    error = cls.__new__(cls, *args)
    super(ParallelDCPError, error).__init__(*args)
    error.__dict__.update(state)
    return error


class IncompatibleTorchError(ParallelDCPError, ImportError):
    """The installed torch lacks a DCP internal that parallel_dcp relies on."""


class CompressionUnavailableError(ParallelDCPError, ImportError):
    """Compression was asked for, or a compressed checkpoint is read, without the ``zstandard``
    package (``pip install '.[zstd]'`` in a checkout)."""


class InvalidStateDictError(ParallelDCPError, ValueError):
    """The input cannot be saved as given; raised before anything is written."""


class KeyNotFoundError(ParallelDCPError, KeyError):
    """Keys asked for are not there: names the checkpoint (or ``into``) lacks, or patterns that
    select nothing; ``keys`` lists them. A ``KeyError`` too, so callers that caught the bare one
    still do; its message reads as a sentence (a ``KeyError`` would quote it)."""

    def __init__(self, message: str, *, keys: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.keys = list(keys)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class KeyPatternError(ParallelDCPError, ValueError):
    """A key pattern that cannot be used: a ``re:`` pattern that is not a regular expression."""


class CheckpointExistsError(ParallelDCPError, FileExistsError):
    """The destination already holds a checkpoint and ``overwrite`` was not set."""


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback; attached as ``__cause__`` of a worker error."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"\n\n--- traceback in the worker ---\n{self.text}"


class WorkerError(ParallelDCPError):
    """A task raised inside a worker. ``__cause__`` holds the worker's traceback."""

    def __init__(self, message: str, *, worker: int, keys: Sequence[str], error_type: str) -> None:
        super().__init__(message)
        self.worker = worker
        self.keys = list(keys)
        self.error_type = error_type


class StalePlan(WorkerError):
    """A Saver's save whose tasks went out on the plan of the save before (speculatively, while the
    coordinator checked the layout) found it stale: the layout changed, or a worker could not copy
    a tensor where the plan said it lay (the caller freed or moved it: ``StaleRead``). Every task
    sent was waited for, so the workers stay usable; the save discards what they wrote and runs
    as a save of a new layout does. Seen by a caller only where a save that was not speculative
    hit a stale read (a tensor freed while it ran): ``worker`` -1 where the coordinator found it."""


class WorkerCrashed(ParallelDCPError):
    """A worker process died (a signal such as SIGKILL from the OOM killer, or an exit)."""

    def __init__(self, message: str, *, worker: int, keys: Sequence[str], exitcode: int | None) -> None:
        super().__init__(message)
        self.worker = worker
        self.keys = list(keys)
        self.exitcode = exitcode


class InvalidDestinationError(ParallelDCPError, ValueError):
    """The destination cannot take a checkpoint (a file, a foreign directory, a missing parent)."""


class DestinationBusyError(InvalidDestinationError):
    """Another save holds the destination's lock; the message names its host, pid and save id."""


class CorruptCheckpointError(ParallelDCPError, ValueError):
    """A checkpoint file is truncated, corrupt or not what it claims to be."""


class SourceChecksumError(CorruptCheckpointError):
    """A conversion's source file is not the bytes its own checksums were taken of: damaged (a
    flipped byte, a truncated or replaced file), or rewritten on purpose since its record was
    written, which is then stale (the message says which it can be, and the way out of each). It
    names the file as given and, where that is a link, the file it leads to. Nothing of this
    source's output was written: its destination is as it was (with several sources, the outputs of
    those converted before it stay committed)."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A checkpoint's metadata asks to unpickle something outside the allow-list; it was not run."""


class MemoryLimitExceeded(ParallelDCPError, MemoryError):
    """The job would exceed, or exceeded, its memory limit; nothing was committed."""

    def __init__(
        self, message: str, *, limit: int, measured: int, keys: Sequence[str], worker: int | None = None
    ) -> None:
        super().__init__(message)
        self.limit = limit
        self.measured = measured
        self.keys = list(keys)
        self.worker = worker


class TaskTimeoutError(ParallelDCPError, TimeoutError):
    """A task ran longer than ``task_timeout``; its worker was killed and nothing was committed."""

    def __init__(self, message: str, *, worker: int, keys: Sequence[str], seconds: float) -> None:
        super().__init__(message)
        self.worker = worker
        self.keys = list(keys)
        self.seconds = seconds


class InsufficientSpaceError(ParallelDCPError, OSError):
    """The destination's file system cannot hold the checkpoint; raised before any write."""


class DistributedJobError(ParallelDCPError):
    """One or more ranks of a distributed job failed; ``failures`` maps each rank to its error.

    Raised on every rank, so every rank exits non-zero; nothing was committed.
    """

    def __init__(self, message: str, *, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = dict(failures)


class RenameError(ParallelDCPError, ValueError):
    """Rename rules are malformed, or map names onto each other or onto an invalid name.

    Raised before anything is written; ``collisions`` maps each offending output name to the
    source names that produced it (or to why it is invalid).
    """

    def __init__(
        self, message: str, *, collisions: dict[str, list[str]] | None = None, lines: Sequence[str] = ()
    ) -> None:
        super().__init__(message, lines=lines)
        self.collisions = dict(collisions or {})


class ResumeError(ParallelDCPError, ValueError):
    """``resume=True`` found a conversion it must not continue: other arguments (sources, keys,
    rename rules, dtype, format, shard or chunk size), a source changed since, a plan that no longer
    fits the memory limit, or a destination where resume is not supported. ``reasons`` lists why;
    nothing was written or removed."""

    def __init__(self, message: str, *, reasons: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.reasons = list(reasons)


class SourceNotCheckedWarning(UserWarning):
    """A conversion's source carries checksums that it converts without checking, named in the
    message: a record that cannot be read (a link, another tool's entry, a damaged record, one this
    user may not read), a sidecar beside a link's name only (written for whatever file that name
    held), a manifest left stale by a save stopped between its commit's two renames, files read
    with O_DIRECT, or a source on object storage; or a recorded documentation file (a model card)
    copied beside the weights with other bytes than recorded. ``verify`` reports the record;
    run it on the source where that matters."""


class RenameWarning(UserWarning):
    """A rename rule that matched no key of the source (it renamed nothing: a typo, or rules
    written for another model); the conversion goes on. The CLI prints it as one line."""


class QuantizationError(ParallelDCPError, ValueError):
    """A quantized checkpoint cannot be dequantized (or a tensor quantized) as asked: a weight
    without its scale or a scale without its weight, a scale whose shape does not match the
    weight's blocks, a non-FP8 weight beside a ``weight_scale_inv``, an E8M0 exponent of 255
    (NaN), or a bad ``quantize`` spec; or a plain conversion whose ``keys`` or ``rename`` would
    part a quantized weight from its scale. Raised before anything is written; ``keys`` names the
    offending tensors."""

    def __init__(self, message: str, *, keys: Sequence[str] = (), lines: Sequence[str] = ()) -> None:
        super().__init__(message, lines=lines)
        self.keys = list(keys)


class ConfigMismatchError(ParallelDCPError, ValueError):
    """The ``config.json`` beside a weights file named as the source describes another model (its
    model has none of the file's tensor names), and would decide what ``--dtype`` keeps in float32
    or what ``--quantize`` quantizes. Raised before anything is written; the message names the
    file, the config, its model, and what to do."""


class PresetError(RenameError):
    """A preset cannot convert this source as its client needs: a source key its rules do not
    cover, an output that would miss keys the client's model holds, or a missing or incomplete
    ``config.json``. Raised before anything is written; ``keys`` names the offending tensors."""

    def __init__(self, message: str, *, keys: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.keys = list(keys)
