"""``parallel-dcp verify PATH``: checksums, every key read back, and with ``--against SRC`` a bit
for bit comparison (:func:`parallel_dcp.verify`); exit code 1 on any problem."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import parallel_dcp
from parallel_dcp.cli import flags
from parallel_dcp.errors import plural, printable

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``verify`` and its flags to the subcommands ``sub``."""
    verify = sub.add_parser(
        "verify", help="check checksums, read everything back, compare with a source", description=None
    )
    verify.add_argument("path", metavar="PATH")
    verify.add_argument("--against", metavar="SRC", help="compare every key bit for bit with this checkpoint")
    verify.add_argument("--trust-pickle", action="store_true", help=flags.TRUST_HELP)
    verify.add_argument(
        "--dtype",
        type=flags.dtype,
        help="compare against SRC cast to this dtype, as convert --dtype casts it (floating tensors, exactly)",
    )
    verify.add_argument(
        "--deep",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="read every tensor back (compressed records decompressed and checked against .metadata); "
        "--no-deep checks only the manifest's sizes and checksums of the stored bytes (default: --deep)",
    )
    verify.add_argument(
        "--dequantize",
        action="store_true",
        help="compare against SRC dequantized as convert --dequantize writes it (--dtype, default: the dtype SRC's "
        "config.json names, else bfloat16), exactly",
    )
    verify.add_argument("--block-size", type=int, metavar="N", help="with --dequantize: SRC's FP8 block")
    flags.common(verify)


def run(args: argparse.Namespace) -> int:
    report = parallel_dcp.verify(
        args.path,
        against=args.against,
        workers=args.workers,
        memory_limit=args.memory_limit,
        dtype=args.dtype,
        storage_options=args.storage_options,
        trust_pickle=args.trust_pickle,
        deep=args.deep,
        dequantize=args.dequantize,
        block_size=args.block_size,
        io=args.io,
    )
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    elif not args.quiet:
        manifest = "stale manifest, not used; " if report.manifest_stale else "no manifest; "
        checked = (
            (f"{plural(report.files_checked, 'file')} against the manifest, " if report.manifest else manifest)
            + (
                f"{plural(report.keys_checked, 'key')} read back"
                if args.deep or report.against
                else "keys not read back"
            )
            + (f" and compared with {printable(report.against)}" if report.against else "")
        )
        print(f"{printable(report.path)}: {'OK' if report.ok else 'FAILED'} ({checked})")
        for problem in report.problems:
            print(f"  {printable(problem)}")
        if report.side_index is not None and not any(  # (a warning below says it)
            warning.startswith(report.side_index.state()) for warning in report.warnings
        ):
            print(f"  {printable(report.side_index.state())}")
    if not args.json:  # a warning is no summary text: shown under --quiet too
        for warning in report.warnings:
            print(f"  warning: {printable(warning)}", file=sys.stderr if args.quiet else sys.stdout)
    if not report.ok and args.quiet:
        for problem in report.problems:
            print(f"  {printable(problem)}", file=sys.stderr)
    if report.suggested_dtype is not None and not args.json:  # beside the problems it explains
        print(
            f"  hint: every difference is a dtype that a cast to {report.suggested_dtype} explains (as convert "
            f"--dtype {report.suggested_dtype} writes it): verify again with --dtype {report.suggested_dtype} to "
            "compare with the cast source, bit for bit",
            file=sys.stderr if args.quiet else sys.stdout,
        )
    return 0 if report.ok else 1
