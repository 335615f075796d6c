"""A unit of work never collides with a key (issue 31, item 6: a silently wrong diff).

When the memory limit splits a tensor into row ranges, each range is a unit of its own. Its
identity was a string built by formatting (``a[0:0:16]``), so a key literally named like that
overwrote the range's unit: ``diff`` reported the changed tensor ``a`` as unchanged, and
``verify --against`` raised a raw ``ValueError: partition needs unique keys``.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import parallel_dcp
from parallel_dcp.engine.chunks import Chunk, ChunkUnit

ROWS = 64


def _state(changed: bool) -> dict[str, torch.Tensor]:
    big = torch.arange(ROWS * 65536, dtype=torch.float32).reshape(ROWS, 65536)  # 16 MiB
    if changed:
        big[0, 0] += 1  # in the first row range
    # every name the first row ranges of "a" could have, as real keys
    decoys = {f"a[{d}:0:{n}]": torch.zeros(2) for d in (0, 1) for n in range(1, 65537) if d or n <= ROWS}
    return {"a": big} | {k: v for k, v in list(decoys.items())[: ROWS + 64]}


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(_state(False), str(a))
    save_file(_state(True), str(b))
    return a, b


def test_diff_of_a_split_tensor_beside_a_key_named_like_its_range_finds_the_change(pair: tuple[Path, Path]) -> None:
    report = parallel_dcp.diff(*pair, workers=1, memory_limit="24MiB")
    assert [c["key"] for c in report.changed] == ["a"]
    assert report.changed[0]["change"] == "content"


def test_verify_against_a_split_tensor_beside_a_key_named_like_its_range(pair: tuple[Path, Path]) -> None:
    a, b = pair
    # (24 MiB when written; + the coordinator's own 3 MiB, engine.memory.COORDINATOR_RUN_BYTES,
    # planned for verify since: the same room, so the same row ranges)
    report = parallel_dcp.verify(a, against=b, workers=1, memory_limit="27MiB")
    assert not report.ok
    assert report.problems == ["a: data differs (first at element 0)"]
    assert parallel_dcp.verify(a, against=a, workers=1, memory_limit="27MiB").ok


def test_a_chunk_unit_reads_as_its_range_but_equals_no_string() -> None:
    chunk = Chunk("a", 0, 0, 16, (64, 4))
    unit = ChunkUnit(chunk)
    assert str(unit) == "a[0:0:16]"
    assert unit != "a[0:0:16]" and unit != "a[0:0:16]"
    assert len({unit, "a[0:0:16]"}) == 2
    assert unit == ChunkUnit(Chunk("a", 0, 0, 16, (64, 4)))
    back = pickle.loads(pickle.dumps(unit))
    assert back == unit and back.chunk == chunk and type(back) is ChunkUnit
