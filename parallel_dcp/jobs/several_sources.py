"""A conversion of several sources, each into its own output (``convert([a, b], dst)``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from parallel_dcp.formats import open_source
from parallel_dcp.jobs.convert import convert_one
from parallel_dcp.jobs.dryrun import DryRunPlan
from parallel_dcp.jobs.pipeline import SaveResult
from parallel_dcp.options import Options

__all__ = ["convert_all"]


def convert_all(
    sources: Sequence[str | os.PathLike[str]], outputs: Sequence[str], options: Options, **each: Any
) -> list[SaveResult | DryRunPlan]:
    """:func:`convert_one` of each source into its output. With several, every source is opened
    first: a later one that cannot be opened fails before anything is written (it failed after
    the earlier outputs were committed, and the error did not say so); a failure past that (a
    source's bytes that do not match its checksums are found only as its own job reads them)
    names the outputs committed before it."""
    if len(sources) > 1:
        for src in sources:
            trust = each.get("trust_pickle", False)
            open_source(
                src, trust_pickle=trust, storage_options=options.storage_options, memory_limit=options.memory_ceiling()
            ).close()
    results: list[SaveResult | DryRunPlan] = []
    for src, out in zip(sources, outputs, strict=True):
        try:
            results.append(convert_one(src, out, options, **each))
        except BaseException as failure:
            done = [str(r.path) for r in results if isinstance(r, SaveResult)]
            if done:
                failure.add_note(f"converted and committed before it: {', '.join(done)}")
            raise
    return results
