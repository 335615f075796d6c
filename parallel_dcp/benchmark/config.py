"""The one validated set of benchmark options; the command line only fills it in."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import psutil

from parallel_dcp.engine.memory import parse_size
from parallel_dcp.options import usable_cores

__all__ = ["SUITES", "BenchConfig", "Target", "default_gib"]

SUITES = (
    "save",
    "small",
    "convert",
    "lopsided",
    "scaling",
    "scaling:llm",  # one of the scaling suite's two state dicts (a run of each fits a shorter slot)
    "scaling:small",
    "load",
    "load-small",
    "compress",
    "quantized",
    "disk",
    "read",
)
_SHM = "/dev/shm"
_MAX_DEFAULT_GIB = 2.0
# Memory a run holds at once, in state-dict sizes: the state dict itself, plus (convert) the
# stock path's full load of a source beside it. Outputs on /dev/shm are checked per target.
# load: the state dict while the checkpoints are written, then the reused targets and one output.
_HELD = {
    "save": 1.0,
    "small": 1.0,
    "convert": 2.0,
    "lopsided": 1.0,
    "scaling": 1.0,
    "scaling:llm": 1.0,
    "scaling:small": 1.0,
    "load": 2.0,
    "load-small": 2.0,
    "compress": 2.0,
    "quantized": 6.0,  # the source, and the stock path's whole bf16 output (MXFP4: 4x) with its temporaries
    "disk": 3.0,  # the state dict, the reused read targets, and a stock conversion's full load
    "read": 2.0,  # the state dict while its copies are written, then one reader's whole output
}
# A many-small tensor: 2,080 float32 on average, plus its Python and tensor objects.
_SMALL_TENSOR_BYTES = 2080 * 4 + 1200
# Never plan to use more than this share of the memory available.
_AVAILABLE_SHARE = 0.8


def default_gib() -> float:
    """The default LLM-like size: 2 GiB, or an eighth of the memory available if that is less."""
    available = float(psutil.virtual_memory().available)
    return round(min(_MAX_DEFAULT_GIB, available / 8 / 2**30), 2)


def _suites(args: argparse.Namespace) -> tuple[str, ...]:
    if args.suite:
        return tuple(dict.fromkeys(args.suite))
    # The first benchmark's habit: --small N alone meant the many-small state dict.
    return ("small",) if args.small is not None else ("save",)


def _check_fits(suites: tuple[str, ...], gib: float, small: int) -> None:
    """Refuse sizes that cannot fit in memory, before anything is built (an OOM kill says nothing)."""
    llm, many = gib * 2**30, small * _SMALL_TENSOR_BYTES
    sizes = {
        "save": llm,
        "convert": llm,
        "lopsided": llm,
        "load": llm,
        "small": many,
        "load-small": many,
        "scaling": llm + many,  # both state dicts are kept
        "scaling:llm": llm,
        "scaling:small": many,
        "compress": llm * 1.6,  # built as fp32+bf16, then cast to bf16
        "quantized": llm,
        "disk": llm,
        "read": llm,
    }
    needed = max(sizes[suite] * _HELD[suite] for suite in suites)
    available = psutil.virtual_memory().available * _AVAILABLE_SHARE
    if needed > available:
        raise ValueError(
            f"--suite {' '.join(suites)} needs about {needed / 2**30:.1f} GiB of memory and"
            f" {available / 2**30:.1f} GiB can be used here: lower --gib or --small"
        )


@dataclass(frozen=True, slots=True)
class Target:
    """Where a scenario writes: a label for the table and an existing directory."""

    label: str
    directory: str


def _target(spec: str, disk_dir: str | None) -> Target:
    if spec == "shm":
        if not os.path.isdir(_SHM):
            raise ValueError(f"target shm: {_SHM} does not exist on this machine")
        return Target("shm", _SHM)
    if spec == "disk":
        return Target("disk", os.path.abspath(disk_dir or os.getcwd()))
    if not os.path.isdir(spec):
        raise ValueError(f"target {spec!r} is neither shm, disk nor an existing directory")
    return Target(spec, os.path.abspath(spec))


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    """What one ``parallel-dcp bench`` run measures and where it reports.

    Attributes:
        suites: any of ``save`` (LLM-like state dict), ``small`` (many small tensors), ``convert``,
            ``lopsided``, ``load`` (reading an LLM-like checkpoint back), ``load-small``.
        gib: size of the LLM-like state dict (save and convert suites).
        small: number of tensors of the many-small state dict.
        workers: the worker / thread / process counts compared (ascending, unique).
        reps: timed repetitions per configuration; warmup: untimed rounds before them.
        targets: directories written to; syncs: ``sync_files`` settings (True = fsync).
        peers: also run torch.save, safetensors and the optional multi-process peers.
        convert_memory_limit: ``memory_limit`` of our conversions; None picks one per size.
        json_path / plot_path: where to write the JSON results and the PNG plot, if anywhere.
        verbose: report every run on stderr.
    """

    suites: tuple[str, ...]
    gib: float
    small: int
    workers: tuple[int, ...]
    reps: int
    warmup: int
    targets: tuple[Target, ...]
    syncs: tuple[bool, ...]
    peers: bool = True
    convert_memory_limit: int | None = None
    json_path: str | None = None
    plot_path: str | None = None
    verbose: bool = False

    def __post_init__(self) -> None:
        if not self.suites or not set(self.suites) <= set(SUITES):
            raise ValueError(f"suites must be among {', '.join(SUITES)}, got {self.suites}")
        if not self.gib > 0:
            raise ValueError(f"--gib must be > 0, got {self.gib}")
        if self.small < 2:
            raise ValueError(f"--small must be >= 2, got {self.small}")
        if not self.workers or min(self.workers) < 1 or list(self.workers) != sorted(set(self.workers)):
            raise ValueError(f"--workers must be ascending counts >= 1, got {self.workers}")
        if self.reps < 1 or self.warmup < 0:
            raise ValueError(f"--reps must be >= 1 and --warmup >= 0, got {self.reps} and {self.warmup}")
        if not self.targets or not self.syncs:
            raise ValueError("at least one target and one sync setting are needed")
        _check_fits(self.suites, self.gib, self.small)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchConfig:
        """Map the flags of :func:`parallel_dcp.benchmark.add_arguments` onto a config.

        Raises:
            ValueError: a flag's value is out of range or names no usable target.
        """
        specs = [args.dir] if args.dir else (args.targets or ["disk"])
        workers = args.workers or list(range(1, usable_cores() + 1))
        return cls(
            suites=_suites(args),
            gib=args.gib if args.gib is not None else default_gib(),
            small=args.small if args.small is not None else 50_000,
            workers=tuple(sorted(set(workers))),
            reps=args.reps,
            warmup=args.warmup,
            targets=tuple(_target(spec, args.disk_dir) for spec in dict.fromkeys(specs)),
            syncs=tuple(dict.fromkeys(value == "on" for value in args.sync)),
            peers=not args.no_peers,
            convert_memory_limit=parse_size(args.convert_memory_limit) if args.convert_memory_limit else None,
            json_path=args.json,
            plot_path=args.plot,
            verbose=args.verbose,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``parallel-dcp bench`` flags (see :class:`BenchConfig` for what each one sets)."""
    parser.add_argument("--suite", nargs="+", choices=SUITES, help="what to measure (default: save)")
    parser.add_argument("--gib", type=float, help="LLM-like state dict size (default: min(2, RAM available/8))")
    parser.add_argument("--small", type=int, metavar="N", help="tensors of the many-small state dict (default 50000)")
    parser.add_argument(
        "--workers", type=int, nargs="+", metavar="N", help="counts to compare (default: 1..usable cores)"
    )
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per configuration (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument(
        "--targets",
        nargs="+",
        default=None,
        metavar="TARGET",
        help="shm, disk or a directory (default: disk, the current directory: where checkpoints live)",
    )
    parser.add_argument(
        "--disk-dir", metavar="DIR", help="where the disk target writes (default: the current directory)"
    )
    parser.add_argument("--dir", metavar="DIR", help="benchmark this one directory (instead of --targets)")
    parser.add_argument("--sync", nargs="+", choices=["on", "off"], default=["on"], help="fsync files (default: on)")
    parser.add_argument("--no-peers", action="store_true", help="skip torch.save, safetensors and nvrx rows")
    parser.add_argument(
        "--convert-memory-limit", metavar="SIZE", help="memory_limit of our conversions (default: size/4 or more)"
    )
    parser.add_argument("--json", metavar="PATH", help="write all rows, ratios and machine facts here")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of GiB/s against workers here")
    parser.add_argument("-v", "--verbose", action="store_true", help="report every run on stderr")
