"""The CLI's presets: ``convert --preset NAME`` (with ``--model-config`` and ``--rename-strict``)
and the ``presets`` command that lists them with the client and version each one targets."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_parser", "add_preset_flags", "preset_args", "run"]


def add_preset_flags(convert: argparse.ArgumentParser) -> None:
    """``convert``'s preset flags."""
    convert.add_argument(
        "--preset",
        metavar="NAME",
        help="a named conversion for a client (parallel-dcp presets lists them, e.g. hf-llama3-to-torchtitan for "
        "torchtitan 0.3.0): its renames, the tensor transforms the client needs (q/k RoPE permutation) and every key "
        "covered, or an error before anything is written; --rename rules apply after it, to its names",
    )
    convert.add_argument(
        "--model-config",
        "--config",
        dest="model_config",
        metavar="CONFIG.json",
        help="the model's Hugging Face config.json (or its directory) a --preset reads head counts from; default: "
        "the source's directory, else --copy-files-from",
    )
    convert.add_argument(
        "--rename-strict",
        action="store_true",
        help="every selected key must match a --rename rule, else an error before anything is written (without it, "
        "the keys no rule matched are named in a warning)",
    )


def preset_args(args: argparse.Namespace) -> dict[str, Any]:
    """``convert``'s keyword arguments from the preset flags."""
    return {"preset": args.preset, "model_config": args.model_config, "rename_strict": args.rename_strict}


def add_parser(sub: Any) -> None:
    """The ``presets`` command."""
    presets = sub.add_parser(
        "presets",
        help="list the presets convert --preset knows, with the client and version each targets",
        description="List the named conversions of convert --preset: each with what it reads, what it writes and "
        "the client (and version) whose layout it follows.",
    )
    presets.add_argument("--json", action="store_true", help="print JSON on stdout")


def run(args: argparse.Namespace) -> int:
    """Print every preset: name, client and version, what it reads and writes."""
    import parallel_dcp

    known = parallel_dcp.presets()
    if args.json:
        fields = ("name", "client", "client_version", "reads", "writes")
        print(json.dumps([{f: getattr(p, f) for f in fields} for p in known], indent=2))
        return 0
    for p in known:
        print(f"{p.name}  ({p.client} {p.client_version})\n  reads:  {p.reads}\n  writes: {p.writes}")
    return 0
