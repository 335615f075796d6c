"""A run's results are mapped side by side into one reserved range of the coordinator's addresses
(engine/result_region.py) and unmapped together, once, when the last of them goes: each result's
pages are charged at once as before, no view reads another result's bytes, a refused mapping fails
that result alone."""

from __future__ import annotations

import os
import pickle

import numpy
import pytest

from parallel_dcp.engine import messages
from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.pool import WorkerPool
from parallel_dcp.engine.result_region import ResultRegion


def _memory_file(data: bytes) -> int:
    fd = os.memfd_create("test-result")
    os.write(fd, data)
    return fd


def _mapped_ranges() -> set[tuple[int, int]]:
    with open("/proc/self/maps") as maps:
        return {tuple(int(x, 16) for x in line.split()[0].split("-")) for line in maps}  # type: ignore[misc]


def _shared_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssShmem:"))


def _base(view: memoryview) -> int:
    """The address of ``view``'s first byte."""
    return int(numpy.frombuffer(view, dtype=numpy.uint8).__array_interface__["data"][0])


def test_results_lie_side_by_side_charged_at_once_and_are_unmapped_together() -> None:
    region = ResultRegion()
    sizes = [300_000, 5, 70_000]
    shared = _shared_kib()
    views = []
    for i, size in enumerate(sizes):
        fd = _memory_file(bytes([i + 1]) * size)
        try:
            views.append(region.map(fd, size))
        finally:
            os.close(fd)
    del region  # (the run is over: its results keep the range)
    assert _shared_kib() - shared >= sum(sizes) // 1024  # every page charged as it was taken in
    assert all(v is not None and v.readonly for v in views)
    assert [bytes(v) for v in views if v is not None] == [bytes([i + 1]) * n for i, n in enumerate(sizes)]
    starts = [_base(v) for v in views if v is not None]
    assert starts == sorted(starts) and starts[-1] - starts[0] < 1 << 20  # one range, page by page
    first = starts[0]
    views.pop()
    views.pop()
    assert any(lo <= first < hi for lo, hi in _mapped_ranges())  # one view left: all still mapped
    views.clear()
    assert not any(lo <= first < hi for lo, hi in _mapped_ranges())  # the last gone: unmapped


def test_a_refused_mapping_fails_its_result_and_leaves_the_others_readable() -> None:
    region = ResultRegion()
    fd = _memory_file(b"kept" * 1000)
    try:
        kept = region.map(fd, 4000)
    finally:
        os.close(fd)
    with pytest.raises(OSError, match="cannot map a worker's result"):
        region.map(fd, 4000)  # closed: EBADF
    assert kept is not None and bytes(kept) == b"kept" * 1000
    fd = _memory_file(b"next" * 1000)
    try:
        later = region.map(fd, 4000)  # a new range
    finally:
        os.close(fd)
    assert later is not None and bytes(later) == b"next" * 1000 and bytes(kept) == b"kept" * 1000
    assert region.map(-1, 1 << 29) is None  # too large for a range: mapped on its own by the caller


def _blob(task: Task) -> pickle.PickleBuffer:
    return pickle.PickleBuffer(bytes([task.index]) * (100_000 + task.index))


def test_a_runs_results_are_mapped_into_one_range_not_each_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    own: list[int] = []
    mapped = messages._mapped

    def counted(fd: int, size: int) -> memoryview:
        own.append(size)
        return mapped(fd, size)

    monkeypatch.setattr(messages, "_mapped", counted)
    tasks = [Task(index=i, keys=(f"k{i}",), nbytes=1, memory=0) for i in range(8)]
    with WorkerPool(2, _blob) as pool:
        results = list(pool.run(tasks))
    assert own == []
    assert all(bytes(r.value) == bytes([r.task.index]) * (100_000 + r.task.index) for r in results)
    starts = sorted(_base(r.value) for r in results)
    assert starts[-1] - starts[0] < 1 << 30


def test_a_process_that_cannot_reserve_a_range_maps_each_result_on_its_own() -> None:
    # A process under ``ulimit -v`` may have no room for a range's addresses: its results are then
    # mapped each on its own (the caller's path for a result too large for a range), not refused.
    # (In a forked child: the limit is the process's.)
    import resource

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        code = 1
        try:
            with open("/proc/self/status") as status:
                size = next(int(line.split()[1]) for line in status if line.startswith("VmSize:")) * 1024
            resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20), resource.RLIM_INFINITY))
            fd = _memory_file(b"own" * 1000)
            region = ResultRegion()
            first = region.map(fd, 3000)
            view = messages._map_buffers([fd], [3000], region)[0]
            code = 0 if first is None and bytes(view) == b"own" * 1000 else 2
        finally:
            os.write(write, bytes([code]))
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"\x00"
    finally:
        os.close(read)
        os.waitpid(pid, 0)


def test_a_result_this_process_cannot_map_is_its_own_error_not_a_worker_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    # Out of address space (ulimit -v) or memory, the coordinator's own mapping fails: that was
    # reported as "worker 1 died with no exit status" after 5 s, and retried (review s13 rev2).
    import errno

    from parallel_dcp.engine.result_region import ResultNotMapped

    def refused(self: ResultRegion, fd: int, size: int) -> memoryview:
        raise ResultNotMapped(errno.ENOMEM)

    monkeypatch.setattr(ResultRegion, "map", refused)
    tasks = [Task(index=i, keys=(f"k{i}",), nbytes=1, memory=0) for i in range(2)]
    with WorkerPool(1, _blob) as pool, pytest.raises(ResultNotMapped, match="into this process: Cannot allocate"):
        list(pool.run(tasks, retries=2))
