"""A result's large bytes (a DCP task's pickled .metadata runs) reach the coordinator out of band, in a
memory file it maps (engine/messages.py), and .metadata is written from its pieces (jobs/dcp_commit.py):
the files are the bytes the in-band path wrote, and a worker dying half-way is a crash like any other."""

from __future__ import annotations

import errno
import json
import os
import pickle
from pathlib import Path
from typing import Any

import numpy
import pytest
import xxhash

import parallel_dcp
from parallel_dcp.engine import messages
from parallel_dcp.engine import worker as worker_module
from parallel_dcp.engine.partition import Task
from parallel_dcp.engine.pool import WorkerPool
from parallel_dcp.errors import WorkerCrashed, WorkerError
from parallel_dcp.jobs import dcp_commit
from parallel_dcp.storage import local_staging, safe_files
from parallel_dcp.storage.manifest import ALGORITHM, file_digest
from parallel_dcp.storage.ownership import MANIFEST_FILE, METADATA_FILE
from parallel_dcp.storage.side_index import HEADER, INDEX_FILE, MAGIC, VERSION
from parallel_dcp.synthetic import many_small

_SAVE_ID = "0123456789ab"


def _with_buffers(task: Task) -> dict[str, Any]:
    blob = bytes(range(256)) * (1000 + task.index)
    return {
        "blob": pickle.PickleBuffer(blob),
        "empty": pickle.PickleBuffer(b""),
        "array": numpy.arange(10_000 + task.index, dtype=numpy.int64),
        "plain": b"in band",
    }


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_results_buffers_arrive_as_read_only_views_of_its_bytes_and_leave_no_descriptor() -> None:
    tasks = [Task(index=i, keys=(f"k{i}",), nbytes=1, memory=0) for i in range(6)]
    with WorkerPool(2, _with_buffers) as pool:
        before = _open_descriptors()
        results = list(pool.run(tasks))
        after = _open_descriptors()
    assert after == before  # each memory file's descriptor closed once mapped
    for result in results:
        value, index = result.value, result.task.index
        assert isinstance(value["blob"], memoryview) and value["blob"].readonly
        assert bytes(value["blob"]) == bytes(range(256)) * (1000 + index)
        assert bytes(value["empty"]) == b""
        assert numpy.array_equal(value["array"], numpy.arange(10_000 + index, dtype=numpy.int64))
        assert value["plain"] == b"in band"


_send_reply = messages.send_reply


def _die_before_the_buffers(conn: Any, data: bytes, shared: int | None) -> None:
    if shared is not None:
        os._exit(3)
    _send_reply(conn, data, shared)


def test_a_worker_dying_as_it_sends_a_result_with_buffers_is_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_module, "send_reply", _die_before_the_buffers)  # inherited by the forks
    tasks = [Task(index=0, keys=("k0",), nbytes=1, memory=0)]
    with pytest.raises(WorkerCrashed, match="exit code 3"), WorkerPool(1, _with_buffers) as pool:
        list(pool.run(tasks))


def _no_memory_file(name: str, flags: int = 0) -> int:
    raise OSError(errno.ENOMEM, "Cannot allocate memory")


def test_a_result_that_cannot_be_put_in_a_memory_file_is_the_tasks_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "memfd_create", _no_memory_file)  # in the workers, forked after this
    tasks = [Task(index=0, keys=("k0",), nbytes=1, memory=0)]
    with pytest.raises(WorkerError, match="Cannot allocate memory"), WorkerPool(1, _with_buffers) as pool:
        list(pool.run(tasks))


def test_a_save_whose_worker_dies_before_sending_its_runs_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_module, "send_reply", _die_before_the_buffers)
    with pytest.raises(WorkerCrashed):
        parallel_dcp.save(many_small(2000), tmp_path / "ckpt", workers=2)
    assert list(tmp_path.iterdir()) == []  # no shard, no staged or temporary name


def _reference_index(pieces: list[tuple[str, Any]], metadata: bytes, save_id: str) -> bytes:
    """The side index as storage/side_index.py assembled it before its columns were joined in
    place (concatenated, converted, copied out, then joined): the bytes must not change."""
    files: dict[str, int] = {}
    ids = [numpy.full(len(seg[1]), files.setdefault(name, len(files)), dtype=numpy.uint32) for name, seg in pieces]
    segments = [seg for _, seg in pieces]

    def cat(arrays: list[Any], dtype: Any) -> Any:
        return numpy.concatenate(arrays).astype(dtype, copy=False) if arrays else numpy.zeros(0, dtype=dtype)

    # The int64 columns as arrays (out of band they travel as their raw bytes: dcp_commit.out_of_band).
    def int64(column: Any) -> Any:
        return column if isinstance(column, numpy.ndarray) else numpy.frombuffer(column, dtype=numpy.int64)

    columns = [cat([int64(s[i]) for s in segments], numpy.int64) for i in (6, 7, 5)] + [cat(ids, numpy.uint32)]
    names = b"".join(s[0] for s in segments)
    file_names = "".join(f"{name}\0" for name in files).encode()
    small = [b"".join(s[i] for s in segments) for i in (1, 2, 3, 4)]
    tag = save_id.encode()
    arrays = [c.astype(c.dtype.newbyteorder("<")).tobytes() for c in columns]
    body = b"".join([*arrays, *small, file_names, names, tag])
    counts = (len(columns[0]), len(files), len(columns[2]), len(names), len(file_names), len(tag))
    header = HEADER.pack(
        MAGIC, VERSION, 0, len(metadata), xxhash.xxh3_64_intdigest(metadata), *counts, xxhash.xxh3_64_intdigest(body)
    )
    return header + body


def _saved(
    path: Path, monkeypatch: pytest.MonkeyPatch, *, out_of_band: bool, executor: str = "processes"
) -> tuple[dict[str, bytes], Any, int]:
    """The files a two-worker save writes besides its shards (the manifest without its time), the
    side index's pieces as the commit had them, and how many bytes the results sent out of band."""
    sent: list[int] = []
    captured: list[Any] = []
    reading, indexing = messages._map_buffers, dcp_commit.index_for

    def read(fds: Any, sizes: Any, *region: Any) -> Any:
        sent.append(sum(sizes))
        return reading(fds, sizes, *region)

    def index(pieces: Any, *args: Any) -> bytes:
        captured.append(
            [(name, tuple(bytes(c) if isinstance(c, memoryview) else c for c in seg)) for name, seg in pieces]
        )
        return indexing(pieces, *args)

    monkeypatch.setattr(messages, "_map_buffers", read)
    monkeypatch.setattr(dcp_commit, "index_for", index)
    if not out_of_band:  # the runs pickled in band, as they travelled before
        monkeypatch.setattr(dcp_commit, "out_of_band", lambda result: result)
    monkeypatch.setattr(local_staging, "new_save_id", lambda: _SAVE_ID)
    parallel_dcp.save(many_small(3000), path, workers=2, executor=executor)
    monkeypatch.undo()
    files = {name: (path / name).read_bytes() for name in (METADATA_FILE, INDEX_FILE)}
    manifest = json.loads((path / MANIFEST_FILE).read_bytes())
    manifest.pop("created")
    files[MANIFEST_FILE] = json.dumps(manifest, sort_keys=True).encode()
    assert file_digest(path / METADATA_FILE).digest == manifest["files"][METADATA_FILE][ALGORITHM]
    return files, captured[0], sum(sent)


def test_metadata_index_and_manifest_are_the_bytes_the_in_band_path_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt"  # one path: its name is in .metadata
    in_band, _, in_band_sent = _saved(path, monkeypatch, out_of_band=False)  # only the index's arrays
    for child in path.iterdir():
        child.unlink()
    path.rmdir()
    out_of_band, pieces, sent = _saved(path, monkeypatch, out_of_band=True)
    assert sent - in_band_sent > len(out_of_band[METADATA_FILE]) * 0.9  # the runs travelled out of band
    assert out_of_band == in_band
    assert out_of_band[INDEX_FILE] == _reference_index(pieces, out_of_band[METADATA_FILE], _SAVE_ID)


def test_a_file_written_in_pieces_holds_them_in_order_past_short_writes_and_the_iovec_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pieces: list[Any] = [bytes([i % 251]) * (i % 7) for i in range(2500)]  # empty ones too
    pieces += [memoryview(b"a view"), bytearray(b"an array"), pickle.PickleBuffer(b"a buffer")]
    writev = os.writev
    calls: list[int] = []

    def short(fd: int, buffers: Any) -> int:  # at most 5 bytes a call: every piece split
        calls.append(len(buffers))
        head = memoryview(buffers[0])[:5]
        return writev(fd, [head])

    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        safe_files.write_new(fd, "whole", pieces)
        monkeypatch.setattr(safe_files.os, "writev", short)
        safe_files.write_new(fd, "short", pieces)
    finally:
        os.close(fd)
    expected = b"".join(pieces)
    assert (tmp_path / "whole").read_bytes() == expected
    assert (tmp_path / "short").read_bytes() == expected
    assert max(calls) <= 1024


def _shared_memory_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("RssShmem:"))
    return int(line.split()[1]) * 1024


def _four_mib(task: Task) -> pickle.PickleBuffer:
    return pickle.PickleBuffer(bytes([task.index]) * (4 * 2**20))


def test_a_results_bytes_are_charged_to_the_coordinator_as_soon_as_it_holds_them() -> None:
    """The memory governor charges a process the shared-memory pages it maps (engine/process_memory.py):
    a result's pages, mapped but untouched, would be in no process's charge until the commit reads them."""
    tasks = [Task(index=i, keys=(f"k{i}",), nbytes=1, memory=0) for i in range(4)]
    with WorkerPool(2, _four_mib) as pool:
        before = _shared_memory_bytes()
        results = list(pool.run(tasks))
        held = _shared_memory_bytes() - before
    assert held >= 0.9 * 4 * 4 * 2**20
    assert all(bytes(r.value[:1]) == bytes([r.task.index]) for r in results)


def test_on_writer_threads_wrapped_runs_make_the_same_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No pipe: the parts keep their runs and columns wrapped in ``pickle.PickleBuffer`` to the commit."""
    path = tmp_path / "ckpt"
    in_band, _, _ = _saved(path, monkeypatch, out_of_band=False)
    for child in path.iterdir():
        child.unlink()
    path.rmdir()
    threads, _, sent = _saved(path, monkeypatch, out_of_band=True, executor="threads")
    assert sent == 0
    assert threads == in_band


def test_results_and_messages_of_every_size_read_back_exactly() -> None:
    """A result mapped through a type of the next power of two, and a message sent ahead by the
    address of its first byte: each of 300 sizes (across powers of two) reads back exactly, read-only."""
    from parallel_dcp.engine.remote_memory import RemoteBytes

    for size in [*range(1, 70), *range(1000, 1100), *range(4000, 4200), 1 << 20, (1 << 20) + 1]:
        data = bytearray(os.urandom(size))
        assert RemoteBytes.of(data).fetch() == data
        fd = os.memfd_create("test-result")
        try:
            os.write(fd, data)
            view = messages._mapped(fd, size)
        finally:
            os.close(fd)
        assert len(view) == size and view.readonly and bytes(view) == data
        del view


def _one_kib(task: Task) -> dict[str, Any]:
    return {"blob": pickle.PickleBuffer(bytes([task.index]) * 1024), "array": numpy.arange(8 + task.index)}


def test_a_result_of_few_buffer_bytes_travels_in_its_pickle_without_a_memory_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under INLINE_RESULT_BYTES (an LLM-like dict's task sends ~1 KB of runs), the buffers stay in the
    pickle: no memory file is made (here none could be), and the coordinator gets the same bytes."""
    monkeypatch.setattr(os, "memfd_create", _no_memory_file)  # in the workers, forked after this
    tasks = [Task(index=i, keys=(f"k{i}",), nbytes=1, memory=0) for i in range(4)]
    with WorkerPool(2, _one_kib) as pool:
        results = list(pool.run(tasks))
    for result in results:
        index = result.task.index
        assert bytes(result.value["blob"]) == bytes([index]) * 1024
        assert numpy.array_equal(result.value["array"], numpy.arange(8 + index))
    # Past it, the same pool needs its memory file (and here fails with the task's error).
    with pytest.raises(WorkerError, match="Cannot allocate memory"), WorkerPool(1, _with_buffers) as pool:
        list(pool.run(tasks[:1]))


def test_metadata_and_index_are_the_same_whether_results_travel_in_band_or_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = []
    for inline in (0, 1 << 40):  # every result mapped; every result in its pickle
        monkeypatch.setattr(messages, "INLINE_RESULT_BYTES", inline)
        path = tmp_path / "ckpt"
        files, _, sent = _saved(path, monkeypatch, out_of_band=True)
        assert (sent > 0) == (inline == 0)
        written.append(files)
        for child in path.iterdir():
            child.unlink()
        path.rmdir()
    assert written[0] == written[1]


def test_a_parts_columns_copied_in_band_are_arrays_again() -> None:
    """For torch.distributed's gather to rank 0, the int64 columns that travelled as raw bytes become
    int64 arrays again (an array carries its byte order to another rank); the rest bytes."""
    from parallel_dcp.formats.lean import LeanPart

    dims, offsets, lengths = numpy.array([2, 3]), numpy.array([0]), numpy.array([24])
    segment = (b"w\0", b"\1", b"\2", b"\0", b"\2", dims, offsets, lengths)
    part = LeanPart("f", runs=[(0, (b"a", b"b", b"c"))], columns=[segment])
    travelled = pickle.loads(pickle.dumps(dcp_commit.out_of_band(part), protocol=5))  # in band: bytes, bytearrays
    assert not isinstance(travelled.columns[0][5], numpy.ndarray)
    copied = dcp_commit.in_band(travelled)
    segment = copied.columns[0]
    assert all(isinstance(c, bytes) for c in segment[:5]) and segment[4] == b"\2"
    for got, expected in zip(segment[5:], (dims, offsets, lengths), strict=True):
        assert isinstance(got, numpy.ndarray) and got.dtype == numpy.int64 and numpy.array_equal(got, expected)


def test_a_reply_and_its_memory_file_arrive_as_one_message_read_exactly() -> None:
    """One send carries the reply and its memory file (the coordinator never waits between them),
    and each read takes one message: replies with and without a file, queued back to back in the
    pipe, read back in order, with their buffers."""
    import multiprocess

    here, there = multiprocess.Pipe(duplex=True)
    try:
        sent = []
        for i in range(3):
            value = {"blob": pickle.PickleBuffer(bytes([i]) * (100_000 + i)), "i": i}
            data, sizes, shared = messages.pickled_result(value)
            assert shared is not None
            messages.send_reply(there, pickle.dumps(("ok", 0.0, data, 0.0, 0.0, 0.0, sizes)), shared)
            messages.send_reply(there, pickle.dumps(("charge", i)), None)
            sent.append(value)
        before = _open_descriptors()
        for i in range(3):
            reply, raw = messages.receive_reply(here)
            value = pickle.loads(reply[2], buffers=raw)
            assert value["i"] == i and bytes(value["blob"]) == bytes([i]) * (100_000 + i)
            assert messages.receive_reply(here) == (("charge", i), [])
        assert _open_descriptors() == before  # each file mapped and its descriptor closed
    finally:
        here.close()
        there.close()
