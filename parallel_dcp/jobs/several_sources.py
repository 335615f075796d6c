"""A conversion of several sources, each into its own output (``convert([a, b], dst)``)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from parallel_dcp.engine.sizes import format_bytes
from parallel_dcp.errors import MemoryLimitExceeded, ParallelDCPError, SourceNotCheckedWarning, plural, printable
from parallel_dcp.formats import open_source
from parallel_dcp.formats.base import Source
from parallel_dcp.jobs.convert import convert_one
from parallel_dcp.jobs.copy_files import checked_copies
from parallel_dcp.jobs.dryrun import DryRunPlan
from parallel_dcp.jobs.fallback import without_advice
from parallel_dcp.jobs.pipeline import SaveResult
from parallel_dcp.jobs.source_check import refuse_by_records
from parallel_dcp.jobs.targets import ShardedTarget, target_for
from parallel_dcp.jobs.top_level import refuse_non_mapping
from parallel_dcp.options import DEFAULT_SHARD_SIZE, Options

__all__ = ["convert_all"]

MiB = 1024 * 1024


def convert_all(
    sources: Sequence[str | os.PathLike[str]], outputs: Sequence[str], options: Options, **each: Any
) -> list[SaveResult | DryRunPlan]:
    """:func:`convert_one` of each source into its output. With several, every source is opened
    first: a later one that cannot be opened fails before anything is written (it failed after
    the earlier outputs were committed, and the error did not say so); a failure past that (a
    source's bytes that do not match its checksums are found only as its own job reads them)
    names the outputs committed before it (in its message, where it is one of ours: the API's
    caller reads that, as the command line's). Each source's refusals that need no hashing (a
    header, or a recorded index, not the one recorded) come before anything is written too, but
    for a job that reads a view of it (quantizing, a preset: not checked); so do the recorded side
    files each would copy (a later source's changed ``config.json`` was found only when its own
    conversion began), and each one's memory plan: a source that cannot be converted under the
    memory limit is refused before the first is converted, advising a limit every source plans
    under (the advice of the first refused covered it alone: followed, it converted the first
    source and refused the next)."""
    if len(sources) > 1:
        for src, out in zip(sources, outputs, strict=True):
            trust = each.get("trust_pickle", False)
            source = open_source(
                src, trust_pickle=trust, storage_options=options.storage_options, memory_limit=options.memory_ceiling()
            )
            try:
                refuse_non_mapping(source)
                if options.check_source and each.get("quantization") is None and each.get("preset") is None:
                    refuse_by_records(source)
                if options.check_source:
                    _check_side_files(source, out, options, each)
            finally:
                source.close()
        if not each.get("dry_run"):
            _refuse_what_would_not_fit(sources, outputs, options, each)
    results: list[SaveResult | DryRunPlan] = []
    for src, out in zip(sources, outputs, strict=True):
        try:
            results.append(convert_one(src, out, options, **each))
        except BaseException as failure:
            done = [str(r.path) for r in results if isinstance(r, SaveResult)]
            said = f"converted and committed before it: {', '.join(done)}"
            if done and isinstance(failure, ParallelDCPError) and [type(a) for a in failure.args] == [str]:
                failure.args = (f"{failure.args[0]} ({said})",)
            elif done:
                failure.add_note(said)
            raise
    return results


def _check_side_files(source: Source, out: str, options: Options, each: Mapping[str, Any]) -> None:
    """The side files ``source``'s conversion into ``out`` would copy, checked against their
    folder's record as that conversion checks them (convert_one): refused here if changed. Its
    warnings (an edited model card) are left to the conversion itself, which says them once."""
    target = target_for(
        out,
        each.get("to"),
        shard_size=each.get("shard_size", DEFAULT_SHARD_SIZE),
        storage_options=options.storage_options,
        compression=options.compression(),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SourceNotCheckedWarning)
        checked_copies(
            source,
            directory_output=isinstance(target, ShardedTarget),
            copy_files=each.get("copy_files", True),
            copy_files_from=each.get("copy_files_from"),
            storage_options=options.storage_options,
            limit=options.memory_ceiling(),
            check=True,
        )


def _refuse_what_would_not_fit(
    sources: Sequence[str | os.PathLike[str]], outputs: Sequence[str], options: Options, each: Mapping[str, Any]
) -> None:
    """Each source's conversion planned as its dry run plans it (nothing written; the warnings are
    left to the conversion itself, which says them once).

    Raises:
        MemoryLimitExceeded: a source's plan does not fit the limit; the message names each such
            source and the smallest limit all of them plan under.
    """
    refused: list[tuple[str | os.PathLike[str], MemoryLimitExceeded]] = []
    for src, out in zip(sources, outputs, strict=True):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                convert_one(src, out, options, **{**each, "dry_run": True})
        except MemoryLimitExceeded as exc:
            refused.append((src, exc))
    if not refused:
        return
    least = max(exc.measured for _, exc in refused)
    said = "; ".join(f"{printable(os.fspath(src))}: {without_advice(str(exc))}" for src, exc in refused)
    raise MemoryLimitExceeded(
        f"{plural(len(refused), 'source')} of {len(sources)} cannot be converted under the memory limit "
        f"{format_bytes(options.memory_ceiling())} (nothing was written): {said}. Raise --memory-limit to at least "
        f"{-(-least // MiB)} MiB (the smallest limit every source plans under)",
        limit=options.memory_ceiling(),
        measured=least,
        keys=[key for _, exc in refused for key in exc.keys],
    )
