"""``parallel-dcp bench``: its flags and its run live in :mod:`parallel_dcp.benchmark`, imported
only when the parser is built or the command runs (the core never imports the benchmark)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``bench`` and its flags to the subcommands ``sub``."""
    from parallel_dcp import benchmark

    bench = sub.add_parser("bench", help="measure write throughput against stock DCP and the storage's limit")
    benchmark.add_arguments(bench)


def run(args: argparse.Namespace) -> int:
    from parallel_dcp import benchmark

    return benchmark.run(args)
