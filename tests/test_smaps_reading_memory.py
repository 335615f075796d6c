"""A full reading of a process's smaps holds a bounded buffer, not the listing: the governor reads
its own process (the coordinator) and every new worker in full, on several threads at once, and
what a reading holds is the coordinator's growth that no plan counts."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import tracemalloc

from parallel_dcp.engine.proc_reading import charge_and_pss, exact_charge

MiB = 2**20


def test_a_full_reading_holds_a_fraction_of_the_listing_it_sums() -> None:
    """Read whole and split into lines, a listing was held ~3.7 times over (a test process late in
    a suite run: 700 mappings, 0.5 MiB of listing; its one-worker save grew 1.8-6.4 MiB beside
    COORDINATOR_RUN_BYTES' 3 MiB, and tests/test_dryrun.py's check of it failed). Here the process
    maps enough small regions for a listing of over 1 MiB; the reading allocates at most a
    quarter of it at any moment; it sums what the whole listing sums."""
    regions = [mmap.mmap(-1, mmap.PAGESIZE * (1 + i % 3)) for i in range(1500)]  # each its own mapping
    for region in regions:
        region[0:1] = b"x"
    try:
        with open(f"/proc/{os.getpid()}/smaps", "rb") as smaps:
            listing = smaps.read()
        assert len(listing) > MiB
        exact_charge(os.getpid())  # (the modules and caches a first call loads are not the reading's)
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            charged, private, pss = exact_charge(os.getpid())
            held = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
        assert held < len(listing) / 4, f"a reading held {held / MiB:.2f} MiB of a {len(listing) / MiB:.2f} MiB listing"
        assert charged > 0 and private > 0 and pss >= charged
        # The same sums as the listing read whole, in a process whose pages stay put meanwhile.
        script = "import sys; print('ready', flush=True); sys.stdin.read()"
        idle = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert idle.stdout is not None and idle.stdout.readline() == b"ready\n"
            with open(f"/proc/{idle.pid}/smaps", "rb") as smaps:
                assert exact_charge(idle.pid) == charge_and_pss(smaps.read())
        finally:
            idle.communicate(b"")
    finally:
        for region in regions:
            region.close()
