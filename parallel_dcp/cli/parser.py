"""The ``parallel-dcp`` argument parser: the top level, and each command's flags from its module.

Building it imports no torch (nor the benchmark: ``bench`` adds its flags when the parser is built).
"""

from __future__ import annotations

import argparse
import difflib

import parallel_dcp
from parallel_dcp.cli import bench, convert, inspect, presets, verify

__all__ = ["build_parser", "subparser_of", "unknown_arguments"]

_EXAMPLES = """examples:
  parallel-dcp convert /models/llama-8b /ckpt/llama-8b-dcp --memory-limit 16GiB   # Hugging Face -> DCP
  parallel-dcp convert /ckpt/step-1000 /serve/model --to safetensors --dtype bf16  # DCP -> safetensors shards
  parallel-dcp verify /ckpt/llama-8b-dcp --against /models/llama-8b               # bit for bit
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``parallel-dcp`` argument parser (building it imports no torch)."""
    parser = argparse.ArgumentParser(
        prog="parallel-dcp",
        description="Write, convert and check PyTorch Distributed Checkpoints with a pool of processes.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"parallel-dcp {parallel_dcp.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    convert.add_parser(sub)
    inspect.add_parser(sub)
    verify.add_parser(sub)
    presets.add_parser(sub)
    bench.add_parser(sub)
    return parser


def subparser_of(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The parser of ``command`` (its usage line is the one to show), or the top-level one."""
    for action in parser._subparsers._group_actions if parser._subparsers else []:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]  # type: ignore[no-any-return]
    return parser


def unknown_arguments(sub: argparse.ArgumentParser, extras: list[str]) -> str:
    """``unrecognized arguments: --overwite (did you mean --overwrite?)``."""
    flags = [flag for action in sub._actions for flag in action.option_strings if flag.startswith("--")]
    hints = []
    for extra in extras:
        close = difflib.get_close_matches(extra.split("=", 1)[0], flags, n=1) if extra.startswith("-") else []
        if close:
            hints.append(f"did you mean {close[0]}?")
    return f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else "")
