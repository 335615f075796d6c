"""Run the selected cross product: suite x target x sync setting, one scenario at a time.

    state dicts (built once per run, shared by the scenarios that use them)
        save, convert: synthetic.llm_like(gib)      small: synthetic.many_small(count)
        load, load-small: the same, built per scenario, written twice, then dropped
    for each suite, target, sync:
        mkdtemp on the target ── convert: build the sources there (untimed)
        cases (writers.py, peers.py, conversion.py) ── run_interleaved (measure.py)
        remove the temp dir ── Scenario (results.py)

Ratios are only ever taken within one scenario, whose cases ran interleaved.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from parallel_dcp.benchmark import peers
from parallel_dcp.benchmark.compression import bf16_llm, compress_cases, minilm
from parallel_dcp.benchmark.config import BenchConfig, Target
from parallel_dcp.benchmark.conversion import build_sources, convert_cases, convert_memory_limit
from parallel_dcp.benchmark.disk import disk_cases
from parallel_dcp.benchmark.governor_cost import GOVERNOR_COUNTS, governor_cost
from parallel_dcp.benchmark.loading import load_cases, write_checkpoints
from parallel_dcp.benchmark.measure import Case, run_interleaved
from parallel_dcp.benchmark.pieces import executor_projections, probe_executors
from parallel_dcp.benchmark.quantized import QUANTIZED, quantized_cases, quantized_state_dict
from parallel_dcp.benchmark.reading import read_cases
from parallel_dcp.benchmark.results import Scenario
from parallel_dcp.benchmark.scaling import Samples, project, scaling_cases
from parallel_dcp.benchmark.writers import CRC_NOTE, flat_tensors, limit_cases, save_cases, unsplit_case
from parallel_dcp.engine.memory import format_bytes
from parallel_dcp.synthetic import llm_like, lopsided, many_small, tensor_bytes

__all__ = ["run_all"]

# What a scenario keeps on its target at once, in state-dict sizes: one output (save); the two
# sources and one output (convert). Plus slack for metadata and zip headers.
_SPACE_FACTOR = {
    "save": 1.2,
    "small": 1.5,
    "convert": 3.3,
    "lopsided": 1.2,
    "scaling:llm": 1.2,
    "scaling:small": 1.5,
    "load": 2.4,
    "load-small": 3.0,
    "compress:minilm": 6.0,
    "compress:llm": 6.0,
    # the quantized source, our bf16 output and stock's (x2 for FP8 -> bf16, x4 for MXFP4)
    "quantized:fp8": 5.5,
    "quantized:mxfp4": 9.5,
    "quantized:quantize": 2.5,
    "disk": 4.5,  # the checkpoint, the safetensors source, one output, the probe's files
    "read": 2.2,  # the Hugging Face folder and the DCP copy
}
# The compress suite: the real model, and the LLM-like state dict in bfloat16.
_COMPRESS = ("compress:minilm", "compress:llm")
# The scaling suite projects both shapes of state dict: a few large tensors, many small ones.
_SCALING = ("scaling:llm", "scaling:small")


class StateDicts:
    """The state dicts of a run, each built on first use and then kept."""

    def __init__(self, config: BenchConfig) -> None:
        self._config = config
        self._built: dict[str, Any] = {}

    def get(self, suite: str) -> Any:
        if suite in ("load", "load-small", "read"):  # written to the target, then dropped: not kept
            return self.build(suite)
        if suite in QUANTIZED:  # written as a release, then dropped: not kept
            return quantized_state_dict(suite, self._config.gib)
        if suite in _COMPRESS:
            if suite not in self._built:
                if suite == "compress:minilm":
                    self._built[suite], self._built["compress:minilm:what"] = minilm()
                else:
                    self._built[suite] = bf16_llm(self._config.gib)
            return self._built[suite]
        suite = {"scaling:small": "small"}.get(suite, suite)
        kind = suite if suite in ("small", "lopsided") else "llm"
        if kind not in self._built:
            build = {"small": lambda: many_small(self._config.small), "lopsided": lambda: lopsided(self._config.gib)}
            self._built[kind] = build.get(kind, lambda: llm_like(self._config.gib))()
        return self._built[kind]

    def build(self, suite: str) -> Any:
        return many_small(self._config.small) if suite == "load-small" else llm_like(self._config.gib)

    def describe(self, suite: str, sd: Any | None = None) -> str:
        suite = {"scaling:small": "small", "scaling:llm": "save"}.get(suite, suite)
        sd = self.get(suite) if sd is None else sd
        size = format_bytes(tensor_bytes(sd))
        if suite in ("small", "load-small"):
            return f"many-small: {len(flat_tensors(sd)):,} optimizer-like tensors, {size}"
        if suite == "compress:minilm":
            return f"{self._built['compress:minilm:what']}: {len(sd):,} tensors, {size}"
        if suite == "compress:llm":
            return f"LLM-like in bfloat16: {len(sd):,} tensors, {size}"
        if suite in QUANTIZED:
            dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in sd.values()})
            return f"{suite.split(':')[1]} release: {len(sd):,} tensors ({'+'.join(dtypes)}), {size}"
        if suite == "lopsided":
            return f"lopsided: one tensor of 60% of the bytes beside {len(sd) - 1:,} others, {size}"
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in flat_tensors(sd).values()})
        return f"LLM-like: {len(sd):,} tensors ({'+'.join(dtypes)}), {size}"


def _check_space(target: Target, suite: str, nbytes: int) -> None:
    free = shutil.disk_usage(target.directory).free
    needed = int(nbytes * _SPACE_FACTOR[suite])
    if free < needed:
        raise OSError(
            f"target {target.label} ({target.directory}) has {format_bytes(free)} free; the {suite} suite "
            f"needs about {format_bytes(needed)}: lower --gib/--small or pick another target"
        )


def _cases(
    suite: str, sd: Any, root: str, sync: bool, config: BenchConfig
) -> tuple[list[Case], list[str], Samples | None]:
    workers = list(config.workers)
    if suite in ("load", "load-small"):
        n = 2 if 2 in workers else max(workers)
        paths = write_checkpoints(sd, root, n)
        sd.clear()  # the checkpoints hold it now; the rows need the memory
        notes = [
            f"[stock]: written by dcp.save(thread_count={n}); [pdcp]: by parallel_dcp.save(workers={n})",
            "x stock: into= and FastReader over stock dcp.load into preallocated tensors; load w= over the"
            " stock allocating load (_load_state_dict_from_keys); of limit: plain read of ready buffers",
            "the checkpoints were written just before the timed rounds, so they are read from the page cache",
        ]
        return load_cases(paths, n), notes, None
    if suite in _COMPRESS:
        cases, notes = compress_cases(sd, root, workers)
        return cases, notes, None
    if suite in QUANTIZED:
        cases, notes = quantized_cases(suite, sd, root, workers, sync)
        sd.clear()  # the release on the target holds it now; the rows need the memory
        return cases, notes, None
    if suite == "disk":
        cases, notes = disk_cases(sd, root, max(workers), sync)
        return cases, notes, None
    if suite == "read":
        cases, notes = read_cases(sd, root, 2 if 2 in workers else max(workers))
        sd.clear()  # the two copies hold it now; every row allocates its own output
        return cases, notes, None
    tensors = flat_tensors(sd)
    if suite in _SCALING:
        cases, samples = scaling_cases(sd, sorted({1, *workers}), sync)
        notes = ["forked workers at every count (executor='processes'); see the projection's model below"]
        return cases + limit_cases(list(tensors.values()), sorted({1, *workers}), sync), notes, samples
    if suite == "lopsided":  # chunking on (the default) against whole keys as the unit of work
        cases = save_cases(sd, workers, sync, [], with_files=False)
        cases.insert(len(workers), unsplit_case(sd, max(workers), sync))
        return cases, [CRC_NOTE, "unsplit: chunk_size larger than any tensor, so the big one is one task"], None
    if suite != "convert":
        found = peers.peer_cases(sd, workers, sync) if config.peers else []
        return save_cases(sd, workers, sync, found, with_files=config.peers), [CRC_NOTE], None
    nbytes = tensor_bytes(sd)
    sources = build_sources(sd, root, nbytes)
    largest = max(t.nbytes for t in tensors.values())
    limit = config.convert_memory_limit or convert_memory_limit(nbytes, largest, max(workers))
    notes = [
        f"our conversions ran with memory_limit={format_bytes(limit)} ({limit / nbytes:.0%} of the state dict)",
        "the sources were written just before the timed rounds, so they are read from the page cache",
    ]
    cases = convert_cases(sources, workers, sync, limit) + limit_cases(list(tensors.values()), workers, sync)
    return cases, notes, None


def _scenario(suite: str, target: Target, sync: bool, dicts: StateDicts, config: BenchConfig) -> Scenario:
    sd = dicts.get(suite)
    described = dicts.describe(suite, sd)
    nbytes = tensor_bytes(sd)
    _check_space(target, suite, nbytes)
    scenario = Scenario(
        suite=suite,
        target=target.label,
        directory=target.directory,
        sync=sync,
        state_dict=described,
        nbytes=nbytes,
        tensors=len(flat_tensors(sd)),
        reps=config.reps,
        warmup=config.warmup,
        workers=list(config.workers),
    )
    _say(f"bench: {scenario.key}: {scenario.state_dict}")
    root = tempfile.mkdtemp(prefix="pdcp-bench-", dir=target.directory)
    try:
        cases, scenario.notes, samples = _cases(suite, sd, root, sync, config)
        progress = _say if config.verbose else None
        # the read suite's rows in a new order each round (measure.round_order; reading.py says why)
        scenario.measured = run_interleaved(cases, config.reps, config.warmup, root, progress, shuffled=suite == "read")
        if samples is not None:
            scenario.projection = project(samples, scenario.measured, config.warmup, scenario.tensors)
            scenario.projection |= _pieces(suite, sd, root, sync, config, scenario)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return scenario


def _pieces(suite: str, sd: Any, root: str, sync: bool, config: BenchConfig, scenario: Scenario) -> dict[str, Any]:
    """The scaling suite's measured pieces per executor and their projections (pieces.py); the
    governor's cost once per run, in the LLM-like scenario (its children inherit that state dict)."""
    _say(f"bench: {scenario.key}: probing executors alone and beside a busy thread")
    probe = probe_executors(sd, root, config.reps, sync)
    found: dict[str, Any] = {
        "probe": probe,
        "executors": executor_projections(probe, scenario.nbytes, scenario.tensors),
    }
    if suite == "scaling:llm":
        _say(f"bench: {scenario.key}: governor reading at {', '.join(map(str, GOVERNOR_COUNTS))} processes")
        found["governor"] = governor_cost(config.reps)
    return found


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_all(config: BenchConfig, on_scenario: Callable[[Scenario], None] | None = None) -> list[Scenario]:
    """Every scenario of ``config``, in suite, target, sync order; ``on_scenario`` sees each as it ends."""
    dicts = StateDicts(config)
    scenarios = []
    try:
        expand = {"scaling": _SCALING, "compress": _COMPRESS, "quantized": QUANTIZED}
        for suite in (kind for name in config.suites for kind in expand.get(name, (name,))):
            for target in config.targets:
                for sync in config.syncs:
                    scenario = _scenario(suite, target, sync, dicts, config)
                    scenarios.append(scenario)
                    if on_scenario is not None:
                        on_scenario(scenario)
    finally:
        peers.close()
    return scenarios
