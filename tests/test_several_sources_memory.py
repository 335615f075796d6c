"""Several sources under one memory limit: a source that cannot be converted under it is refused
before the first is converted, and the advice covers every source (review s17 rev2 F1: the advice
of the first refused source was followed, the first output committed, then the next refused)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import parallel_dcp
from parallel_dcp import MemoryLimitExceeded


def test_a_later_source_that_cannot_fit_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    small = tmp_path / "small.safetensors"
    save_file({f"w{i}": torch.randn(256, 256) for i in range(4)}, str(small))  # 1 MiB
    big = tmp_path / "big"
    parallel_dcp.save({"table": torch.randn(48 * 1024, 256)}, big, workers=1)  # one 48 MiB chunk
    out = tmp_path / "out"
    with pytest.raises(MemoryLimitExceeded, match=r"1 source of 2 cannot be converted .*big: 'table'") as refused:
        parallel_dcp.convert([small, big], out, workers=1, memory_limit="24MiB")
    assert not out.exists() or not any(out.iterdir())
    advised = re.search(r"at least (\d+) MiB \(the smallest limit every source plans under\)", str(refused.value))
    assert advised is not None, str(refused.value)
    results = parallel_dcp.convert([small, big], out, workers=1, memory_limit=f"{advised.group(1)}MiB")
    assert len(results) == 2
    assert torch.equal(parallel_dcp.load(out / "big")["table"], parallel_dcp.load(big)["table"])
