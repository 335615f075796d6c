"""Flags that several commands share, and the checks that turn a bad value into a usage error
(exit 2, naming the flag) before any command runs. Nothing here imports torch."""

from __future__ import annotations

import argparse
from typing import Any

from parallel_dcp._json import loads_json
from parallel_dcp.engine.memory import parse_size

__all__ = [
    "FORMATS",
    "TRUST_HELP",
    "UsageError",
    "common",
    "compress",
    "dtype",
    "key_pattern",
    "rename_rule",
    "rules_file",
    "seconds",
    "size_of",
    "storage",
    "workers",
]

FORMATS = ("dcp", "safetensors", "torch")  # parallel_dcp.formats.FORMATS (tests keep them equal)
TRUST_HELP = "unpickle values and torch.save files that need weights_only=False (runs their code: trusted only)"


class UsageError(Exception):
    """Arguments argparse accepts but the command cannot use (exit code 2)."""


def _storage_options(text: str) -> dict[str, Any]:
    """``--storage-options``: a JSON object of fsspec options."""
    try:
        value = loads_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


def storage(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--storage-options",
        type=_storage_options,
        default=None,
        metavar="JSON",
        help='fsspec options for s3:// (or other) URLs, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'; '
        "credentials come from the AWS environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ~/.aws)",
    )


def workers(text: str) -> int:
    """``--workers``: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def seconds(text: str) -> float:
    """``--dist-timeout``: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def size_of(what: str) -> Any:
    """``--memory-limit`` / ``--shard-size`` / ``--chunk-size``: checked here (an error names
    ``what`` the flag sets), passed on as given."""

    def check(text: str) -> str:
        try:
            parse_size(text, what)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return check


def compress(text: str) -> str:
    """``--compress``: ``zstd`` or ``zstd:LEVEL``, with the zstandard package installed."""
    from parallel_dcp.storage.compression import parse_compress

    try:
        parse_compress(text)
    except (ValueError, ImportError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


# The names parallel_dcp.jobs.convert.parse_dtype takes (tests keep them equal): known here without
# importing torch, so a bad --dtype is refused at once.
DTYPE_NAMES = (
    "bf16",
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "fp16",
    "fp32",
    "fp64",
    "half",
)


def dtype(text: str) -> str:
    """``--dtype``: a floating dtype name (checked without importing torch)."""
    if text.lower().removeprefix("torch.") not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}: use one of {', '.join(DTYPE_NAMES)}")
    return text


def key_pattern(text: str) -> str:
    """``--keys`` / ``--quantize-keys``: a glob, or ``re:`` and a regular expression that compiles."""
    from parallel_dcp.jobs.key_patterns import matcher

    try:
        matcher(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def rename_rule(text: str) -> str:
    """``--rename REGEX=TEMPLATE``: split as the conversion splits it, its regex compiled."""
    from parallel_dcp.jobs.rename_rules import check_regex, parse_rule

    try:
        regex, _ = parse_rule(text)
        check_regex(regex, f"rule {text!r}")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(_rule_message(str(exc), text)) from None
    return text


def _rule_message(said: str, text: str) -> str:
    # "rule '(=x': bad regular expression '(': ..." reads better from the regex on
    return said.removeprefix(f"rule {text!r}: ")


def rules_file(text: str) -> str:
    """``--rename-file``: a readable JSON list of ``[regex, template]`` pairs whose regexes compile."""
    from parallel_dcp.jobs.rename_rules import check_regex, read_rules_file

    try:
        for i, (regex, _) in enumerate(read_rules_file(text)):
            check_regex(regex, f"{text}: rule {i}")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def common(parser: argparse.ArgumentParser) -> None:
    storage(parser)
    parser.add_argument("--workers", type=workers, default=None, help="worker processes (default: every usable core)")
    parser.add_argument(
        "--memory-limit",
        type=size_of("the memory limit"),
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
