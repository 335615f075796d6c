"""The I/O layer's transients are counted at least at what they really hold (issue 31, item 1).

Admission counts, per task, the aligned buffers of a file written with O_DIRECT
(``direct_write_memory()``), a compressing record writer (``Compression.memory()``) and a
decompressing reader (``ZSTD_DECOMPRESS_BYTES``). Each case runs the real object on real data in
a fresh process (tests/memory_io_cases.py: every allocation shows as new pages there) and
measures the most it holds at once with the kernel's own high-water mark (exact; resident pages,
which errs high); the count must not be below it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parallel_dcp.storage import io_mode
from parallel_dcp.storage.direct_write import direct_write_memory
from tests.memory_io_cases import DIRECT_SMALL_SIZES, ENV

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024


def _run(case: str, where: Path) -> tuple[int, int]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.memory_io_cases", case, str(where)],
        cwd=ROOT,
        env=os.environ | ENV,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.splitlines()[-1])
    print(f"{case}: measured {figures['measured'] / MiB:.2f} MiB, counted {figures['counted'] / MiB:.2f} MiB")
    return figures["measured"], figures["counted"]


def test_a_direct_write_holds_its_counted_buffers_and_no_more(tmp_path: Path) -> None:
    refusal = io_mode.direct_refusal(tmp_path)
    if refusal is not None:
        pytest.skip(f"no O_DIRECT here: {refusal}")
    measured, counted = _run("direct", tmp_path)
    assert measured <= counted, (measured / MiB, counted / MiB)
    # the four aligned buffers were really filled and seen: the measurement is not of nothing
    assert measured >= counted // 2, (measured / MiB, counted / MiB)


@pytest.mark.parametrize("size", DIRECT_SMALL_SIZES)
def test_a_small_direct_write_is_counted_the_buffers_it_fills(size: int, tmp_path: Path) -> None:
    """A file smaller than the four buffers touches only those it fills (anonymous mappings: a
    page is resident from its first write): counted so, and the count still holds it."""
    refusal = io_mode.direct_refusal(tmp_path)
    if refusal is not None:
        pytest.skip(f"no O_DIRECT here: {refusal}")
    measured, counted = _run(f"direct:{size}", tmp_path)
    assert counted < direct_write_memory(), "a small file is not counted the whole ring"
    assert measured <= counted, (measured / MiB, counted / MiB)
    if size >= MiB:  # the buffers were really filled and seen: the measurement is not of nothing
        assert measured >= size // 2, (measured / MiB, size / MiB)


@pytest.mark.parametrize("level", [1, 3, 9])
def test_a_compressing_record_writer_holds_no_more_than_counted(level: int, tmp_path: Path) -> None:
    measured, counted = _run(f"compress:{level}", tmp_path)
    assert measured <= counted, (measured / MiB, counted / MiB)


@pytest.mark.parametrize("level", [3, 19])
def test_a_streamed_record_decompresses_within_its_count(level: int, tmp_path: Path) -> None:
    """Level 19 asks for zstd's largest window (8 MiB): the stream's worst case."""
    measured, counted = _run(f"stream:{level}", tmp_path)
    assert measured <= counted, (measured / MiB, counted / MiB)


def test_a_small_record_read_whole_decompresses_within_its_count(tmp_path: Path) -> None:
    measured, counted = _run("small", tmp_path)
    assert measured <= counted, (measured / MiB, counted / MiB)
