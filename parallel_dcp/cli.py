"""The ``parallel-dcp`` command (also ``python -m parallel_dcp``): convert, inspect, verify, bench.

Exit codes: 0 success, 1 failure (the error is printed on stderr; with ``verify``, any mismatch),
2 usage error, 130 interrupted. ``--json`` prints one JSON document on stdout for scripts. The
progress bar (stderr) shows only when stdout is a terminal and ``-q`` is not given.

Longer than 300 lines because it declares four commands' flags with their help texts and maps each
onto the API; each command's body is a few lines.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import logging
import os
import re
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import parallel_dcp
from parallel_dcp.engine.memory import format_bytes, parse_size
from parallel_dcp.errors import plural, printable

# Nothing here imports torch (parallel_dcp's own imports are lazy): --help and usage errors answer
# at once, and a command imports what it runs when it runs.
if TYPE_CHECKING:
    from parallel_dcp.jobs.pipeline import SaveResult

__all__ = ["build_parser", "main"]

FORMATS = ("dcp", "safetensors", "torch")  # parallel_dcp.formats.FORMATS (tests keep them equal)


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


def _size_of(what: str) -> Any:
    """``--memory-limit`` / ``--shard-size`` / ``--chunk-size``: checked here (an error names
    ``what`` the flag sets), passed on as given."""

    def check(text: str) -> str:
        try:
            parse_size(text, what)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return check


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
        type=_size_of("the memory limit"),
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
        "--shard-size",
        type=_size_of("the shard size"),
        default="5GB",
        help="largest shard of a sharded output (default 5GB)",
    )
    convert.add_argument(
        "--chunk-size",
        type=_size_of("the chunk size"),
        help="split tensors larger than this into DCP chunks (default: from workers and memory)",
    )
    convert.add_argument(
        "--compress",
        type=_compress,
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
    _common(convert)

    inspect = sub.add_parser("inspect", help="describe a checkpoint from its headers")
    inspect.add_argument("path", metavar="PATH")
    inspect.add_argument("--json", action="store_true", help="print JSON on stdout")
    inspect.add_argument("--trust-pickle", action="store_true", help=_TRUST_HELP)
    inspect.add_argument(
        "--keys",
        nargs="*",
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
        "--workers", type=_workers, default=None, help="worker processes hashing tensors (with --diff)"
    )
    inspect.add_argument(
        "--memory-limit",
        type=_size_of("the memory limit"),
        default=None,
        help="memory ceiling while hashing (with --diff)",
    )
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
    verify.add_argument(
        "--dequantize",
        action="store_true",
        help="compare against SRC dequantized as convert --dequantize writes it (--dtype, default bfloat16), exactly",
    )
    verify.add_argument("--block-size", type=int, metavar="N", help="with --dequantize: SRC's FP8 block")
    _common(verify)

    from parallel_dcp import benchmark

    bench = sub.add_parser("bench", help="measure write throughput against stock DCP and the storage's limit")
    benchmark.add_arguments(bench)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The ``parallel-dcp`` argument parser (building it imports no torch)."""
    return _parser()


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


def _quantize_flags(convert: argparse.ArgumentParser) -> None:
    convert.add_argument(
        "--dequantize",
        action="store_true",
        help="dequantize FP8 block-scaled (X.weight + X.weight_scale_inv) and MXFP4 (X_blocks + X_scales) pairs "
        "to --dtype (default bfloat16), bit for bit as stock QuantizedHuggingFaceStorageReader; scales dropped",
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
        copy_files=not args.no_copy_files,
        copy_files_from=args.copy_files_from,
        **_quantize_args(args),
        io=args.io,
    )
    assert isinstance(results, list)
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
                f"{r.seconds:.2f} s, {r.gib_per_s:.2f} GiB/s, {plural(r.workers, 'worker')}, "
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
    )
    assert isinstance(plans, list)
    if args.json:
        print(json.dumps([p.as_dict() for p in plans], indent=2))
    else:
        print(_as_flags("\n".join(describe_plan(p) for p in plans)))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    if args.diff is not None and args.keys is not None:
        raise _UsageError("--keys lists the keys of PATH; it does not go with --diff")
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
        dequantize=args.dequantize,
        block_size=args.block_size,
        io=args.io,
    )
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    elif not args.quiet:
        checked = (
            (f"{plural(report.files_checked, 'file')} against the manifest, " if report.manifest else "no manifest; ")
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
        print(f"parallel-dcp: {_message(str(note))}", file=sys.stderr)


# The library's messages name keyword arguments and flags together (``pass overwrite=True
# (--overwrite)``, ``convert(..., resume=True)``); on the command line only the flag means anything.
_KEYWORD_AND_FLAG = re.compile(r"(?:\w+\(\.\.\., )?\b(\w+)=(?:True|False|\.\.\.)?\)? ?\((--[\w-]+)\)")
_FLAG_AND_KEYWORD = re.compile(r"(--[\w-]+) \((?:\w+\(\.\.\., )?\w+=\w*\)?\)")
_WORD_AND_FLAG = re.compile(r"\b(\w+) \((--[\w-]+)\)")
_KEYWORD_TRUE = re.compile(r"\b(\w+)=True\b")
_FLAG_KEYWORDS = {"overwrite", "resume", "trust_pickle", "distributed", "dry_run"}


def _as_flags(text: str) -> str:
    """``text`` with each keyword argument it names replaced by its command-line flag."""
    text = _KEYWORD_AND_FLAG.sub(r"\2", text)
    text = _FLAG_AND_KEYWORD.sub(r"\1", text)
    text = _WORD_AND_FLAG.sub(lambda m: m[2] if m[2] == "--" + m[1].replace("_", "-") else m[0], text)
    return _KEYWORD_TRUE.sub(lambda m: f"--{m[1].replace('_', '-')}" if m[1] in _FLAG_KEYWORDS else m[0], text)


def _message(text: str) -> str:
    """A library message as the command line shows it: flags for keywords, control characters
    in names escaped (line breaks the message itself makes are kept)."""
    return "\n".join(printable(line) for line in _as_flags(text).split("\n"))


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    """A warning as one line, ``parallel-dcp: warning: ...`` (no source path, no line of code)."""
    text = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    with contextlib.suppress(OSError, ValueError):  # stderr is gone: nowhere to warn
        print(f"parallel-dcp: warning: {printable(_as_flags(text))}", file=sys.stderr)


class _Notes(logging.Handler):
    """The library's notes (the ``parallel_dcp`` logger: rename summaries) as ``parallel-dcp: ...``
    lines on the stderr of the moment (names escaped)."""

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(OSError, ValueError):
            print(f"parallel-dcp: {printable(_as_flags(record.getMessage()))}", file=sys.stderr)


def _log_to_stderr(quiet: bool) -> logging.Handler | None:
    """Show the library's notes for this command (none with ``-q``); returns the handler to remove."""
    if quiet:
        return None
    logger = logging.getLogger("parallel_dcp")
    handler = _Notes(logging.INFO)
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    return handler


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
    """Run one command; warnings and the library's notes print as ``parallel-dcp:`` lines meanwhile."""
    shown = warnings.showwarning
    warnings.showwarning = _show_warning
    notes: list[logging.Handler] = []
    try:
        return _main(argv, notes)
    finally:
        warnings.showwarning = shown
        for handler in notes:
            logging.getLogger("parallel_dcp").removeHandler(handler)


def _main(argv: Sequence[str] | None, notes: list[logging.Handler]) -> int:
    _silence_trainer_warnings()
    parser = _parser()
    args, extras = parser.parse_known_args(argv)
    sub = _subparser(parser, getattr(args, "command", None))
    if extras:
        sub.error(_unknown(sub, extras))  # exits 2 with the subcommand's usage line
    show_progress = sys.stdout.isatty() and not getattr(args, "quiet", False) and not getattr(args, "json", False)
    handler = _log_to_stderr(getattr(args, "quiet", False))
    notes.extend([handler] if handler is not None else [])
    try:
        code = _run(args, show_progress)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return code
    except BrokenPipeError:
        if _stdout_closed():
            return _quiet_broken_pipe()
        print("parallel-dcp: error: broken pipe", file=sys.stderr)
        return 1
    except _UsageError as exc:
        sub.error(str(exc))  # exits 2
    except KeyboardInterrupt as exc:
        print("parallel-dcp: interrupted; nothing was committed", file=sys.stderr)
        _notes(exc)
        return 130
    except (parallel_dcp.ParallelDCPError, OSError, ValueError, KeyError, TypeError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"parallel-dcp: error: {_message(str(message))}", file=sys.stderr)
        _notes(exc)
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
        return _convert(args, show_progress)
    if args.command == "inspect":
        return _inspect(args)
    if args.command == "verify":
        return _verify(args)
    from parallel_dcp import benchmark

    return benchmark.run(args)


if __name__ == "__main__":
    sys.exit(main())
