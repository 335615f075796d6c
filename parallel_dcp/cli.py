"""The ``parallel-dcp`` command (also ``python -m parallel_dcp``): convert, inspect, verify, bench.

Exit codes: 0 success, 1 failure (the error is printed on stderr; with ``verify``, any mismatch),
2 usage error, 130 interrupted. ``--json`` prints one JSON document on stdout for scripts. The
progress bar (stderr) shows only when stdout is a terminal and ``-q`` is not given.

Longer than 300 lines because it declares four commands' flags with their help texts and maps each
onto the API; each command's body is a few lines.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import parallel_dcp
from parallel_dcp.engine.memory import format_bytes, parse_size
from parallel_dcp.formats import FORMATS
from parallel_dcp.jobs.inspect import describe
from parallel_dcp.jobs.pipeline import SaveResult

__all__ = ["main"]


def _storage_options(text: str) -> dict[str, Any]:
    """``--storage-options``: a JSON object of fsspec options."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


def _storage(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--storage-options",
        type=_storage_options,
        default=None,
        metavar="JSON",
        help='fsspec options for s3:// (or other) URLs, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'; '
        "credentials come from the AWS environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ~/.aws)",
    )


def _workers(text: str) -> int:
    """``--workers``: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seconds(text: str) -> float:
    """``--dist-timeout``: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def _size(text: str) -> str:
    """``--memory-limit`` / ``--shard-size`` / ``--chunk-size``: checked here, passed on as given."""
    try:
        parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _compress(text: str) -> str:
    """``--compress``: ``zstd`` or ``zstd:LEVEL``, with the zstandard package installed."""
    from parallel_dcp.storage.compression import parse_compress

    try:
        parse_compress(text)
    except (ValueError, ImportError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _dtype(text: str) -> str:
    """``--dtype``: a floating dtype name."""
    from parallel_dcp.jobs.convert import parse_dtype

    try:
        parse_dtype(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _common(parser: argparse.ArgumentParser) -> None:
    _storage(parser)
    parser.add_argument("--workers", type=_workers, default=None, help="worker processes (default: every usable core)")
    parser.add_argument(
        "--memory-limit",
        type=_size,
        default=None,
        help="ceiling on the memory the job adds (e.g. 512MiB, 32GiB, 16GB; default: half of what is available)",
    )
    parser.add_argument(
        "--io",
        choices=("auto", "direct", "buffered"),
        default="auto",
        help="how shards reach local files: direct (O_DIRECT, aligned buffers, no page cache), buffered (the page "
        "cache) or auto: direct on block file systems that accept it for shards of 16 MiB or more, buffered on "
        "tmpfs, FUSE, network file systems and object storage (default: auto)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no summary text")


_TRUST_HELP = "unpickle values and torch.save files that need weights_only=False (runs their code: trusted only)"
_EXAMPLES = """examples:
  parallel-dcp convert /models/llama-8b /ckpt/llama-8b-dcp --memory-limit 16GiB   # Hugging Face -> DCP
  parallel-dcp convert /ckpt/step-1000 /serve/model --to safetensors --dtype bf16  # DCP -> safetensors shards
  parallel-dcp verify /ckpt/llama-8b-dcp --against /models/llama-8b               # bit for bit
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="parallel-dcp",
        description="Write, convert and check PyTorch Distributed Checkpoints with a pool of processes.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"parallel-dcp {parallel_dcp.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    convert = sub.add_parser(
        "convert",
        help="convert between DCP, safetensors and torch.save",
        description="Convert SRC (or several SRCs, each into DST/<name>) to DST. The source format is detected.",
    )
    convert.add_argument("paths", nargs="+", metavar="SRC... DST", help="one or more sources, then the destination")
    convert.add_argument(
        "--to",
        choices=FORMATS,
        help="output format; default: from DST's name: *.safetensors is one safetensors file, *.pt/*.pth/*.bin "
        "one torch.save file, anything else a DCP directory; with --to safetensors|torch a DST without those "
        "suffixes is a sharded directory (shards plus index JSON)",
    )
    convert.add_argument("--dtype", type=_dtype, help="cast floating tensors (bfloat16, float16, float32, ...)")
    convert.add_argument(
        "--keys", action="append", metavar="PATTERN", help="select keys: a glob, or re:<regex>; repeat for more"
    )
    convert.add_argument("--overwrite", action="store_true", help="replace an existing output atomically")
    convert.add_argument(
        "--shard-size", type=_size, default="5GB", help="largest shard of a sharded output (default 5GB)"
    )
    convert.add_argument(
        "--chunk-size",
        type=_size,
        help="split tensors larger than this into DCP chunks (default: from workers and memory)",
    )
    convert.add_argument(
        "--compress",
        type=_compress,
        metavar="zstd[:LEVEL]",
        help="DCP output: store every record as one zstd frame, as stock DCP's ZStandard extension does (level "
        "1..22, default 3; stock dcp.load reads it with zstandard installed). Needs pip install 'parallel_dcp[zstd]'",
    )
    convert.add_argument(
        "--distributed",
        action="store_true",
        help="run as one rank of a torchrun/srun job: each rank converts its share, rank 0 commits",
    )
    convert.add_argument(
        "--dist-timeout",
        type=_seconds,
        default=1800.0,
        metavar="SECONDS",
        help="with --distributed: how long a rank waits for the others at each step (default 1800)",
    )
    convert.add_argument(
        "--no-checksums", action="store_true", help="record file sizes only in the manifest (faster; see verify)"
    )
    convert.add_argument(
        "--trust-pickle", action="store_true", help="allow torch.save files that need weights_only=False (trusted only)"
    )
    convert.add_argument(
        "--rename",
        action="append",
        metavar="REGEX=TEMPLATE",
        help="rename keys matching REGEX (whole name, Python re) to TEMPLATE (\\1, \\g<name>); repeat for more "
        "rules, the first match wins; applied after --keys",
    )
    convert.add_argument(
        "--rename-file", metavar="RULES.json", help="rename rules from a JSON list of [regex, template] pairs"
    )
    convert.add_argument(
        "--resume",
        action="store_true",
        help="continue a conversion to DST that died (killed, out of space, interrupted), run with the same "
        "arguments: keep its finished files that still match their checksums, redo the rest; nothing to "
        "resume: convert from the start",
    )
    convert.add_argument(
        "--dry-run",
        action="store_true",
        help="plan only: files, keys, tasks per worker, chunks, predicted peak memory and space; write nothing",
    )
    _common(convert)

    inspect = sub.add_parser("inspect", help="describe a checkpoint from its headers")
    inspect.add_argument("path", metavar="PATH")
    inspect.add_argument("--json", action="store_true", help="print JSON on stdout")
    inspect.add_argument("--trust-pickle", action="store_true", help=_TRUST_HELP)
    inspect.add_argument(
        "--diff",
        metavar="OTHER",
        help="compare PATH with OTHER (any formats): keys added, removed, renamed, and changed dtype, shape or "
        "content (xxh3 of every tensor, hashed by the worker pool); exit code 1 when they differ",
    )
    inspect.add_argument(
        "--workers", type=_workers, default=None, help="worker processes hashing tensors (with --diff)"
    )
    inspect.add_argument("--memory-limit", type=_size, default=None, help="memory ceiling while hashing (with --diff)")
    _storage(inspect)

    verify = sub.add_parser(
        "verify", help="check checksums, read everything back, compare with a source", description=None
    )
    verify.add_argument("path", metavar="PATH")
    verify.add_argument("--against", metavar="SRC", help="compare every key bit for bit with this checkpoint")
    verify.add_argument("--trust-pickle", action="store_true", help=_TRUST_HELP)
    verify.add_argument(
        "--dtype",
        type=_dtype,
        help="compare against SRC cast to this dtype, as convert --dtype casts it (floating tensors, exactly)",
    )
    verify.add_argument(
        "--deep",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="read every tensor back (compressed records decompressed and checked against .metadata); "
        "--no-deep checks only the manifest's sizes and checksums of the stored bytes (default: --deep)",
    )
    _common(verify)

    from parallel_dcp import benchmark

    bench = sub.add_parser("bench", help="measure write throughput against stock DCP and the storage's limit")
    benchmark.add_arguments(bench)
    return parser


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
    }


def _rename_rules(args: argparse.Namespace) -> list[tuple[str, str]] | None:
    """``--rename-file`` rules first, then each ``--rename`` in order; None when there are none."""
    from parallel_dcp.jobs.rename import parse_rule, read_rules_file

    if args.rename_file is None and not args.rename:
        return None
    rules = read_rules_file(args.rename_file) if args.rename_file is not None else []
    return rules + [parse_rule(text) for text in args.rename or []]


def _convert(args: argparse.Namespace, show_progress: bool) -> int:
    if len(args.paths) < 2:
        raise _UsageError("convert needs at least one SRC and a DST")  # exits 2 with convert's usage
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
        io=args.io,
    )
    assert isinstance(results, list)
    if args.distributed and os.environ.get("RANK", "0") != "0":
        return 0  # every rank has the same result: rank 0 reports it
    if args.resume and not args.quiet:
        for r in results:
            if not r.resumed:
                print(f"parallel-dcp: nothing to resume in {r.path}: converted from the start", file=sys.stderr)
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
                f"{src} -> {r.path} ({r.format}): {r.keys} keys, {format_bytes(r.bytes)} in {r.files} files, "
                f"{r.seconds:.2f} s, {r.gib_per_s:.2f} GiB/s, {r.workers} workers, "
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
    )
    assert isinstance(plans, list)
    if args.json:
        print(json.dumps([p.as_dict() for p in plans], indent=2))
    else:
        print("\n".join(describe_plan(p) for p in plans))
    return 0


def _inspect(args: argparse.Namespace) -> int:
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
    info = parallel_dcp.inspect(args.path, storage_options=args.storage_options, trust_pickle=args.trust_pickle)
    print(json.dumps(info, indent=2) if args.json else describe(info))
    return 0


def _verify(args: argparse.Namespace) -> int:
    report = parallel_dcp.verify(
        args.path,
        against=args.against,
        workers=args.workers,
        memory_limit=args.memory_limit,
        dtype=args.dtype,
        storage_options=args.storage_options,
        trust_pickle=args.trust_pickle,
        deep=args.deep,
        io=args.io,
    )
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    elif not args.quiet:
        checked = (
            (f"{report.files_checked} files against the manifest, " if report.manifest else "no manifest; ")
            + (f"{report.keys_checked} keys read back" if args.deep or report.against else "keys not read back")
            + (f" and compared with {report.against}" if report.against else "")
        )
        print(f"{report.path}: {'OK' if report.ok else 'FAILED'} ({checked})")
        for problem in report.problems:
            print(f"  {problem}")
    if not report.ok and args.quiet:
        for problem in report.problems:
            print(f"  {problem}", file=sys.stderr)
    return 0 if report.ok else 1


_STORAGE_MODULES = ("botocore", "aiobotocore", "s3fs", "fsspec", "aiohttp")


class _UsageError(Exception):
    """Arguments argparse accepts but the command cannot use (exit code 2)."""


# torch.distributed.checkpoint warns on every save or load outside a process group; that is
# advice for a trainer, and parallel_dcp runs without a process group on purpose.
_TRAINER_WARNINGS = (r"torch\.distributed is disabled, unavailable or uninitialized",)


def _silence_trainer_warnings() -> None:
    """Hide torch's warnings meant for trainers, here and in the workers (forked after this)."""
    for message in _TRAINER_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The parser of ``command`` (its usage line is the one to show), or the top-level one."""
    for action in parser._subparsers._group_actions if parser._subparsers else []:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]  # type: ignore[no-any-return]
    return parser


def _unknown(sub: argparse.ArgumentParser, extras: list[str]) -> str:
    """``unrecognized arguments: --overwite (did you mean --overwrite?)``."""
    flags = [flag for action in sub._actions for flag in action.option_strings if flag.startswith("--")]
    hints = []
    for extra in extras:
        close = difflib.get_close_matches(extra.split("=", 1)[0], flags, n=1) if extra.startswith("-") else []
        if close:
            hints.append(f"did you mean {close[0]}?")
    return f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else "")


def _notes(exc: BaseException) -> None:
    """What the job added to its error (a conversion's finished tasks kept for --resume)."""
    for note in getattr(exc, "__notes__", []):
        print(f"parallel-dcp: {note}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    _silence_trainer_warnings()
    parser = _parser()
    args, extras = parser.parse_known_args(argv)
    sub = _subparser(parser, getattr(args, "command", None))
    if extras:
        sub.error(_unknown(sub, extras))  # exits 2 with the subcommand's usage line
    show_progress = sys.stdout.isatty() and not getattr(args, "quiet", False) and not getattr(args, "json", False)
    try:
        if args.command == "convert":
            return _convert(args, show_progress)
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "verify":
            return _verify(args)
        from parallel_dcp import benchmark

        return benchmark.run(args)
    except _UsageError as exc:
        sub.error(str(exc))  # exits 2
    except KeyboardInterrupt as exc:
        print("parallel-dcp: interrupted; nothing was committed", file=sys.stderr)
        _notes(exc)
        return 130
    except (parallel_dcp.ParallelDCPError, OSError, ValueError, KeyError, TypeError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"parallel-dcp: error: {message}", file=sys.stderr)
        _notes(exc)
        return 1
    except Exception as exc:
        if not type(exc).__module__.startswith(_STORAGE_MODULES):
            raise
        # botocore's credential and endpoint errors are not OSErrors
        print(f"parallel-dcp: error: object storage: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
