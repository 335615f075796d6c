"""The ``parallel-dcp`` command (also ``python -m parallel_dcp``): convert, inspect, verify, bench.

Exit codes: 0 success, 1 failure (the error is printed on stderr; with ``verify``, any mismatch),
2 usage error, 130 interrupted. ``--json`` prints one JSON document on stdout for scripts. The
progress bar (stderr) shows only when stdout is a terminal and ``-q`` is not given.

The parser is built in :mod:`parallel_dcp.cli.parser` from each command's module (``convert``,
``inspect``, ``verify``, ``bench``: its flags and its run); shared flags in :mod:`~.flags`, what is
printed besides results in :mod:`~.messages`. This module runs one command and turns what it
raises into an exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Sequence

import parallel_dcp
from parallel_dcp.cli import bench, convert, inspect, interrupt, presets, verify
from parallel_dcp.cli.flags import FORMATS as FORMATS
from parallel_dcp.cli.flags import UsageError
from parallel_dcp.cli.messages import log_to_stderr, message, print_notes, show_warning
from parallel_dcp.cli.parser import build_parser, subparser_of, unknown_arguments
from parallel_dcp.errors import printable

# Nothing here imports torch (parallel_dcp's own imports are lazy): --help and usage errors answer
# at once, and a command imports what it runs when it runs.

__all__ = ["build_parser", "main"]

_STORAGE_MODULES = ("botocore", "aiobotocore", "s3fs", "fsspec", "aiohttp")

# torch.distributed.checkpoint warns on every save or load outside a process group; that is
# advice for a trainer, and parallel_dcp runs without a process group on purpose.
_TRAINER_WARNINGS = (r"torch\.distributed is disabled, unavailable or uninitialized",)


def _silence_trainer_warnings() -> None:
    """Hide torch's warnings meant for trainers, here and in the workers (forked after this)."""
    for text in _TRAINER_WARNINGS:
        warnings.filterwarnings("ignore", message=text)


def _stdout_closed() -> bool:
    """True when stdout's reader went away (``| head -1``): a pipe with no reader polls as an error."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)  # POLLERR and POLLHUP are always reported
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _quiet_broken_pipe() -> int:
    """End quietly after the reader of stdout closed it, as git does: exit 141 (128 + SIGPIPE),
    with stdout pointed at /dev/null so that the interpreter's last flush cannot fail again."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 141


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; warnings and the library's notes print as ``parallel-dcp:`` lines meanwhile.

    Ctrl-C at any instant is one line and exit code 130 (:mod:`~.interrupt`); called as the
    program (``argv`` None), a Ctrl-C after the command finished is ignored up to the exit."""
    previous = interrupt.install(program=argv is None)
    shown = warnings.showwarning
    warnings.showwarning = show_warning
    notes: list[logging.Handler] = []
    try:
        return _main(argv, notes)
    except KeyboardInterrupt:  # before the command ran (parsing its arguments)
        print("parallel-dcp: interrupted", file=sys.stderr)
        return 130
    finally:
        interrupt.finished()
        warnings.showwarning = shown
        for handler in notes:
            logging.getLogger("parallel_dcp").removeHandler(handler)
        if argv is not None:  # in-process: SIGINT goes back to the caller
            interrupt.restore(previous)


def _main(argv: Sequence[str] | None, notes: list[logging.Handler]) -> int:
    _silence_trainer_warnings()
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    sub = subparser_of(parser, getattr(args, "command", None))
    if extras:
        sub.error(unknown_arguments(sub, extras))  # exits 2 with the subcommand's usage line
    show_progress = sys.stdout.isatty() and not getattr(args, "quiet", False) and not getattr(args, "json", False)
    handler = log_to_stderr(getattr(args, "quiet", False))
    notes.extend([handler] if handler is not None else [])
    try:
        code = _run(args, show_progress)
        interrupt.finished()  # committed (or failed) already: a Ctrl-C now changes nothing
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return code
    except BrokenPipeError:
        if _stdout_closed():
            return _quiet_broken_pipe()
        print("parallel-dcp: error: broken pipe", file=sys.stderr)
        return 1
    except UsageError as exc:
        sub.error(str(exc))  # exits 2
    except KeyboardInterrupt as exc:
        interrupt.finished()
        # Only convert writes: verify, inspect and bench have nothing to commit. A Ctrl-C held
        # through a commit says what it committed (its note), never "nothing was committed".
        committed = getattr(exc, "committed", None)
        said = "; nothing was committed" if args.command == "convert" and committed is None else ""
        print(f"parallel-dcp: interrupted{said}", file=sys.stderr)
        print_notes(exc)
        return 130
    except (parallel_dcp.ParallelDCPError, OSError, ValueError, KeyError, TypeError) as exc:
        error = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"parallel-dcp: error: {message(str(error))}", file=sys.stderr)
        print_notes(exc)
        return 1
    except Exception as exc:
        if not type(exc).__module__.startswith(_STORAGE_MODULES):
            raise
        # botocore's credential and endpoint errors are not OSErrors
        print(f"parallel-dcp: error: object storage: {type(exc).__name__}: {printable(str(exc))}", file=sys.stderr)
        return 1
    return 0


def _run(args: argparse.Namespace, show_progress: bool) -> int:
    if args.command == "convert":
        return convert.run(args, show_progress)
    if args.command == "inspect":
        return inspect.run(args)
    if args.command == "verify":
        return verify.run(args)
    if args.command == "presets":
        return presets.run(args)
    return bench.run(args)
