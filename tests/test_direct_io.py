"""The I/O layer: direct (O_DIRECT) and buffered shards are the same bytes; auto's rule; failures."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import parallel_dcp
from parallel_dcp import CorruptCheckpointError, InvalidDestinationError, Options, WorkerError
from parallel_dcp.cli import main
from parallel_dcp.storage import direct_read, direct_write, io_mode
from parallel_dcp.storage.direct_read import ShardFile
from parallel_dcp.storage.direct_write import DirectFile
from tests.conftest import assert_same, shards_by_task
from tests.faults import FillDisk

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def small_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 KiB direct buffers and pieces: test data of a few MiB cycles through many of them."""
    monkeypatch.setattr(direct_write, "BUFFER_BYTES", 64 << 10)
    monkeypatch.setattr(direct_read, "PIECE_BYTES", 64 << 10)


CASES: dict[str, Any] = {
    "odd sizes": lambda: (
        {f"w{i}": torch.randn(333 + 7 * i, 129) for i in range(6)}
        | {"b": torch.arange(4099, dtype=torch.int8), "h": torch.randn(3, 5, 7).half(), "step": 7, "name": "x"}
    ),
    "zero-size tensors": lambda: {"empty": torch.empty(0), "e2": torch.empty(0, 5), "w": torch.randn(100, 41)},
    "many small tensors": lambda: {f"layer{i}.bias": torch.randn(i % 13 + 1) for i in range(400)},
    "a huge tensor in chunks": lambda: {"huge": torch.randn(1537, 1021), "tail": torch.arange(3)},
}


@pytest.mark.parametrize("case", list(CASES))
def test_direct_and_buffered_shards_are_the_same_bytes_and_stock_readable(
    disk: Path, small_buffers: None, case: str
) -> None:
    sd = CASES[case]()
    chunking = {"chunk_size": "1MiB"} if case == "a huge tensor in chunks" else {}
    direct = parallel_dcp.save(sd, disk / "direct", workers=2, io="direct", **chunking)
    buffered = parallel_dcp.save(sd, disk / "buffered", workers=2, io="buffered", **chunking)
    assert (direct.io, buffered.io) == ("direct", "buffered")
    assert direct.tasks == buffered.tasks
    assert shards_by_task(disk / "direct") == shards_by_task(disk / "buffered")
    assert any(len(b) % 4096 for b in shards_by_task(disk / "direct").values())  # tails were truncated back
    manifests = [json.loads((disk / d / ".parallel_dcp.json").read_text())["files"] for d in ("direct", "buffered")]
    digests = [sorted(v["xxh3_64"] for n, v in m.items() if n.endswith(".distcp")) for m in manifests]
    assert digests[0] == digests[1]  # checksums taken on the way to the device, the same either way
    tensors = {k: torch.zeros_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    dcp.load(tensors, checkpoint_id=disk / "direct")  # stock DCP reads it
    assert_same(tensors, {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)})
    for io in ("direct", "buffered", "auto"):
        assert_same(parallel_dcp.load(disk / "direct", io=io), sd)
    report = parallel_dcp.verify(disk / "direct", io="direct")
    assert report.ok, report.problems


def test_direct_file_writes_exactly_what_it_was_given(tmp_path: Path, disk: Path) -> None:
    rng = random.Random(5)
    expected = bytearray()
    fd = os.open(disk / "f", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    stream = DirectFile(fd, buffer_bytes=8192, depth=3)
    try:
        for step in range(300):
            data = rng.randbytes(rng.choice([0, 1, 17, 4095, 4096, 4097, 9000, 30000]))
            stream.write(data)
            expected += data
            if step % 97 == 0:
                stream.flush()  # a flush in the middle, then more writes
                assert os.fstat(fd).st_size == len(expected)
            assert stream.tell() == len(expected)
        stream.close()
    finally:
        os.close(fd)
    assert (disk / "f").read_bytes() == bytes(expected)


def test_direct_file_of_nothing_is_empty(disk: Path) -> None:
    fd = os.open(disk / "f", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    DirectFile(fd).close()
    os.close(fd)
    assert (disk / "f").stat().st_size == 0


def test_a_failed_direct_write_is_raised_as_the_oserror(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_RDONLY | os.O_CREAT)  # every write fails: EBADF
    stream = DirectFile(fd, buffer_bytes=4096, depth=2)
    try:
        with pytest.raises(OSError, match="Bad file descriptor"):
            for _ in range(4):
                stream.write(b"x" * 4096)
            stream.flush()
    finally:
        stream.abort()
        os.close(fd)


def test_auto_uses_direct_only_for_large_files(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sd = {"w": torch.randn(512, 1024)}  # 2 MiB
    assert parallel_dcp.save(sd, disk / "small", workers=1).io == "buffered"
    monkeypatch.setattr(io_mode, "DIRECT_MIN_BYTES", 1 << 20)
    assert parallel_dcp.save(sd, disk / "large", workers=1).io == "direct"
    assert shards_by_task(disk / "small") == shards_by_task(disk / "large")


@pytest.fixture
def shm() -> Iterator[Path]:
    if io_mode.file_system_type("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    path = Path(tempfile.mkdtemp(prefix="pdcp-io-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_tmpfs_falls_back_under_auto_and_refuses_direct(shm: Path) -> None:
    sd = {"w": torch.randn(64, 64)}
    assert parallel_dcp.save(sd, shm / "auto", workers=1).io == "buffered"
    with pytest.raises(InvalidDestinationError, match=r"io=\"direct\" \(--io direct\): cannot write .* tmpfs"):
        parallel_dcp.save(sd, shm / "direct", workers=1, io="direct")
    assert not (shm / "direct").exists(), "nothing written before the refusal"
    with pytest.raises(InvalidDestinationError, match="tmpfs"):
        parallel_dcp.load(shm / "auto", io="direct")
    with pytest.raises(ValueError, match="io must be"):
        Options(io="fast")


def _resident_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache (mincore)."""
    size = path.stat().st_size
    if not size:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value)
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vector = (ctypes.c_ubyte * pages)()
            assert libc.mincore(address, size, vector) == 0
            return sum(v & 1 for v in vector)
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def test_a_direct_save_leaves_no_shard_pages_in_the_page_cache(disk: Path) -> None:
    sd = {f"w{i}": torch.randn(256, 1024) for i in range(4)}
    parallel_dcp.save(sd, disk / "direct", workers=2, io="direct")
    parallel_dcp.save(sd, disk / "buffered", workers=2, io="buffered")
    assert sum(_resident_pages(p) for p in (disk / "direct").glob("*.distcp")) == 0
    assert sum(_resident_pages(p) for p in (disk / "buffered").glob("*.distcp")) > 0  # the check can see them


def test_truncated_shards_read_with_direct_io_are_corrupt(disk: Path, small_buffers: None) -> None:
    sd = {f"w{i}": torch.randn(128, 1024) for i in range(2)}
    parallel_dcp.save(sd, disk / "ckpt", workers=1, io="direct")
    shard = next((disk / "ckpt").glob("*.distcp"))
    size = shard.stat().st_size
    reader = ShardFile(shard, io="direct")
    try:
        assert reader.direct
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            reader.read(size - 5000, [memoryview(bytearray(9000))])
        buffer = bytearray(10)
        reader.read(size - 10, [memoryview(buffer)])  # the last bytes, unaligned
        assert bytes(buffer) == shard.read_bytes()[-10:]
    finally:
        reader.close()
    os.truncate(shard, size // 2 + 3)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        parallel_dcp.load(disk / "ckpt", io="direct")
    reader = parallel_dcp.FastReader(disk / "ckpt", io="direct")
    with pytest.raises(CheckpointException) as raised:  # stock DCP wraps what a reader raises, by rank
        dcp.load({k: torch.empty_like(v) for k, v in sd.items()}, storage_reader=reader)
    assert isinstance(raised.value.failures[0][0], CorruptCheckpointError), raised.value.failures


def test_a_shard_that_vanished_is_corrupt_not_an_oserror(tmp_path: Path) -> None:
    with pytest.raises(CorruptCheckpointError, match="vanished"):
        ShardFile(tmp_path / "gone.distcp", io="direct")


@pytest.fixture
def small_ext4(tmp_path: Path) -> Iterator[Path]:
    """A 40 MiB ext4 file system on a loop device: real ENOSPC under O_DIRECT. Needs root."""
    image, mount = tmp_path / "disk.img", tmp_path / "mnt"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(40 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True)
    done = made.returncode == 0 and subprocess.run(["mount", "-o", "loop", str(image), str(mount)]).returncode == 0
    if not done:
        pytest.skip("cannot mount an ext4 image here (needs root and loop devices)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_mid_direct_write_removes_the_new_files_and_keeps_the_old_checkpoint(small_ext4: Path) -> None:
    old = {"w": torch.arange(1000)}
    parallel_dcp.save(old, small_ext4 / "ckpt", workers=1)
    before = sorted(os.listdir(small_ext4 / "ckpt"))
    new = {f"w{i}": torch.randn(512, 1024) for i in range(4)} | {"filler": FillDisk(str(small_ext4 / "neighbour"))}
    with pytest.raises(WorkerError, match="No space left on device"):
        parallel_dcp.save(new, small_ext4 / "ckpt", workers=2, io="direct", overwrite=True)
    assert sorted(os.listdir(small_ext4 / "ckpt")) == before
    assert_same(parallel_dcp.load(small_ext4 / "ckpt"), old)
    assert sorted(p.name for p in small_ext4.iterdir()) == ["ckpt", "lost+found", "neighbour"]


KILL_SCRIPT = textwrap.dedent(
    """
    import os, sys, time, torch, parallel_dcp
    from parallel_dcp.storage import direct_write
    direct_write.BUFFER_BYTES = 1 << 20
    write = direct_write._pwrite_all
    def stall(fd, view, offset):
        write(fd, view, offset)
        os.write(1, b"written\\n")  # one write: both workers' lines never interleave
        time.sleep(120)
    direct_write._pwrite_all = stall
    sd = {"w%d" % i: torch.randn(1024, 1024) for i in range(4)}
    parallel_dcp.save(sd, sys.argv[1], workers=2, io="direct", overwrite=True)
    """
)


def test_sigkill_mid_direct_write_leaves_what_the_next_save_cleans(disk: Path) -> None:
    old = {"old": torch.arange(10)}
    parallel_dcp.save(old, disk / "ckpt", workers=1)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(disk / "ckpt")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        start_new_session=True,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"written"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    partial = [p for p in (disk / "ckpt").glob("*.distcp") if p.stat().st_size >= 1 << 20]
    assert partial, "the killed save had written part of a shard"
    assert_same(parallel_dcp.load(disk / "ckpt"), old)  # the old checkpoint still loads
    new = {"new": torch.randn(300, 300)}
    with pytest.warns(UserWarning, match="removed .* leftover files of save"):
        parallel_dcp.save(new, disk / "ckpt", workers=1, io="direct", overwrite=True)
    names = os.listdir(disk / "ckpt")
    assert len([n for n in names if n.endswith(".distcp")]) == 1, names
    assert not any(".owner." in n for n in names), names
    assert_same(parallel_dcp.load(disk / "ckpt"), new)


@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_sharded_and_single_file_outputs_go_through_the_layer(disk: Path, small_buffers: None, to: str) -> None:
    from safetensors.torch import load_file

    sd = {f"w{i}": torch.randn(200 + i, 129) for i in range(5)} | {"b": torch.arange(33, dtype=torch.int16)}
    parallel_dcp.save(sd, disk / "src", workers=2)
    suffix = ".safetensors" if to == "safetensors" else ".pt"
    outputs = {}
    for io in ("direct", "buffered"):
        sharded = parallel_dcp.convert(disk / "src", disk / f"sharded-{io}", to=to, shard_size="200KiB", io=io)
        single = parallel_dcp.convert(disk / "src", disk / f"one-{io}{suffix}", io=io)
        assert isinstance(sharded, parallel_dcp.SaveResult) and isinstance(single, parallel_dcp.SaveResult)
        assert (sharded.io, single.io) == (io, io)
        shards = [p for p in (disk / f"sharded-{io}").iterdir() if not p.name.startswith(".")]  # not the manifest
        assert len(shards) > 2
        outputs[io] = sorted((p.name, p.read_bytes()) for p in shards)
        outputs[io].append(("one", (disk / f"one-{io}{suffix}").read_bytes()))
    assert outputs["direct"] == outputs["buffered"]
    one = disk / f"one-direct{suffix}"
    loaded = load_file(one) if to == "safetensors" else torch.load(one, weights_only=True)
    assert_same(loaded, sd)
    assert parallel_dcp.verify(disk / "sharded-direct", against=disk / "src").ok


def test_the_memory_model_counts_the_direct_buffers(disk: Path) -> None:
    sd = {f"w{i}": torch.randn(256, 1024) for i in range(4)}
    plans = {
        io: parallel_dcp.save(sd, disk / io, workers=2, io=io, dry_run=True, memory_limit="2GiB")
        for io in ("direct", "buffered")
    }
    assert not (disk / "direct").exists() and not (disk / "buffered").exists(), "a dry run writes nothing"
    added = plans["direct"].predicted_peak_memory - plans["buffered"].predicted_peak_memory
    tasks = plans["direct"].tasks
    # each writing task holds the aligned buffers its file fills (2 MiB each: one buffer)
    assert tasks == 2 and added >= tasks * direct_write.direct_write_memory(2 * 1024 * 1024)


def test_a_shard_over_the_shard_size_is_counted_the_buffers_its_file_fills(
    disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A direct write is counted the buffers its file fills (direct_write_memory(nbytes)); a
    tensor larger than --shard-size gets a shard of its own, and that file fills every buffer,
    whatever the shard size said."""
    from safetensors.torch import save_file

    from parallel_dcp.jobs import targets

    save_file({"big": torch.randn(2560, 4096), "small": torch.randn(64, 64)}, disk / "m.safetensors")  # 40 MiB
    planned: list[Any] = []
    plan = targets.ShardedTarget.plan
    monkeypatch.setattr(targets.ShardedTarget, "plan", lambda *a: planned.append(plan(*a)) or planned[-1])
    memory = {}
    for io in ("direct", "buffered"):  # a buffered file holds no buffers (the direct read's are alike)
        out = parallel_dcp.convert(disk / "m.safetensors", disk / io, to="safetensors", shard_size="1MiB", io=io)
        assert isinstance(out, parallel_dcp.SaveResult) and out.io == io
        memory[io] = {task.keys: task.memory for task in planned[-1]}
    buffers = {keys: memory["direct"][keys] - memory["buffered"][keys] for keys in memory["direct"]}
    # the 40 MiB shard fills all four buffers, the one of 16 KiB one (the source's direct reads
    # add the same to both)
    ring, one = direct_write.direct_write_memory(), direct_write.direct_write_memory(64 * 64 * 4 + 512)
    assert one < ring and buffers[("big",)] - buffers[("small",)] == ring - one


def test_a_safetensors_source_is_read_with_direct_io(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import save_file

    from parallel_dcp.formats import open_source

    sd = {f"w{i}": torch.randn(333 + i, 1031) for i in range(4)} | {"b": torch.arange(10, dtype=torch.int8)}
    save_file(sd, disk / "m.safetensors")
    source = open_source(disk / "m.safetensors")
    source.use_direct_reads("direct")  # type: ignore[attr-defined]
    assert set(source._direct) == set(sd)  # type: ignore[attr-defined]
    source.close()
    results = {io: parallel_dcp.convert(disk / "m.safetensors", disk / io, io=io, chunk_size="512KiB") for io in
               ("direct", "buffered")}  # fmt: skip
    assert {io: r.io for io, r in results.items()} == {"direct": "direct", "buffered": "buffered"}  # type: ignore[union-attr]
    assert shards_by_task(disk / "direct") == shards_by_task(disk / "buffered")
    assert_same(parallel_dcp.load(disk / "direct"), sd)
    data = (disk / "m.safetensors").read_bytes()
    (disk / "m.safetensors").write_bytes(data[: len(data) - 5000])
    with pytest.raises(Exception) as raised:
        parallel_dcp.convert(disk / "m.safetensors", disk / "again", io="direct")
    assert isinstance(raised.value, parallel_dcp.ParallelDCPError), raised.value


def test_the_cli_takes_io_and_reports_it(disk: Path, shm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command's flag, run in this process (main(argv), as ``python -m parallel_dcp`` runs it)."""

    def cli(*args: str | Path, code: int = 0) -> tuple[str, str]:
        assert main([str(a) for a in args]) == code
        done = capsys.readouterr()
        return done.out, done.err

    parallel_dcp.save({"w": torch.randn(64, 64)}, disk / "src", workers=1)
    out, _ = cli("convert", disk / "src", disk / "out", "--io", "direct", "--json")
    assert json.loads(out)[0]["io"] == "direct"
    assert "OK" in cli("verify", disk / "out", "--io", "direct")[0]
    _, failed = cli("convert", disk / "src", shm / "out", "--io", "direct", code=1)
    # The flag's spelling on the command line (issue 31, friction 5), not the keyword's.
    assert "--io direct: cannot write" in failed and "tmpfs" in failed
    assert "io=" not in failed
    assert not (shm / "out").exists()


def test_direct_reads_keep_several_pieces_in_flight(
    disk: Path, small_buffers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A direct read of a long span keeps DEPTH pieces queued per reading thread (it kept one: the
    next piece was asked for only once the last had arrived), and returns the file's bytes."""
    shard = disk / "data.bin"
    payload = os.urandom(9 * (64 << 10) + 777)
    shard.write_bytes(payload)
    lock = threading.Lock()
    running, most = [0], [0]
    pread = ShardFile._pread

    def slow(self: ShardFile, index: int, at: int, length: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.2)  # each piece takes long enough that the next ones are asked for meanwhile
            return pread(self, index, at, length)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(ShardFile, "_pread", slow)
    reader = ShardFile(shard, io="direct")
    try:
        assert reader.direct
        out = bytearray(len(payload) - 1000)
        reader.read(1000, [memoryview(out)])  # unaligned start, across 10 pieces
        assert bytes(out) == payload[1000:]
    finally:
        reader.close()
    assert most[0] == direct_read.DEPTH
