"""``parallel-dcp convert SRC... DST``: its flags, and the run that maps them onto
:func:`parallel_dcp.convert` (or its dry run) and prints the result."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

import parallel_dcp
from parallel_dcp.cli import flags, interrupt, presets
from parallel_dcp.cli.messages import as_flags
from parallel_dcp.engine.sizes import format_bytes, format_rate
from parallel_dcp.errors import plural, printable

if TYPE_CHECKING:
    from parallel_dcp.jobs.pipeline import SaveResult

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``convert`` and its flags to the subcommands ``sub``."""
    convert = sub.add_parser(
        "convert",
        help="convert between DCP, safetensors and torch.save",
        description="Convert SRC (or several SRCs, each into DST/<name>) to DST. The source format is detected.",
    )
    convert.add_argument("paths", nargs="+", metavar="SRC... DST", help="one or more sources, then the destination")
    convert.add_argument(
        "--to",
        choices=flags.FORMATS,
        help="output format; default: from DST's name: *.safetensors is one safetensors file, *.pt/*.pth/*.bin "
        "one torch.save file, anything else a DCP directory; with --to safetensors|torch a DST without those "
        "suffixes is a sharded directory (shards plus index JSON)",
    )
    convert.add_argument("--dtype", type=flags.dtype, help="cast floating tensors (bfloat16, float16, float32, ...)")
    convert.add_argument(
        "--keys",
        action="append",
        type=flags.key_pattern,
        metavar="PATTERN",
        help="select keys: a glob, or re:<regex>; repeat for more",
    )
    convert.add_argument("--overwrite", action="store_true", help="replace an existing output atomically")
    convert.add_argument(
        "--shard-size",
        type=flags.size_of("the shard size"),
        default="5GB",
        help="largest shard of a sharded output (default 5GB)",
    )
    convert.add_argument(
        "--chunk-size",
        type=flags.size_of("the chunk size"),
        help="split tensors larger than this into DCP chunks (default: from workers and memory)",
    )
    convert.add_argument(
        "--compress",
        type=flags.compress,
        metavar="zstd[:LEVEL]",
        help="DCP output: store every record as one zstd frame, as stock DCP's ZStandard extension does (level "
        "1..22, default 3; stock dcp.load reads it with zstandard installed). Needs the zstd extra: "
        "pip install '.[zstd]' in a checkout (or pip install zstandard)",
    )
    convert.add_argument(
        "--distributed",
        action="store_true",
        help="run as one rank of a torchrun/srun job: each rank converts its share, rank 0 commits",
    )
    convert.add_argument(
        "--dist-timeout",
        type=flags.seconds,
        default=1800.0,
        metavar="SECONDS",
        help="with --distributed: how long a rank waits for the others at each step (default 1800)",
    )
    convert.add_argument(
        "--no-checksums", action="store_true", help="record file sizes only in the manifest (faster; see verify)"
    )
    convert.add_argument(
        "--no-source-checks", action="store_true", help="skip checking the source against its own checksums"
    )
    convert.add_argument(
        "--trust-pickle", action="store_true", help="allow torch.save files that need weights_only=False (trusted only)"
    )
    convert.add_argument(
        "--rename",
        action="append",
        type=flags.rename_rule,
        metavar="REGEX=TEMPLATE",
        help="rename keys matching REGEX (whole name, Python re) to TEMPLATE (\\1, \\g<name>); repeat for more "
        "rules, the first match wins; applied after --keys",
    )
    convert.add_argument(
        "--rename-file",
        type=flags.rules_file,
        metavar="RULES.json",
        help="rename rules from a JSON list of [regex, template] pairs",
    )
    convert.add_argument(
        "--resume",
        action="store_true",
        help="continue a conversion to DST that died (killed, out of space, interrupted), run with the same "
        "arguments: keep its finished files that still match their checksums, redo the rest; nothing to "
        "resume: convert from the start",
    )
    convert.add_argument(
        "--no-copy-files",
        action="store_true",
        help="converting a Hugging Face directory to a sharded directory (--to safetensors|torch) copies its "
        "other files (config.json, generation_config.json, tokenizer files, ...) beside the shards; this copies none",
    )
    convert.add_argument(
        "--copy-files-from",
        metavar="DIR",
        help="copy the non-weight files of DIR (config.json, tokenizer files, ...) into the sharded output, for any "
        "source (a DCP checkpoint from training plus the model's original folder)",
    )
    convert.add_argument(
        "--dry-run",
        action="store_true",
        help="plan only: files, keys, tasks per worker, chunks, predicted peak memory and space; write nothing",
    )
    _quantize_flags(convert)
    presets.add_preset_flags(convert)
    flags.common(convert)


def _quantize_flags(convert: argparse.ArgumentParser) -> None:
    convert.add_argument(
        "--dequantize",
        action="store_true",
        help="dequantize FP8 block-scaled (X.weight + X.weight_scale_inv) and MXFP4 (X_blocks + X_scales) pairs "
        "to --dtype (default: the dtype SRC's config.json names, else bfloat16), bit for bit as stock "
        "QuantizedHuggingFaceStorageReader; scales dropped",
    )
    convert.add_argument(
        "--quantize",
        metavar="fp8-block[:BLOCK]",
        help="write the weights --quantize-keys selects as float8_e4m3fn with a float32 X.weight_scale_inv per "
        "BLOCK x BLOCK block (default 128; the DeepSeek layout)",
    )
    convert.add_argument(
        "--quantize-keys",
        action="append",
        type=flags.key_pattern,
        metavar="PATTERN",
        help="weights to quantize (glob or re:<regex>, as --keys; repeat for more); default: 2-D floating "
        "*.weight tensors except embeddings, norms, the output head and MoE routers (--dry-run shows the rule)",
    )
    convert.add_argument(
        "--block-size",
        type=int,
        metavar="N",
        help="FP8 block of --dequantize (default: config.json's weight_block_size, else 128) or --quantize",
    )


def _quantize_args(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dequantize": args.dequantize,
        "quantize": args.quantize,
        "quantize_keys": args.quantize_keys,
        "block_size": args.block_size,
    }


def _result_dict(result: SaveResult) -> dict[str, Any]:
    return {
        "path": result.path,
        "format": result.format,
        "keys": result.keys,
        "bytes": result.bytes,
        "files": result.files,
        "tasks": result.tasks,
        "workers": result.workers,
        "seconds": round(result.seconds, 4),
        "gib_per_s": round(result.gib_per_s, 4),
        "memory_limit": result.memory_limit,
        "peak_memory": result.peak_memory,
        "phases": {name: round(seconds, 4) for name, seconds in result.phases.items()},
        "resumed": result.resumed,
        "bytes_kept": result.bytes_kept,
        "bytes_rewritten": result.bytes_rewritten,
        "io": result.io,
        # how the source was read and why (io=auto: the rates measured beside the writes)
        "read_io": result.read_choice.reads if result.read_choice is not None else None,
        "read_choice": result.read_choice.summary() if result.read_choice is not None else None,
    }


def _rename_rules(args: argparse.Namespace) -> list[tuple[str, str]] | None:
    """``--rename-file`` rules first, then each ``--rename`` in order; None when there are none."""
    from parallel_dcp.jobs.rename import parse_rule, read_rules_file

    if args.rename_file is None and not args.rename:
        return None
    rules = read_rules_file(args.rename_file) if args.rename_file is not None else []
    return rules + [parse_rule(text) for text in args.rename or []]


def run(args: argparse.Namespace, show_progress: bool) -> int:
    if len(args.paths) < 2:
        raise flags.UsageError("convert needs at least one SRC and a DST")  # exits 2 with convert's usage
    *sources, dst = args.paths
    rename = _rename_rules(args)
    if args.dry_run:
        return _convert_plan(args, sources, dst, rename)
    results = parallel_dcp.convert(
        sources,
        dst,
        to=args.to,
        workers=args.workers,
        memory_limit=args.memory_limit,
        dtype=args.dtype,
        keys=args.keys,
        overwrite=args.overwrite,
        progress=show_progress,
        shard_size=args.shard_size,
        trust_pickle=args.trust_pickle,
        checksums=not args.no_checksums,
        chunk_size=args.chunk_size,
        distributed=args.distributed,
        dist_timeout=args.dist_timeout,
        storage_options=args.storage_options,
        rename=rename,
        resume=args.resume,
        compress=args.compress,
        copy_files=not args.no_copy_files,
        copy_files_from=args.copy_files_from,
        **_quantize_args(args),
        **presets.preset_args(args),
        io=args.io,
        check_source=not args.no_source_checks,
    )
    assert isinstance(results, list)
    interrupt.finished()  # committed: a Ctrl-C while the summary prints changes nothing
    if args.distributed and os.environ.get("RANK", "0") != "0":
        return 0  # every rank has the same result: rank 0 reports it
    if args.resume and not args.quiet:
        for r in results:
            if not r.resumed:
                print(
                    f"parallel-dcp: nothing to resume in {printable(r.path)}: converted from the start", file=sys.stderr
                )
    if args.json:
        print(json.dumps([_result_dict(r) for r in results], indent=2))
    elif not args.quiet:
        for src, r in zip(sources, results, strict=True):
            resumed = (
                f", resumed: {format_bytes(r.bytes_kept)} kept, {format_bytes(r.bytes_rewritten)} rewritten"
                if r.resumed
                else ""
            )
            print(
                f"{printable(src)} -> {printable(r.path)} ({r.format}): {plural(r.keys, 'key')}, "
                f"{format_bytes(r.bytes)} in {plural(r.files, 'file')}, "
                f"{r.seconds:.2f} s, {format_rate(r.bytes, r.seconds)}, {plural(r.workers, 'worker')}, "
                f"peak memory {format_bytes(r.peak_memory)} of {format_bytes(r.memory_limit)}{resumed}"
            )
    return 0


def _convert_plan(args: argparse.Namespace, sources: list[str], dst: str, rename: list[tuple[str, str]] | None) -> int:
    """``convert --dry-run``: print the plan of every source; nothing is written."""
    from parallel_dcp.jobs.dryrun import describe_plan

    plans = parallel_dcp.convert(
        sources,
        dst,
        to=args.to,
        workers=args.workers,
        memory_limit=args.memory_limit,
        dtype=args.dtype,
        keys=args.keys,
        overwrite=args.overwrite,
        shard_size=args.shard_size,
        trust_pickle=args.trust_pickle,
        checksums=not args.no_checksums,
        chunk_size=args.chunk_size,
        distributed=args.distributed,
        dist_timeout=args.dist_timeout,
        storage_options=args.storage_options,
        rename=rename,
        compress=args.compress,
        io=args.io,
        dry_run=True,
        copy_files=not args.no_copy_files,
        copy_files_from=args.copy_files_from,
        **_quantize_args(args),
        **presets.preset_args(args),
    )
    assert isinstance(plans, list)
    if args.json:
        print(json.dumps([p.as_dict() for p in plans], indent=2))
    else:
        print(as_flags("\n".join(describe_plan(p) for p in plans)))
    return 0
