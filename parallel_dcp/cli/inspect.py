"""``parallel-dcp inspect PATH``: what a checkpoint holds (:func:`parallel_dcp.inspect`), its keys,
or with ``--diff OTHER`` what changed between two (:func:`parallel_dcp.diff`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import parallel_dcp
from parallel_dcp.cli import flags

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``inspect`` and its flags to the subcommands ``sub``."""
    inspect = sub.add_parser("inspect", help="describe a checkpoint from its headers")
    inspect.add_argument("path", metavar="PATH")
    inspect.add_argument("--json", action="store_true", help="print JSON on stdout")
    inspect.add_argument("--trust-pickle", action="store_true", help=flags.TRUST_HELP)
    inspect.add_argument(
        "--keys",
        nargs="*",
        type=flags.key_pattern,
        metavar="PATTERN",
        help="list keys, one line each (name, dtype, shape, bytes): every key, or those the patterns select "
        "(a glob, or re:<regex>, as convert --keys); --json always lists every key (key_list)",
    )
    inspect.add_argument(
        "--diff",
        metavar="OTHER",
        help="compare PATH with OTHER (any formats): keys added, removed, renamed, and changed dtype, shape or "
        "content (xxh3 of every tensor, hashed by the worker pool); exit code 1 when they differ",
    )
    inspect.add_argument(
        "--workers", type=flags.workers, default=None, help="worker processes hashing tensors (with --diff)"
    )
    inspect.add_argument(
        "--memory-limit",
        type=flags.size_of("the memory limit"),
        default=None,
        help="memory ceiling while hashing (with --diff)",
    )
    flags.storage(inspect)


def run(args: argparse.Namespace) -> int:
    if args.diff is not None and args.keys is not None:
        raise flags.UsageError("--keys lists the keys of PATH; it does not go with --diff")
    if args.diff is not None:
        from parallel_dcp.jobs.diff import describe_diff

        report = parallel_dcp.diff(
            args.path,
            args.diff,
            workers=args.workers,
            memory_limit=args.memory_limit,
            storage_options=args.storage_options,
            trust_pickle=args.trust_pickle,
        )
        print(json.dumps(report.as_dict(), indent=2) if args.json else describe_diff(report))
        return 0 if report.same else 1
    from parallel_dcp.jobs.inspect import describe, describe_key_list

    info = parallel_dcp.inspect(
        args.path, storage_options=args.storage_options, trust_pickle=args.trust_pickle, keys=args.keys or None
    )
    if args.json:
        print(json.dumps(info, indent=2))
    elif args.keys is not None:
        listing = describe_key_list(info)
        if listing:
            print(listing)
    else:
        print(describe(info))
    return 1 if info.get("damaged") else 0  # a damaged checkpoint is a failure, committed or not
