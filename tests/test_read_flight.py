"""How many direct reads stay in flight: FLIGHT per process, shared by the reading threads reading
at the moment (one left alone keeps all of them), and a unit's record heads and tails read with
their reads in flight together (before: one at a time, 4 reads per thread at most)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import parallel_dcp
from parallel_dcp.storage import direct_read
from parallel_dcp.storage.direct_read import ShardFile
from tests.conftest import assert_same

MiB = 1 << 20


class _Counter:
    """The most calls of a spied method running at once (``when``: which calls count)."""

    def __init__(self, when: Callable[[int], bool] = lambda length: True) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.when = when

    def wrap(self, method: Any, pause: float) -> Any:
        def spied(shard: ShardFile, first: Any, at: int, length: int) -> Any:
            counted = self.when(length)
            if counted:
                with self.lock:
                    self.running += 1
                    self.most = max(self.most, self.running)
            try:
                if counted:
                    time.sleep(pause)  # long enough that the next reads are asked for meanwhile
                return method(shard, first, at, length)
            finally:
                if counted:
                    with self.lock:
                        self.running -= 1

        return spied


def _unaligned(nbytes: int) -> tuple[memoryview, bytearray]:
    raw = bytearray(nbytes + 4096)
    view = memoryview(raw)
    skew = (-direct_read.address(view) + 100) % 4096  # 100 bytes into a page: every byte bounces
    return view[skew : skew + nbytes], raw


def test_one_reading_thread_alone_keeps_every_read_of_the_process_in_flight(
    disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = os.urandom(20 * MiB + 999)
    (disk / "f").write_bytes(payload)
    counter = _Counter()
    monkeypatch.setattr(ShardFile, "_pread", counter.wrap(ShardFile._pread, 0.05))
    view, _keep = _unaligned(len(payload) - 1000)
    shard = ShardFile(disk / "f", io="direct")
    try:
        assert shard.direct
        shard.read(1000, [view])
    finally:
        shard.close()
    assert bytes(view) == payload[1000:]
    assert counter.most == direct_read.FLIGHT  # before: DEPTH (4) per reading thread, alone or not


def test_two_reading_threads_share_the_reads_in_flight(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Together they keep FLIGHT reads in flight, not FLIGHT each."""
    payloads = [os.urandom(24 * MiB + 77 * n) for n in range(2)]
    for n, payload in enumerate(payloads):
        (disk / f"f{n}").write_bytes(payload)
    counter = _Counter()
    monkeypatch.setattr(ShardFile, "_pread", counter.wrap(ShardFile._pread, 0.05))
    start = threading.Barrier(2)
    views = [_unaligned(len(p)) for p in payloads]

    def read(n: int) -> None:
        shard = ShardFile(disk / f"f{n}", io="direct")
        try:
            start.wait()
            shard.read(0, [views[n][0]])
        finally:
            shard.close()

    threads = [threading.Thread(target=read, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for (view, _keep), payload in zip(views, payloads, strict=True):
        assert bytes(view) == payload
    assert direct_read.FLIGHT <= counter.most <= direct_read.FLIGHT * 3 // 2


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_separate_spans_are_read_with_their_reads_in_flight_together(
    disk: Path, monkeypatch: pytest.MonkeyPatch, io: str
) -> None:
    payload = os.urandom(4 * MiB)
    (disk / "f").write_bytes(payload)
    counter = _Counter()
    if io == "direct":
        monkeypatch.setattr(ShardFile, "_pread", counter.wrap(ShardFile._pread, 0.05))
    else:
        read = ShardFile.read

        def buffered(shard: ShardFile, at: int, views: list[memoryview]) -> None:
            counter.wrap(lambda s, v, a, n: read(s, a, v), 0.05)(shard, views, at, 0)

        monkeypatch.setattr(ShardFile, "read", buffered)
    spans = [(n * 300_001 + 17, [memoryview(bytearray(5000 + n))]) for n in range(10)]
    shard = ShardFile(disk / "f", io=io)
    try:
        assert shard.direct == (io == "direct")
        shard.read_spans(spans)
    finally:
        shard.close()
    for at, (view,) in spans:
        assert bytes(view) == payload[at : at + view.nbytes]
    assert counter.most == (direct_read.DEPTH if io == "buffered" else min(direct_read.FLIGHT, len(spans)))


def test_a_units_record_heads_and_tails_are_read_with_their_reads_in_flight_together(
    disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One reading thread, twelve large records: their heads and tails (a few pages each) were read
    one after the other, one read in flight, before the thread read any record's bytes."""
    sd = {f"w{n}": torch.randn(3 * MiB // 8 + 13 * n, 2) for n in range(12)}  # 1.5 MiB each, and a bit
    path = disk / "ckpt"
    parallel_dcp.save(sd, path, workers=1)
    counter = _Counter(when=lambda length: length <= 4 * 4096)
    monkeypatch.setattr(ShardFile, "_pread", counter.wrap(ShardFile._pread, 0.05))
    into = {k: torch.zeros_like(t) for k, t in sd.items()}
    parallel_dcp.load(path, workers=1, io="direct", into=into)
    assert_same(into, sd)
    assert counter.most > 1


def _huge_bytes(start: int, end: int) -> int:
    """AnonHugePages of this process's mappings inside ``start``..``end`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="ascii") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                low, high = (int(x, 16) for x in first.split("-"))
                inside = low < end and high > start
            elif inside and first == "AnonHugePages:":
                total += int(line.split()[1]) << 10
    return total


def test_the_bounce_buffers_are_in_huge_pages_where_the_kernel_gives_them() -> None:
    """A 1 MiB read into 4 KiB pages is two device requests on a virtio disk (254 segments a
    request); in a 2 MiB page it is one. Before: the buffers were populated in 4 KiB pages."""
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not setting.exists() or "[never]" in setting.read_text():
        pytest.skip("no transparent huge pages on this kernel")
    ring = direct_read._take_buffers()
    try:
        assert len(ring) == direct_read.DEPTH
        huge = 0
        for buffer in ring:
            view = memoryview(buffer)
            start = direct_read.address(view)
            view.release()
            huge += _huge_bytes(start, start + len(buffer))
        assert huge >= 2 << 20  # at least one 2 MiB page among the ring's (all of them, unless memory is fragmented)
    finally:
        for buffer in ring:
            buffer.close()
