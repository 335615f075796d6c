"""Direct reads of DCP records in place: 1 MiB aligned reads straight into the destination's own
pages where its memory is aligned as the file, a bounce buffer only for partial pages, and fresh
load targets seated so that every large one is such a destination (formats/seated.py)."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import parallel_dcp
from parallel_dcp.engine.memory import MemoryGovernor
from parallel_dcp.formats import seated
from parallel_dcp.storage import direct_read
from parallel_dcp.storage.direct_read import ShardFile
from parallel_dcp.storage.io_mode import ALIGN
from tests.conftest import assert_same

MiB = 1 << 20


def _aligned(nbytes: int, skew: int) -> tuple[memoryview, Any]:
    """A view of ``nbytes`` whose address is ``skew`` bytes past a page (and the memory behind it)."""
    raw = torch.empty(nbytes + 2 * ALIGN, dtype=torch.uint8)
    start = -raw.data_ptr() % ALIGN + skew
    return memoryview(raw[start : start + nbytes].numpy()).cast("B"), raw


def _spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Bytes read straight into destinations ('direct') and through bounce buffers ('bounce'),
    one entry per read."""
    seen: dict[str, list[int]] = {"direct": [], "bounce": []}
    pread, pread_to = ShardFile._pread, ShardFile._pread_to

    def bounce(self: ShardFile, index: int, at: int, length: int) -> int:
        seen["bounce"].append(length)
        return pread(self, index, at, length)

    def direct(self: ShardFile, into: memoryview, at: int, length: int) -> int:
        assert at % ALIGN == 0 and length % ALIGN == 0 and direct_read.address(into) % ALIGN == 0
        seen["direct"].append(length)
        return pread_to(self, into, at, length)

    monkeypatch.setattr(ShardFile, "_pread", bounce)
    monkeypatch.setattr(ShardFile, "_pread_to", direct)
    return seen


def test_a_view_aligned_as_the_file_is_read_in_place_in_1_mib_reads(
    disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: every byte went through 4 MiB bounce buffers and was copied out."""
    payload = os.urandom(9 * MiB + 5000)
    (disk / "f").write_bytes(payload)
    seen = _spy(monkeypatch)
    offset = 3 * ALIGN + 100  # mid-page: the view's address is 100 bytes into a page too
    view, _keep = _aligned(8 * MiB + 123, 100)
    shard = ShardFile(disk / "f", io="direct")
    try:
        assert shard.direct
        shard.read(offset, [view])
    finally:
        shard.close()
    assert bytes(view) == payload[offset : offset + view.nbytes]
    assert max(seen["direct"]) == direct_read.REQUEST_BYTES
    assert sum(seen["bounce"]) <= 2 * ALIGN  # only the first and last partial pages
    assert sum(seen["direct"]) >= view.nbytes - 2 * ALIGN


def test_views_of_any_alignment_get_the_files_bytes(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Aligned, misaligned, tiny and page-long views one after the other, in one read."""
    monkeypatch.setattr(direct_read, "PIECE_BYTES", 64 << 10)  # requests of at most 64 KiB here
    payload = os.urandom(3 * MiB)
    (disk / "f").write_bytes(payload)
    rng = random.Random(7)
    for _ in range(20):
        offset = rng.randrange(0, 64 << 10)
        views, keep, position = [], [], offset
        while position < len(payload) - (300 << 10) and len(views) < 12:
            n = rng.choice([1, 7, ALIGN, ALIGN + 1, 5000, 70 << 10, 200 << 10])
            skew = position % ALIGN if rng.random() < 0.6 else rng.randrange(0, ALIGN)
            view, raw = _aligned(n, skew)
            views.append(view)
            keep.append(raw)
            position += n
        shard = ShardFile(disk / "f", io="direct")
        try:
            shard.read(offset, list(views))
        finally:
            shard.close()
        assert b"".join(bytes(v) for v in views) == payload[offset:position]


def test_a_view_that_runs_past_the_end_of_the_file_is_truncated(disk: Path) -> None:
    (disk / "f").write_bytes(os.urandom(2 * MiB + 10))
    view, _keep = _aligned(2 * MiB, 0)
    shard = ShardFile(disk / "f", io="direct")
    try:
        with pytest.raises(parallel_dcp.CorruptCheckpointError, match="truncated"):
            shard.read(ALIGN, [view])
    finally:
        shard.close()


def _state() -> dict[str, torch.Tensor]:
    """Large tensors of element sizes 1 to 8 (their records start at any byte of the shard)."""
    gen = torch.Generator().manual_seed(0)
    return {
        "a.f32": torch.randn(700, 1000, generator=gen),
        "b.bf16": torch.randn(1500, 999, generator=gen).to(torch.bfloat16),
        "c.f64": torch.randn(301, 1001, generator=gen).double(),
        "d.i8": torch.randint(-100, 100, (3 * MiB + 11,), generator=gen, dtype=torch.int8),
        "e.small": torch.randn(33, generator=gen),
        "f.f16": torch.randn(1, 1_100_001, generator=gen).half(),
    }


def _saved(disk: Path, writer: str) -> tuple[dict[str, torch.Tensor], Path]:
    """:func:`_state` saved to ``disk / "ckpt"`` by ``writer`` (parallel_dcp or stock DCP)."""
    sd = _state()
    path = disk / "ckpt"
    if writer == "stock":
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    else:
        parallel_dcp.save(sd, path, workers=2)
    return sd, path


def _reservations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """Every ``MemoryGovernor.reserve`` from now on: (bytes, what)."""
    reserved: list[tuple[int, str]] = []
    reserve = MemoryGovernor.reserve

    def spy(self: MemoryGovernor, nbytes: int, what: str) -> None:
        reserved.append((nbytes, what))
        reserve(self, nbytes, what)

    monkeypatch.setattr(MemoryGovernor, "reserve", spy)
    return reserved


@pytest.mark.parametrize("writer", ["parallel_dcp", "stock"])
def test_fresh_large_tensors_are_read_in_place(disk: Path, monkeypatch: pytest.MonkeyPatch, writer: str) -> None:
    """Where the bounce buffers cannot be in huge pages, a direct load into fresh tensors reads each
    large one's pages straight into its own memory (before: every byte bounced and copied),
    whatever byte its record's data starts at."""
    monkeypatch.setattr(seated, "rooms", lambda: True)
    sd, path = _saved(disk, writer)
    seen = _spy(monkeypatch)
    loaded = parallel_dcp.load(path, workers=2, io="direct")
    assert_same(loaded, sd)
    large = [k for k, t in sd.items() if t.nbytes > seated.ROOM_MIN_BYTES]
    # only record heads and tails, and each large tensor's partial first and last page, bounce
    assert sum(seen["bounce"]) <= 8 * ALIGN * len(large) + 2 * MiB
    assert sum(seen["direct"]) >= sum(sd[k].nbytes for k in large) - 2 * ALIGN * len(large)
    assert max(seen["direct"]) <= direct_read.REQUEST_BYTES
    for key in large:
        tensor = loaded[key]
        assert tensor.is_contiguous() and tensor.data_ptr() % tensor.element_size() == 0, key
        assert tensor.untyped_storage().nbytes() <= tensor.nbytes + ALIGN, key  # its room: one page more
    # the caller's tensors are filled where they are (through the bounce buffers)
    into = {k: torch.zeros_like(t) for k, t in sd.items()}
    addresses = {k: t.data_ptr() for k, t in into.items()}
    parallel_dcp.load(path, workers=2, io="direct", into=into)
    assert_same(into, sd)
    assert {k: t.data_ptr() for k, t in into.items()} == addresses


def test_the_rooms_page_is_charged_under_the_memory_limit(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seated, "rooms", lambda: True)
    sd = _state()
    parallel_dcp.save(sd, disk / "ckpt", workers=1)
    reserved = _reservations(monkeypatch)
    parallel_dcp.load(disk / "ckpt", workers=1, io="direct")
    large = sum(1 for t in sd.values() if t.nbytes > seated.ROOM_MIN_BYTES)
    output = [n for n, what in reserved if what.startswith("loading")]
    assert output == [sum(t.nbytes for t in sd.values()) + large * ALIGN]


@pytest.mark.parametrize("writer", ["parallel_dcp", "stock"])
def test_with_huge_page_bounce_buffers_fresh_tensors_get_no_room_and_are_bounced(
    disk: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """Where the bounce buffers are in huge pages (one device request a read), fresh tensors are
    plain ``torch.empty`` tensors filled through them, charged at their own size."""
    monkeypatch.setattr(direct_read, "huge_pages", lambda: True)
    monkeypatch.setattr(seated, "huge_pages", lambda: True)
    sd, path = _saved(disk, writer)
    seen = _spy(monkeypatch)
    reserved = _reservations(monkeypatch)
    loaded = parallel_dcp.load(path, workers=2, io="direct")
    assert_same(loaded, sd)
    large = [k for k, t in sd.items() if t.nbytes > seated.ROOM_MIN_BYTES]
    # every large tensor's bytes bounced, but where torch.empty happened to place a tensor at the
    # address its file offset has modulo ALIGN (as the allocator's state decides: seen in the
    # full suite, 2.7 of 13.6 MB), that part is read straight in: no byte goes unread either way
    assert sum(seen["bounce"]) + sum(seen["direct"]) >= sum(sd[k].nbytes for k in large)
    for key in large:
        assert loaded[key].untyped_storage().nbytes() == loaded[key].nbytes, key  # no room
    assert [n for n, what in reserved if what.startswith("loading")] == [sum(t.nbytes for t in sd.values())]


def test_seat_puts_a_tensor_where_its_file_offset_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seated, "rooms", lambda: True)  # rooms where the bounce buffers are in 4 KiB pages
    for dtype in (torch.uint8, torch.bfloat16, torch.float32, torch.float64):
        for offset in (0, 1, 3, 64, 4095, 4097, 12345):
            tensor, room = seated.fresh(dtype, (MiB // dtype.itemsize + 3,))
            assert room is not None
            landing = seated.seat(tensor, room, offset)
            assert (room.data_ptr() + landing - offset) % ALIGN == 0
            assert tensor.data_ptr() % dtype.itemsize == 0
            assert 0 <= room.data_ptr() + landing - tensor.data_ptr() < dtype.itemsize
            assert landing + tensor.nbytes <= room.nbytes
            data = torch.arange(tensor.numel()).to(dtype)
            room[landing : landing + tensor.nbytes].copy_(data.view(torch.uint8))
            seated.shift(tensor, room, landing)
            assert torch.equal(tensor, data)


def test_a_truncated_shard_of_large_records_is_refused_and_named(disk: Path) -> None:
    """Seating changes where the bytes land, not what is admitted: a shard cut inside a large
    record is refused (by name) before any of it is read into the fresh tensors."""
    sd = {k: t for k, t in _state().items() if t.nbytes > seated.ROOM_MIN_BYTES}
    parallel_dcp.save(sd, disk / "ckpt", workers=1)
    shard = max((disk / "ckpt").glob("*.distcp"), key=lambda p: p.stat().st_size)
    os.truncate(shard, shard.stat().st_size - 3 * MiB)
    with pytest.raises(parallel_dcp.CorruptCheckpointError, match="truncated") as raised:
        parallel_dcp.load(disk / "ckpt", workers=2, io="direct")
    assert shard.name in str(raised.value)
