"""What the memory governor charges a process: PSS without program code, steady when neighbours come and go."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap

from parallel_dcp.engine.process_memory import _charge, charged_memory

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
