"""``parallel-dcp bench``: parallel_dcp against stock DCP, its peers and the machine's limits.

Same bytes, same run: one synthetic state dict, built once, written by every configuration of a
scenario in interleaved rounds (one warm-up round, then ``--reps`` timed ones); medians with min
and max, CPU seconds, peak added memory, and ratios taken within the run.

    suites     save     LLM-like state dict (synthetic.llm_like): parallel_dcp.save w=1..N,
                        stock dcp.save t=1..N (defaults, and CRC off), nvrx (if installed),
                        torch.save, safetensors
               small    the same writers on many small optimizer-like tensors
               convert  safetensors shards and a torch.save file into DCP: ours vs the stock path
               load     reading a checkpoint back (written by stock dcp.save and by parallel_dcp):
                        parallel_dcp.load (allocating, into=), dcp.load + FastReader, stock
                        dcp.load (preallocated), the stock allocating load, plain reads
               load-small  the same on the many-small state dict (see benchmark.loading)
    limits     plain write of ready buffers by 1..N processes; memcpy (RAM)
    targets    shm (/dev/shm), disk (--disk-dir, default: the current directory), or a directory
    sync       on (fsync every file, the default of both DCP writers) / off

    parallel-dcp bench --gib 2 --targets shm --sync on --json bench.json --plot bench.png
    parallel-dcp bench --suite small --small 50000 --targets shm
    parallel-dcp bench --suite convert --gib 2 --targets shm disk --sync on off

Output: a table per scenario with summary lines on stdout, ``--json PATH`` (every row, ratio and
summary, with machine facts) and ``--plot PATH`` (PNG). The exit code is 1 when a core row failed
(ours, stock DCP, torch.save, safetensors, a limit); an optional peer that cannot run here only
gets a row saying why (nvidia-resiliency-ext when not installed; megatron-core, which needs CUDA).
"""

from __future__ import annotations

import argparse
import gc
import sys
import warnings
from typing import TYPE_CHECKING

from parallel_dcp.benchmark.config import BenchConfig
from parallel_dcp.benchmark.config import add_arguments as _add_arguments

if TYPE_CHECKING:  # imported when a run starts (they import torch): `parallel-dcp --help` stays quick
    from parallel_dcp.benchmark.results import Scenario

__all__ = ["add_arguments", "main", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` flags to ``parser`` (``parallel-dcp bench`` and ``bench/bench_save.py``)."""
    _add_arguments(parser)


def _print_scenario(scenario: Scenario) -> None:
    from parallel_dcp.benchmark.report import scenario_lines

    print("\n".join(scenario_lines(scenario)), flush=True)


def _ok(scenarios: list[Scenario]) -> bool:
    return not any(m.error and m.case.core for s in scenarios for m in s.measured)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark that the parsed flags describe; print, and write JSON and PNG if asked.

    Returns:
        0, or 1 when a core row (parallel_dcp, stock DCP, torch.save, safetensors, a limit) failed.

    Raises:
        ValueError: a flag is out of range or names no usable target.
        OSError: a target lacks the space the suite needs.
    """
    return _run(BenchConfig.from_args(args))


def _check_plotting(config: BenchConfig) -> None:
    """``--plot`` needs matplotlib, an optional extra: say so before minutes of measuring."""
    if not config.plot_path:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib, which is not installed: pip install '.[bench]' in a checkout "
            "(or pip install matplotlib), or leave out --plot"
        ) from None


def _run(config: BenchConfig) -> int:
    from parallel_dcp.benchmark.report import NOTES, document, write_json
    from parallel_dcp.benchmark.suites import run_all

    _check_plotting(config)
    # Every row starts with a full collection (measure.release_free_memory); without the freeze it
    # walks the quarter million objects that importing torch made, none of them garbage: 0.3-0.9 s
    # a row on a 2-core VM, more than the row itself at test sizes. Frozen for the run only: what
    # the run makes is still collected, and the caller's collector is as it was afterwards (a
    # caller that froze objects of its own keeps them frozen, the run's with them).
    already_frozen = gc.get_freeze_count() > 0
    gc.collect()
    gc.freeze()
    try:
        with warnings.catch_warnings():
            # dcp.save without a process group warns on every call; the table is the output here.
            warnings.simplefilter("ignore")
            scenarios = run_all(config, on_scenario=_print_scenario)
    finally:
        if not already_frozen:
            gc.unfreeze()
    ok = _ok(scenarios)
    print()
    print("\n".join(f"note: {note}" for note in NOTES))
    if config.json_path:
        write_json(config.json_path, document(config, scenarios, ok))
        print(f"results: {config.json_path}")
    if config.plot_path:
        from parallel_dcp.benchmark.plot import write_plot

        write_plot(config.plot_path, scenarios)
        print(f"plot: {config.plot_path}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """``python bench/bench_save.py [flags]``: parse ``argv`` (default ``sys.argv[1:]``), then run.

    Returns the exit code of :func:`run`; a bad flag exits 2 (argparse), a target without the
    space the suite needs returns 1 with the reason on stderr.
    """
    parser = argparse.ArgumentParser(
        prog="parallel-dcp bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = BenchConfig.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))  # exits 2
    try:
        # SIGTERM (a job scheduler's, `timeout`'s) ends the run as Ctrl-C does: each scenario's
        # folder of checkpoints (gigabytes, often on /dev/shm) is removed on the way out.
        from parallel_dcp.jobs.pipeline import terminate_as_interrupt  # (imports torch: not for --help)

        with terminate_as_interrupt():
            return _run(config)
    except OSError as exc:
        print(f"parallel-dcp bench: error: {exc}", file=sys.stderr)
        return 1
