"""Shards prefetched into the page cache while .metadata is parsed (storage/prefetch.py): read ahead
(sendfile to /dev/null, or POSIX_FADV_WILLNEED where sendfile is refused) for the files a load of
many small records reads, never for a checkpoint of big tensors, O_DIRECT reads, object storage or
a subset of the keys; never through a symlink; read in the order the load then reads them; the
loads stay byte-equal."""

from __future__ import annotations

import errno
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import parallel_dcp
from parallel_dcp import UnsafeCheckpointError
from parallel_dcp.storage import prefetch
from parallel_dcp.storage.location import locate
from parallel_dcp.storage.read_choice import ReadChoice
from parallel_dcp.synthetic import many_small
from tests.conftest import assert_same, empty_like_state

WILLNEED = os.POSIX_FADV_WILLNEED


@pytest.fixture
def advised(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """(the file's real path, offset, length) of every read ahead: each sendfile to /dev/null (as
    it starts, with the bytes it asks for) and each WILLNEED asked for, through the real calls."""
    calls: list[tuple[str, int, int]] = []
    real, real_sendfile = os.posix_fadvise, os.sendfile

    def recorded(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == WILLNEED:
            calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))
        real(fd, offset, length, advice)

    def sent(out: int, fd: int, offset: int, count: int) -> int:
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, count))
        return real_sendfile(out, fd, offset, count)

    monkeypatch.setattr(os, "posix_fadvise", recorded)
    monkeypatch.setattr(os, "sendfile", sent)
    return calls


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    sd = many_small(600)
    path = tmp_path_factory.mktemp("prefetch") / "small"
    parallel_dcp.save(sd, path, workers=2)
    return path, sd


def shards(path: Path) -> dict[str, int]:
    return {str(p.resolve()): p.stat().st_size for p in path.glob("*.distcp")}


def read_first(path: Path) -> dict[str, int]:
    """What the prefetch asks for: .metadata and its side index (first), then every shard."""
    return {**firsts(path), **shards(path)}


def firsts(path: Path) -> dict[str, int]:
    """.metadata and the side index beside it (our writers write one)."""
    return {str((path / name).resolve()): (path / name).stat().st_size for name in prefetch.FIRST}


def covered(calls: list[tuple[str, int, int]]) -> dict[str, int]:
    """Per file, how far from byte 0 the calls asked for without a hole."""
    ends: dict[str, int] = {}
    for name, offset, length in sorted(calls):
        if offset <= ends.get(name, 0):
            ends[name] = max(ends.get(name, 0), offset + length)
    return ends


@pytest.mark.parametrize("into", [True, False])
def test_many_small_records_prefetch_every_shard_whole(
    small_ckpt: tuple[Path, dict[str, Any]],
    advised: list[tuple[str, int, int]],
    monkeypatch: pytest.MonkeyPatch,
    into: bool,
) -> None:
    path, sd = small_ckpt
    monkeypatch.setattr(prefetch, "STREAMS", 1)  # one stream: the order asked is the order read
    target = empty_like_state(sd) if into else None
    out = parallel_dcp.load(path, io="buffered", into=target, workers=2)
    assert_same(out, sd)
    files = read_first(path)
    ends = covered(advised)
    assert set(ends) == set(files)
    assert all(ends[name] >= size for name, size in files.items())
    # .metadata, then its side index, before the shards: the load reads them first
    order = [name for name, _, _ in advised]
    first_shard = next(i for i, name in enumerate(order) if name in shards(path))
    assert order[0] == str((path / ".metadata").resolve()) and set(order[:first_shard]) == set(firsts(path))


def test_big_tensors_are_not_prefetched(tmp_path: Path, advised: list[tuple[str, int, int]]) -> None:
    sd = {"a": torch.randn(512, 1024), "b": torch.randn(1024, 256)}  # 3 MiB in two records
    parallel_dcp.save(sd, tmp_path / "big", workers=2)
    plan = prefetch.plan_prefetch(locate(tmp_path / "big"), "buffered", whole=True, allocates=True)
    assert plan.files == () and "few large records" in plan.reason
    assert_same(parallel_dcp.load(tmp_path / "big", io="buffered"), sd)
    assert advised == []


def test_a_key_subset_prefetches_nothing(
    small_ckpt: tuple[Path, dict[str, Any]], advised: list[tuple[str, int, int]]
) -> None:
    path, sd = small_ckpt
    out = parallel_dcp.load(path, io="buffered", keys="optimizer.state.1.*")
    assert_same(out, {"optimizer": {"state": {"1": sd["optimizer"]["state"]["1"]}}})
    assert advised == []


def test_an_into_subset_stops_the_shards(
    small_ckpt: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, advised: list[tuple[str, int, int]]
) -> None:
    path, sd = small_ckpt
    told: list[tuple[int, int, frozenset[str] | None]] = []
    real = prefetch.Prefetch.wanted

    def recorded(self: prefetch.Prefetch, nbytes: int) -> None:
        real(self, nbytes)
        told.append((nbytes, self.plan.nbytes, self._keep))

    monkeypatch.setattr(prefetch.Prefetch, "wanted", recorded)
    state = sd["optimizer"]["state"]
    part = {"optimizer": {"state": {k: empty_like_state(v) for k, v in list(state.items())[:20]}}}
    out = parallel_dcp.load(path, io="buffered", into=part)
    assert_same(out, {"optimizer": {"state": {k: state[k] for k in part["optimizer"]["state"]}}})
    expected = sum(t.nbytes for v in part["optimizer"]["state"].values() for t in v.values())
    assert len(told) == 1 and told[0][0] == expected and expected < prefetch.INTO_SHARE * told[0][1]
    assert told[0][2] == frozenset()  # no shard asked for from there on
    whole = empty_like_state(sd)
    assert_same(parallel_dcp.load(path, io="buffered", into=whole), sd)
    assert len(told) == 2 and told[1][0] >= prefetch.INTO_SHARE * told[1][1] and told[1][2] is None
    assert set(covered(advised)) == set(read_first(path))  # the whole into: every shard asked for


def test_wanted_under_the_share_asks_for_no_shard(
    small_ckpt: tuple[Path, dict[str, Any]], advised: list[tuple[str, int, int]]
) -> None:
    path, _ = small_ckpt
    plan = prefetch.plan_prefetch(locate(path), "buffered", whole=True, allocates=False)
    fetch = prefetch.Prefetch(locate(path), plan)
    fetch.wanted(plan.nbytes // 4)
    with fetch:
        assert fetch._threads
        fetch.join()
    assert {name for name, _, _ in advised} == set(firsts(path))


def test_direct_reads_object_storage_and_worker_processes_prefetch_nothing(
    small_ckpt: tuple[Path, dict[str, Any]],
) -> None:
    path, _ = small_ckpt
    where = locate(path)
    assert prefetch.plan_prefetch(where, "buffered", whole=True, allocates=True).files
    direct = prefetch.plan_prefetch(where, "direct", whole=True, allocates=True)
    assert direct.files == () and "read twice" in direct.reason
    remote = prefetch.plan_prefetch(locate("s3://bucket/ckpt"), "buffered", whole=True, allocates=True)
    assert remote.files == () and remote.reason == "object storage"
    assert prefetch.plan_prefetch(where, "buffered", whole=False, allocates=True).files == ()


def test_auto_follows_the_measured_choice(
    small_ckpt: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = small_ckpt
    where = locate(path)
    files = shards(path)
    monkeypatch.setattr(prefetch.io_mode, "DIRECT_MIN_BYTES", 1)  # every shard large enough to read directly
    monkeypatch.setattr(prefetch.io_mode, "direct_refusal", lambda *a, **k: None)
    monkeypatch.setattr(prefetch, "known_read_choice", lambda where: None)
    unmeasured = prefetch.plan_prefetch(where, "auto", whole=True, allocates=True)
    assert unmeasured.files == () and "not measured" in unmeasured.reason
    monkeypatch.setattr(prefetch, "known_read_choice", lambda where: ReadChoice("auto", "direct", "measured"))
    assert prefetch.plan_prefetch(where, "auto", whole=True, allocates=True).files == ()
    # small records read buffered whatever was measured: every shard, once measured
    buffered_anyway = prefetch.plan_prefetch(where, "auto", whole=True, allocates=True, small_buffered=True)
    assert buffered_anyway.nbytes == sum(files.values())
    # ... and before it was measured too: the load stops the prefetch before the probe runs (below)
    monkeypatch.setattr(prefetch, "known_read_choice", lambda where: None)
    before = prefetch.plan_prefetch(where, "auto", whole=True, allocates=True, small_buffered=True)
    assert before.nbytes == sum(files.values())
    monkeypatch.setattr(prefetch, "known_read_choice", lambda where: ReadChoice("buffered", "buffered", "measured"))
    assert prefetch.plan_prefetch(where, "auto", whole=True, allocates=True).nbytes == sum(files.values())


def test_not_when_the_shards_do_not_fit_in_memory(
    small_ckpt: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = small_ckpt
    total = sum(shards(path).values())

    class Memory:
        available = 3 * total  # room for the shards, not for them and an output as large

    monkeypatch.setattr(prefetch.psutil, "virtual_memory", Memory)
    assert prefetch.plan_prefetch(locate(path), "buffered", whole=True, allocates=False).files
    tight = prefetch.plan_prefetch(locate(path), "buffered", whole=True, allocates=True)
    assert tight.files == () and "memory" in tight.reason


def test_a_symlinked_shard_is_not_opened(
    small_ckpt: tuple[Path, dict[str, Any]], tmp_path: Path, advised: list[tuple[str, int, int]]
) -> None:
    source, sd = small_ckpt
    path = tmp_path / "ckpt"
    shutil.copytree(source, path)
    victim = sorted(path.glob("*.distcp"))[0]
    outside = tmp_path / "outside.distcp"
    victim.rename(outside)
    victim.symlink_to(outside)
    plan = prefetch.plan_prefetch(locate(path), "buffered", whole=True, allocates=True)
    assert victim.name not in dict(plan.files) and plan.files
    with pytest.raises(UnsafeCheckpointError, match="symlink"):
        parallel_dcp.load(path, io="buffered", into=empty_like_state(sd))
    assert advised and str(outside.resolve()) not in {name for name, _, _ in advised}


def test_keep_stops_asking_for_files_the_plan_does_not_read(
    small_ckpt: tuple[Path, dict[str, Any]], advised: list[tuple[str, int, int]]
) -> None:
    path, _ = small_ckpt
    plan = prefetch.plan_prefetch(locate(path), "buffered", whole=True, allocates=True)
    first = plan.files[0][0]
    fetch = prefetch.Prefetch(locate(path), plan)
    fetch.keep([first])
    with fetch:
        assert fetch._threads
        fetch.join()  # every file read (not stopped early by the exit)
    assert set(covered(advised)) == {*firsts(path), str((path / first).resolve())}
    assert covered(advised)[str((path / first).resolve())] >= dict(plan.files)[first]
    assert fetch.advised == dict(plan.files)[first] + sum(firsts(path).values())


@pytest.mark.parametrize("into", [True, False])
def test_a_first_auto_load_of_small_records_is_prefetched_and_never_probed(
    small_ckpt: tuple[Path, dict[str, Any]],
    advised: list[tuple[str, int, int]],
    monkeypatch: pytest.MonkeyPatch,
    into: bool,
) -> None:
    """Small records scattered into their tensors read buffered whatever io="auto" would measure:
    a process's first load asks for its shards at once, and no probe drops their cached pages."""
    from parallel_dcp.storage import read_choice as choices

    path, sd = small_ckpt
    monkeypatch.setattr(choices, "_read_choices", {})  # this process has measured nothing yet
    monkeypatch.setattr(prefetch.io_mode, "DIRECT_MIN_BYTES", 1)  # every shard large enough to read directly
    monkeypatch.setattr(prefetch.io_mode, "direct_refusal", lambda *a, **k: None)
    probed: list[Any] = []
    monkeypatch.setattr(choices.read_probe, "measure_reads", lambda paths, streams=1: probed.append(paths))
    target = empty_like_state(sd) if into else None
    out = parallel_dcp.load(path, io="auto", into=target, workers=2)
    assert_same(out, sd)
    assert probed == []
    ends = covered(advised)
    assert all(ends.get(name, 0) >= size for name, size in read_first(path).items())


def test_the_prefetch_stops_before_the_probe_measures_the_files_of_big_tensors(
    tmp_path: Path, advised: list[tuple[str, int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many small records beside a tensor read as a request: io="auto" measures that tensor's file
    cold, so no page is asked for while the probe runs."""
    from parallel_dcp.storage import read_choice as choices

    sd = many_small(600)
    sd["big"] = torch.randn(1024, 1024)  # 4 MiB: read as a request, not as a small record
    parallel_dcp.save(sd, tmp_path / "mixed", workers=2)
    monkeypatch.setattr(choices, "_read_choices", {})
    monkeypatch.setattr(prefetch.io_mode, "direct_refusal", lambda *a, **k: None)  # (one module: read_choice's too)
    monkeypatch.setattr(prefetch.io_mode, "DIRECT_MIN_BYTES", 1)
    events: list[tuple[str, int]] = []

    def measure(paths: Any, streams: int = 1) -> None:
        events.append(("probe", len(advised)))
        return None

    monkeypatch.setattr(choices.read_probe, "measure_reads", measure)
    real_close = prefetch.Prefetch.close

    def close(self: prefetch.Prefetch) -> None:
        real_close(self)
        events.append(("stopped", len(advised)))

    monkeypatch.setattr(prefetch.Prefetch, "close", close)
    assert_same(parallel_dcp.load(tmp_path / "mixed", io="auto", workers=2), sd)
    assert advised, "the small records' shards were asked for"
    probes = [n for kind, n in events if kind == "probe"]
    assert probes, "the probe measured the big tensor's file"
    assert events[0][0] == "stopped" and events[0][1] == probes[0]  # stopped and joined first; nothing asked since


def test_the_loads_stats_say_what_the_prefetch_decided(small_ckpt: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """ReadStats.prefetch: the files asked for and their bytes, or none and why."""
    path, sd = small_ckpt
    stats = parallel_dcp.ReadStats()
    parallel_dcp.load(path, io="buffered", into=empty_like_state(sd), workers=2, stats=stats)
    assert stats.prefetch is not None and stats.prefetch.reason == ""
    assert {name: size for name, size in stats.prefetch.files} == {
        p.name: p.stat().st_size for p in path.glob("*.distcp")
    }
    assert stats.prefetch.nbytes == sum(size for _, size in stats.prefetch.files)
    for kwargs, why in (
        ({"keys": "optimizer.state.1.*"}, "a subset of the keys"),
        ({"io": "direct"}, 'io="direct"'),
    ):
        stats = parallel_dcp.ReadStats()
        parallel_dcp.load(path, stats=stats, **kwargs)
        assert stats.prefetch is not None and stats.prefetch.files == () and why in stats.prefetch.reason
    big = {"a": torch.randn(512, 1024)}
    parallel_dcp.save(big, tmp_path / "big", workers=2)
    stats = parallel_dcp.ReadStats()
    parallel_dcp.load(tmp_path / "big", io="buffered", stats=stats)
    assert stats.prefetch is not None and "few large records" in stats.prefetch.reason


@pytest.fixture(scope="module")
def scrambled_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Many small records whose shards the records list out of name order (the columns' order:
    the keys' order; the shards' names: the save's tasks)."""
    sd = many_small(2000)
    path = tmp_path_factory.mktemp("prefetch") / "scrambled"
    parallel_dcp.save(sd, path, workers=2)
    return path, sd


def test_the_read_stage_takes_the_shards_in_the_prefetchs_order(
    scrambled_ckpt: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cold, the disk reads the shards in the prefetch's order: a read stage that took them in
    the records' order waited on the shard the disk reads last while the first ones sat cached
    (measured: 0.24 s of 0.51 in one preadv, 50,000 small records)."""
    from parallel_dcp.formats import small_reads
    from parallel_dcp.storage.metadata import read_index_or_metadata

    path, sd = scrambled_ckpt
    _, columns, _ = read_index_or_metadata(locate(path))
    records_order = list(dict.fromkeys(record[1] for record in columns.records))
    plan = prefetch.plan_prefetch(locate(path), "buffered", whole=True, allocates=False)
    prefetched = [name for name, _ in plan.files]
    assert records_order != prefetched and set(records_order) == set(prefetched)  # (else nothing to show)
    read: list[str] = []
    real = small_reads.SmallUnit.run

    def run(self: small_reads.SmallUnit, *args: Any, **kwargs: Any) -> Any:
        read.append(self.name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(small_reads.SmallUnit, "run", run)
    out = parallel_dcp.load(path, io="buffered", into=empty_like_state(sd), workers=1)  # one thread: in order
    assert_same(out, sd)
    assert list(dict.fromkeys(read)) == prefetched


def test_order_puts_the_prefetched_files_first_in_the_prefetchs_order(
    scrambled_ckpt: tuple[Path, dict[str, Any]],
) -> None:
    path, _ = scrambled_ckpt
    plan = prefetch.plan_prefetch(locate(path), "buffered", whole=True, allocates=False)
    names = [name for name, _ in plan.files]
    fetch = prefetch.Prefetch(locate(path), plan)
    assert fetch.order(["other_b", *reversed(names), "other_a"]) == [*names, "other_b", "other_a"]
    assert prefetch.Prefetch(locate(path), prefetch.PrefetchPlan()).order(["b", "a"]) == ["b", "a"]


def test_the_threads_make_no_call_but_the_reads(
    small_ckpt: tuple[Path, dict[str, Any]], advised: list[tuple[str, int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each system call in a prefetch thread gives up the GIL and waits to take it back behind the
    busy main thread (up to 5 ms each): the files are opened and measured before the threads
    start (measured: 35 ms to the first read-ahead when the thread opened them itself)."""
    path, _ = small_ckpt
    opened: list[str] = []
    real = prefetch.open_regular

    def recorded(directory: int | None, name: Any, **kwargs: Any) -> int:
        opened.append(threading.current_thread().name)
        return real(directory, name, **kwargs)

    monkeypatch.setattr(prefetch, "open_regular", recorded)
    plan = prefetch.plan_prefetch(locate(path), "buffered", whole=True, allocates=False)
    opened.clear()  # (the plan's own look at the sizes)
    with prefetch.Prefetch(locate(path), plan) as fetch:
        fetch.join()
    assert len(opened) == len(plan.files) + len(prefetch.FIRST)
    assert set(opened) == {threading.main_thread().name}
    assert set(covered(advised)) == set(read_first(path))
    assert fetch.advised == sum(read_first(path).values())


def test_where_sendfile_is_refused_the_windows_are_asked_for(
    small_ckpt: tuple[Path, dict[str, Any]], advised: list[tuple[str, int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, sd = small_ckpt
    refused: list[int] = []

    def no_sendfile(out: int, fd: int, offset: int, count: int) -> int:
        refused.append(fd)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "sendfile", no_sendfile)  # (advised now records the WILLNEEDs alone)
    out = parallel_dcp.load(path, io="buffered", into=empty_like_state(sd), workers=2)
    assert_same(out, sd)
    assert 1 <= len(refused) <= prefetch.STREAMS  # each stream finds out once, then asks
    ends = covered(advised)
    assert set(ends) == set(read_first(path))
    assert all(ends[name] >= size for name, size in read_first(path).items())


def test_the_into_bytes_are_summed_only_as_far_as_the_question_needs() -> None:
    """Whether an ``into`` is a subset needs its bytes only up to INTO_SHARE of the shards': a
    whole one is not summed to its end (a tensor's nbytes is a call a key)."""
    from parallel_dcp.jobs import load as job

    into = {f"t{i}": torch.zeros(4) for i in range(20000)}  # 16 bytes each
    whole = 16 * len(into)
    flattened: list[Any] = []
    assert job._into_bytes(into, flattened) == whole
    assert list(flattened[0][0]) == list(into)  # flattened once, kept for the load
    part = job._into_bytes(into, [], enough=whole / 4)
    assert whole / 4 < part < whole
    assert job._into_bytes(into, [], enough=whole) == whole
    assert job._into_bytes({"a": torch.zeros(4), "b": [1, 2]}, [], enough=1) == 16


def test_without_dev_null_the_windows_are_asked_for(
    small_ckpt: tuple[Path, dict[str, Any]], advised: list[tuple[str, int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = small_ckpt
    monkeypatch.setattr(prefetch.os, "devnull", str(path / "no such sink" / "null"))
    plan = prefetch.plan_prefetch(locate(path), "buffered", whole=True, allocates=False)
    with prefetch.Prefetch(locate(path), plan) as fetch:
        fetch.join()
    ends = covered(advised)
    assert all(ends.get(name, 0) >= size for name, size in read_first(path).items())
    assert not fetch._sendfile
