"""The memory limit a refusal advises is accepted when passed back.

The advice was rounded to nearest (``format_bytes``, one decimal): a need of 24.04 MiB said
"raise --memory-limit to at least 24.0 MiB", and 24.0 MiB was refused again with the same
advice (review s14 F13; diff, load and verify's admission alike). It is now rounded up.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import parallel_dcp
from parallel_dcp import MemoryLimitExceeded
from parallel_dcp.engine.memory import MemoryGovernor, parse_size

MIB = 1 << 20


def _advised(error: MemoryLimitExceeded) -> int:
    found = re.search(r"raise --memory-limit to at least ([0-9.]+ [KMGT]?i?B)", str(error))
    assert found is not None, str(error)
    return parse_size(found.group(1))


@pytest.mark.parametrize("need", [24 * MIB + 1, 24 * MIB + 40_000, 24 * MIB + MIB // 20 - 1, 3 * (1 << 30) + 7])
@pytest.mark.parametrize("how", ["check_item", "reserve"])
def test_the_advised_limit_is_accepted(need: int, how: str) -> None:
    def admit(limit: int) -> None:
        governor = MemoryGovernor(limit, measure=False)
        governor.reserve(MIB, "a hold")
        if how == "check_item":
            governor.check_item("k0", need)
        else:
            governor.reserve(need, "the output")

    with pytest.raises(MemoryLimitExceeded) as refused:
        admit(need)  # (the hold beside it makes it too little)
    admit(_advised(refused.value))


def test_diff_accepts_the_limit_it_advises(tmp_path: Path) -> None:
    state = {f"k{i}": torch.randn(256, 1024) for i in range(4)}
    for name in ("a", "b"):
        parallel_dcp.save(state, tmp_path / name, workers=1)
    with pytest.raises(MemoryLimitExceeded) as refused:
        parallel_dcp.diff(tmp_path / "a", tmp_path / "b", workers=2, memory_limit="2MiB")
    advised = _advised(refused.value)
    assert parallel_dcp.diff(tmp_path / "a", tmp_path / "b", workers=2, memory_limit=advised).same
