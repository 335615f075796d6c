"""Whole tensors of safetensors files loaded into fresh memory through the direct reader's
huge-page bounce buffers (formats/bounced_read.py) where the kernel gives huge pages, and read in
place (formats/span_read.py) where it does not: the same bytes as ``safetensors.torch.load_file``
either way, 1 MiB reads in file order, every tensor its own memory, the buffers admitted under the
memory limit before any read."""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import parallel_dcp
from parallel_dcp.formats import bounced_read, span_read
from parallel_dcp.jobs import load_files
from parallel_dcp.storage import direct_read
from parallel_dcp.storage.direct_read import ShardFile
from parallel_dcp.storage.io_mode import ALIGN
from tests.conftest import assert_same
from tests.test_file_read_path import folder, release, stock
from tests.test_seated_read import _reservations

MiB = 1 << 20
CHUNK_BYTES = bounced_read.CHUNK_BYTES


def _down(n: int) -> int:
    return n - n % ALIGN


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[tuple[str, int, int]]]:
    """Every read: through a bounce buffer ('bounce': file, offset, length) or straight into the
    destination's memory by the in-place reader ('in place')."""
    seen: dict[str, list[tuple[str, int, int]]] = {"bounce": [], "in place": []}
    pread, read_into = ShardFile._pread, ShardFile.read_into
    lock = threading.Lock()

    def bounce(self: ShardFile, index: int, at: int, length: int) -> int:
        with lock:
            seen["bounce"].append((self.path.name, at, length))
        return pread(self, index, at, length)

    def in_place(self: ShardFile, views: list[memoryview], offset: int) -> int:
        with lock:
            seen["in place"].append((self.path.name, offset, sum(v.nbytes for v in views)))
        return read_into(self, views, offset)

    monkeypatch.setattr(ShardFile, "_pread", bounce)
    monkeypatch.setattr(ShardFile, "read_into", in_place)
    return seen


def _huge(monkeypatch: pytest.MonkeyPatch, given: bool) -> None:
    monkeypatch.setattr(bounced_read, "huge_pages", lambda: given)


def _data_start(path: Path) -> int:
    """Where a safetensors file's tensor bytes start (after its header)."""
    return path.stat().st_size - sum(t.nbytes for t in load_file(str(path)).values())


@pytest.mark.parametrize("huge", [True, False], ids=["huge-pages", "no-huge-pages"])
def test_a_folder_gives_load_files_bytes_bounced_or_in_place(
    disk: Path, monkeypatch: pytest.MonkeyPatch, huge: bool
) -> None:
    """Huge pages: every byte through the bounce buffers (none straight into a tensor); without
    them: every byte straight into place, as before."""
    _huge(monkeypatch, huge)
    src = folder(disk / "hf", release())
    seen = _reads(monkeypatch)
    loaded = parallel_dcp.load(src, workers=2, io="direct")
    assert_same(loaded, stock(src))
    if huge:
        assert seen["bounce"] and seen["in place"] == []
    else:
        assert seen["in place"] and seen["bounce"] == []
    # io="buffered" reads in place whatever the pages (no direct read to bounce)
    seen["bounce"].clear()
    seen["in place"].clear()
    assert_same(parallel_dcp.load(src, workers=2, io="buffered"), stock(src))
    assert seen["in place"] and seen["bounce"] == []


@pytest.mark.parametrize("chunk", [CHUNK_BYTES, 1 * MiB, 3 * ALIGN], ids=["default", "1MiB", "3pages"])
def test_bounced_reads_are_1_mib_in_file_order_each_byte_once(
    disk: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Each file is read from its first tensor's page to its end in reads of at most 1 MiB that
    follow one another (no byte read twice, none outside the file's pages), whatever the chunks
    the threads take; the bytes land in the right tensors."""
    _huge(monkeypatch, True)
    monkeypatch.setattr(bounced_read, "CHUNK_BYTES", chunk)
    src = folder(disk / "hf", release())
    seen = _reads(monkeypatch)
    assert_same(parallel_dcp.load(src, workers=2, io="direct"), stock(src))
    for shard in sorted(src.glob("*.safetensors")):
        reads = sorted((at, n) for name, at, n in seen["bounce"] if name == shard.name)
        assert reads, shard.name
        assert reads[0][0] == _down(_data_start(shard)), shard.name
        assert all(at + n == following for (at, n), (following, _) in itertools.pairwise(reads)), shard.name
        assert reads[-1][0] + reads[-1][1] == _up(shard.stat().st_size), shard.name
        assert max(n for _, n in reads) <= direct_read.REQUEST_BYTES
        if chunk >= MiB:  # chunks of whole reads: full 1 MiB reads but the last
            assert all(n == direct_read.REQUEST_BYTES for _, n in reads[:-1]), (shard.name, reads)


def test_small_tensors_hold_their_own_bytes(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors that share a span in the in-place reader (small neighbours) each come out as
    memory of their own: the caller keeps, frees or saves each alone."""
    _huge(monkeypatch, True)
    src = folder(disk / "hf", release())
    loaded = parallel_dcp.load(src, workers=2, io="direct")
    assert_same(loaded, stock(src))
    small = [k for k, t in loaded.items() if 0 < t.nbytes < span_read.OWN_BYTES]
    assert len(small) >= 4
    for key, tensor in loaded.items():
        assert tensor.untyped_storage().nbytes() == tensor.nbytes, key
    pointers = [t.untyped_storage().data_ptr() for t in loaded.values() if t.nbytes]
    assert len(set(pointers)) == len(pointers)


def test_a_key_subset_reads_only_the_pages_of_its_tensors(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _huge(monkeypatch, True)
    src = folder(disk / "hf", release())
    seen = _reads(monkeypatch)
    keys = ["a.norm", "b.scalar", "c.head"]
    loaded = parallel_dcp.load(src, keys=keys, workers=2, io="direct")
    want = stock(src)
    assert list(loaded) == keys
    assert_same(loaded, {k: want[k] for k in keys})
    read = sum(n for _, _, n in seen["bounce"])
    assert sum(want[k].nbytes for k in keys) <= read <= sum(want[k].nbytes for k in keys) + 2 * ALIGN * len(keys)


def test_the_bounce_buffers_are_admitted_and_each_thread_holds_one_ring(
    disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four files, two threads: the threads' rings are reserved before any read, and a thread
    closes one file (its ring kept for the next) before it opens another."""
    _huge(monkeypatch, True)
    monkeypatch.setattr(bounced_read, "CHUNK_BYTES", 64 << 10)  # threads share each file
    state = release()
    src = disk / "hf"
    src.mkdir()
    from safetensors.torch import save_file

    keys = list(state)
    for i in range(4):
        save_file({k: state[k] for k in keys[2 * i : 2 * i + 2]}, str(src / f"model-0000{i + 1}-of-00004.safetensors"))
    reserved = _reservations(monkeypatch)
    open_now: dict[int, int] = {}
    most: list[int] = [0]
    lock = threading.Lock()
    init, close = ShardFile.__init__, ShardFile.close

    def opened(self: ShardFile, path: str | os.PathLike[str], *, io: str = "buffered") -> None:
        with lock:
            assert reserved and any("read buffers" in what for _, what in reserved)  # admitted first
            me = threading.get_ident()
            open_now[me] = open_now.get(me, 0) + 1
            most[0] = max(most[0], open_now[me])
        init(self, path, io=io)

    def closed(self: ShardFile) -> None:
        if self.fd >= 0:
            with lock:
                open_now[threading.get_ident()] -= 1
        close(self)

    monkeypatch.setattr(bounced_read.ShardFile, "__init__", opened)
    monkeypatch.setattr(bounced_read.ShardFile, "close", closed)
    loaded = parallel_dcp.load(src, workers=2, io="direct")
    assert_same(loaded, stock(src))
    assert most[0] == 1
    buffers = [n for n, what in reserved if what.startswith("read buffers for ")]
    assert buffers == [2 * direct_read.direct_read_memory()]


def test_no_room_for_a_ring_reads_in_place_under_the_limit(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Room for the tensors but not for one thread's bounce buffers: read in place (no buffer
    held), not refused."""
    _huge(monkeypatch, True)
    src = folder(disk / "hf", release())
    seen = _reads(monkeypatch)
    limit = 12 * MiB
    assert limit < direct_read.direct_read_memory()
    loaded = parallel_dcp.load(src, workers=2, io="direct", memory_limit=limit)
    assert_same(loaded, stock(src))
    assert seen["in place"] and seen["bounce"] == []


def test_a_file_truncated_after_its_header_is_refused_before_any_bounced_read(
    disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _huge(monkeypatch, True)
    src = folder(disk / "hf", release())
    shard = src / "model-00002-of-00002.safetensors"
    size = shard.stat().st_size
    seen = _reads(monkeypatch)
    real_plan = span_read.plan_spans

    def truncate_then_plan(tensors: list[tuple[str, str, int, torch.dtype, tuple[int, ...]]]) -> list[span_read.Span]:
        os.truncate(shard, size - 10)  # after the header was read and checked
        return real_plan(tensors)

    monkeypatch.setattr(load_files, "plan_spans", truncate_then_plan)
    with pytest.raises(parallel_dcp.CorruptCheckpointError, match=r"model-00002-of-00002.safetensors has .*truncated"):
        parallel_dcp.load(src, workers=2, io="direct")
    assert seen["bounce"] == [] and seen["in place"] == []


def test_a_file_that_shrinks_while_read_is_an_error(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sizes were checked, then the file lost its last pages: the read that comes back short
    says so (never tensors with bytes missing)."""
    _huge(monkeypatch, True)
    src = folder(disk / "hf", release())
    shard = src / "model-00002-of-00002.safetensors"
    size = shard.stat().st_size
    check = bounced_read.check_file_ends

    def check_then_truncate(ends: dict[str, tuple[int, str]]) -> None:
        check(ends)
        os.truncate(shard, size - 3 * ALIGN)

    monkeypatch.setattr(bounced_read, "check_file_ends", check_then_truncate)
    with pytest.raises(parallel_dcp.CorruptCheckpointError, match=r"model-00002-of-00002.safetensors ends at byte"):
        parallel_dcp.load(src, workers=2, io="direct")


def test_in_place_false_bounces_a_view_aligned_as_the_file() -> None:
    """A fresh tensor may by chance lie aligned as its bytes in the file: it is bounced too."""
    from parallel_dcp.storage.direct_jobs import plan_direct

    raw = torch.empty(3 * MiB + 2 * ALIGN, dtype=torch.uint8)
    start = -raw.data_ptr() % ALIGN
    view = memoryview(raw[start : start + 3 * MiB].numpy()).cast("B")
    assert all(job.into is not None for job in plan_direct(8 * ALIGN, [view], MiB))
    jobs = plan_direct(8 * ALIGN, [view], MiB, in_place=False)
    assert [(job.at, job.length, job.into) for job in jobs] == [(8 * ALIGN + i * MiB, MiB, None) for i in range(3)]
    assert [sum(v.nbytes for _, v in job.parts) for job in jobs] == [MiB] * 3
