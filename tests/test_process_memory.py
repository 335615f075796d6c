"""What the memory governor charges a process: PSS without program code, steady when neighbours come and go."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap

import pytest

from parallel_dcp.engine import process_memory
from parallel_dcp.engine.process_memory import ChargeReader, _charge, charged_memory

MiB = 2**20

SMAPS = textwrap.dedent(
    """\
    55d0c0000000-55d0c0100000 rw-p 00000000 00:00 0                          [heap]
    Size:               1024 kB
    Pss:                 800 kB
    Private_Clean:         0 kB
    Private_Dirty:       800 kB
    VmFlags: rd wr mr mw me ac
    7f0000000000-7f0000100000 r--p 00000000 08:01 11                         /lib/libtorch_cpu.so
    Pss:                 300 kB
    Private_Clean:         0 kB
    Private_Dirty:         0 kB
    7f0000100000-7f0000900000 r-xp 00100000 08:01 11                         /lib/libtorch_cpu.so
    Pss:                5000 kB
    Private_Clean:        40 kB
    Private_Dirty:         0 kB
    7f0000900000-7f0000a00000 rw-p 00900000 08:01 11                         /lib/libtorch_cpu.so
    Pss:                  70 kB
    Private_Clean:         0 kB
    Private_Dirty:        60 kB
    7f1000000000-7f1004000000 r--s 00000000 08:01 12                         /data/model with space.safetensors
    Pss:                2048 kB
    Private_Clean:      2048 kB
    Private_Dirty:         0 kB
    7f2000000000-7f2000400000 rw-s 00000000 00:01 13                         /dev/zero (deleted)
    Pss:                 512 kB
    Private_Clean:         0 kB
    Private_Dirty:       512 kB
    7f3000000000-7f3000100000 rw-p 00000000 00:00 0
    Pss:                 100 kB
    Private_Clean:         0 kB
    Private_Dirty:       100 kB
    """
).encode()


def test_program_code_is_left_out_and_everything_else_counts() -> None:
    charged, private = _charge(SMAPS)
    # heap 800 + the library's own dirtied pages 60 + the mapped source 2048 + shared memory 512
    # + anonymous 100; the library's file pages (300 + 5000 + the rest of 70) are left out.
    assert charged == (800 + 60 + 2048 + 512 + 100) * 1024
    assert private == (800 + 40 + 60 + 2048 + 512 + 100) * 1024


def test_an_allocation_is_charged_in_full() -> None:
    # A fresh mapping, written: the allocator could otherwise hand back heap pages an earlier test
    # in this process already touched (and so already counted).
    held, piece = mmap.mmap(-1, 32 * MiB), b"\x01" * MiB
    before = charged_memory(os.getpid())[0]
    for offset in range(0, 32 * MiB, MiB):
        held[offset : offset + MiB] = piece
    after = charged_memory(os.getpid())[0]
    held.close()
    assert 31 * MiB <= after - before <= 34 * MiB


def test_the_charge_stays_while_other_torch_processes_start_and_exit() -> None:
    """The cause of false MemoryLimitExceeded on a busy machine: another process mapping the same
    shared libraries moves this process's PSS (by ~100 MiB with three neighbours on a quiet
    machine; less where other torch processes already share the pages, so PSS is not asserted
    here), not its charge."""
    charged_alone = charged_memory(os.getpid())[0]
    neighbours = [
        subprocess.Popen(
            [sys.executable, "-c", "import sys, torch; torch.ones(8).sum(); print('up', flush=True); sys.stdin.read()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for _ in range(3)
    ]
    try:
        for proc in neighbours:
            assert proc.stdout is not None and proc.stdout.readline().strip() == b"up"
        charged_shared = charged_memory(os.getpid())[0]
    finally:
        for proc in neighbours:
            proc.communicate(b"", timeout=60)
    charged_after = charged_memory(os.getpid())[0]
    assert abs(charged_shared - charged_alone) < 4 * MiB
    assert abs(charged_after - charged_alone) < 4 * MiB


def test_a_process_that_is_gone_holds_nothing() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert charged_memory(proc.pid) == (0, 0)


def _torch_children(count: int) -> list[subprocess.Popen[bytes]]:
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys, torch; held = torch.ones(4 * 2**20); print('up', flush=True); sys.stdin.readline();"
                " more = torch.ones(8 * 2**20); print('grown', flush=True); sys.stdin.read()",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for _ in range(count)
    ]
    for proc in children:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"up"
    return children


def test_the_cheap_reading_charges_what_the_full_one_does_on_torch_processes() -> None:
    """smaps_rollup on top of each process's code share, read once, against smaps read in full:
    the same charge within a few MiB (what a busy machine moves between two reads), also after
    the processes grew by 32 MiB each, with no process read in full the second time."""
    children = _torch_children(3)
    try:
        pids = [os.getpid(), *(proc.pid for proc in children)]
        reader = ChargeReader()
        for pid, full in zip(pids, reader.plan(pids), strict=True):
            assert full  # never read before: read in full, code share learned
            reader.charge(pid, full)
        for proc in children:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == b"grown"
        before = reader.full_reads
        plan = reader.plan(pids)
        assert not any(plan) and reader.full_reads == before
        cheap = [reader.charge(pid, full)[0] for pid, full in zip(pids, plan, strict=True)]
        exact = [charged_memory(pid)[0] for pid in pids]
    finally:
        for proc in children:
            proc.communicate(b"", timeout=60)
    for pid, got, want in zip(pids, cheap, exact, strict=True):
        assert abs(got - want) < 4 * MiB, f"pid {pid}: cheap {got / MiB:.1f} MiB, full {want / MiB:.1f} MiB"
    for got in cheap[1:]:
        assert got > 48 * MiB  # the 16 + 32 MiB each child holds are in the cheap reading


def test_which_processes_a_reading_reads_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(process_memory.time, "monotonic", lambda: now[0])
    reader = ChargeReader()
    reader._known = {1: process_memory._Known(code=0, at=100.0)}  # 1 was read in full at 100 s
    reader._members = frozenset({1})
    reader._all_read_at = 100.0
    assert reader.plan([1]) == [False]
    now[0] = 100.5  # a new worker, 0.5 s after the last full pass: it alone is read in full
    assert reader.plan([1, 2]) == [False, True]
    reader._known[2] = process_memory._Known(code=0, at=100.5)
    now[0] = 100.9
    assert reader.plan([1, 2]) == [False, False]
    now[0] = 101.0  # the tree changed; a second after the last full pass: every process again
    assert reader.plan([1, 2]) == [True, True]
    reader._known = {pid: process_memory._Known(code=0, at=101.0) for pid in (1, 2)}
    assert reader.plan([1, 2]) == [False, False]
    now[0] = 101.0 + process_memory._CODE_REFRESH_S
    reader._known[2].at = 100.9
    assert reader.plan([1, 2]) == [False, True]  # the oldest full reading is renewed, one a reading
    assert reader.plan([1, 2], exact=True) == [True, True]
    reader._known = {pid: process_memory._Known(code=0, at=now[0]) for pid in (1, 2)}
    now[0] += process_memory._MEMBERSHIP_REFRESH_S
    assert reader.plan([1]) == [True]  # a worker left: the others' code shares moved
    assert set(reader._known) == {1}
