"""A conversion of several sources, each into its own output (``convert([a, b], dst)``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from parallel_dcp.errors import ParallelDCPError
from parallel_dcp.formats import open_source
from parallel_dcp.jobs.convert import convert_one
from parallel_dcp.jobs.dryrun import DryRunPlan
from parallel_dcp.jobs.pipeline import SaveResult
from parallel_dcp.jobs.source_check import refuse_by_records
from parallel_dcp.options import Options

__all__ = ["convert_all"]


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
    for a job that reads a view of it (quantizing, a preset: not checked)."""
    if len(sources) > 1:
        for src in sources:
            trust = each.get("trust_pickle", False)
            source = open_source(
                src, trust_pickle=trust, storage_options=options.storage_options, memory_limit=options.memory_ceiling()
            )
            try:
                if options.check_source and each.get("quantization") is None and each.get("preset") is None:
                    refuse_by_records(source)
            finally:
                source.close()
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
