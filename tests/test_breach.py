"""Who a breach names (engine/breach.py): each process's growth since the job started, told apart
from the pages a worker inherited and now maps alone."""

from __future__ import annotations

import textwrap

from parallel_dcp.engine.breach import JobStart, growth
from parallel_dcp.engine.proc_reading import PAGE, AnonymousPages, Counters, smaps_sums

MiB = 2**20
CALLER, WORKER, HELD = 100, 200, 300


def _start(anon: int = 500 * MiB, faults: int = 1000, born: int = 500 * MiB) -> JobStart:
    return JobStart(CALLER, Counters(anon, 0, faults), {WORKER: born})


def _grown(start: JobStart, now: Counters, worker_private: int, pages: AnonymousPages) -> dict[int, int]:
    return growth(
        {CALLER: 0, WORKER: 0},
        {},
        {WORKER: worker_private},
        start,
        now,
        {WORKER: pages, CALLER: AnonymousPages(now.anon, 0, 0)},
    )


def test_pages_the_caller_freed_under_its_worker_are_the_callers() -> None:
    """The caller freed 100 MiB its worker inherited (no fault: its RssAnon only dropped), then
    allocated 192 (one fault a page): the worker, which allocated nothing, holds 105 MiB alone, of
    which the caller can have let go 100 (its faults less its growth); the rest are the worker's
    own copies."""
    now = Counters(592 * MiB, 0, 1000 + 192 * MiB // PAGE)
    grown = _grown(_start(), now, 105 * MiB, AnonymousPages(500 * MiB, 105 * MiB, 0))
    assert grown[CALLER] == 192 * MiB and grown[WORKER] == 5 * MiB


def test_a_quiet_caller_is_not_charged_the_copies_its_worker_made() -> None:
    """The worker wrote to 30 MiB it inherited (its copies: private, its RssAnon unmoved); the
    caller neither allocated nor freed (no fault since the start): the copies are the worker's."""
    grown = _grown(_start(), Counters(500 * MiB, 0, 1000), 30 * MiB, AnonymousPages(500 * MiB, 30 * MiB, 0))
    assert grown == {WORKER: 30 * MiB, CALLER: 0}


def test_what_a_worker_allocates_stays_its_own_however_much_the_caller_let_go() -> None:
    """The worker allocated 400 MiB (its RssAnon grew by as much) beside 10 MiB inherited and now
    private; the caller freed 1 GiB of its own: at most the 10 MiB move to it."""
    now = Counters(1524 * MiB - 2**30, 0, 1000)
    grown = _grown(_start(1524 * MiB, born=1524 * MiB), now, 410 * MiB, AnonymousPages(1924 * MiB, 410 * MiB, 0))
    assert grown[WORKER] == 400 * MiB and grown[CALLER] == -1014 * MiB


def test_a_callers_huge_pages_count_as_the_faults_they_saved() -> None:
    """The caller's 192 MiB came in huge pages (96 faults): what it let go is still told."""
    now = Counters(592 * MiB, 0, 1000 + 96)
    start = _start()
    pages = AnonymousPages(500 * MiB, 105 * MiB, 0)
    grown = growth(
        {CALLER: 0, WORKER: 0},
        {},
        {WORKER: 105 * MiB},
        start,
        now,
        {WORKER: pages, CALLER: AnonymousPages(592 * MiB, 0, 192 * MiB)},
    )
    assert grown[CALLER] == 192 * MiB + 96 * PAGE and grown[WORKER] == 5 * MiB - 96 * PAGE


def test_held_processes_and_workers_not_read_at_their_start_keep_their_figures() -> None:
    """A process held from before the job: its charge's growth; a worker whose start was not read,
    or whose smaps could not be: its private memory, as before."""
    start = JobStart(CALLER, Counters(500 * MiB, 0, 1000))
    charged = {CALLER: 0, WORKER: 50 * MiB, HELD: 70 * MiB}
    grown = growth(charged, {HELD: 20 * MiB}, {WORKER: 40 * MiB, HELD: 9}, start, Counters(510 * MiB, 0, 1000), {})
    assert grown == {WORKER: 40 * MiB, HELD: 50 * MiB, CALLER: 10 * MiB}


def test_a_listings_anonymous_pages_and_those_mapped_alone() -> None:
    listing = textwrap.dedent(
        """\
        55d0c0000000-55d0c0100000 rw-p 00000000 00:00 0                          [heap]
        Pss:                 800 kB
        Private_Clean:         0 kB
        Private_Dirty:       600 kB
        Anonymous:          1000 kB
        AnonHugePages:         0 kB
        VmFlags: rd wr mr mw me ac
        7f0000900000-7f0000a00000 rw-p 00900000 08:01 11                         /lib/libtorch_cpu.so
        Pss:                  70 kB
        Private_Clean:        40 kB
        Private_Dirty:        60 kB
        Anonymous:            60 kB
        AnonHugePages:         0 kB
        7f1000000000-7f1004000000 rw-p 00000000 00:00 0
        Pss:                4096 kB
        Private_Clean:         0 kB
        Private_Dirty:      4096 kB
        Anonymous:          4096 kB
        AnonHugePages:      4096 kB
        """
    ).encode()
    charged, private, pss, pages = smaps_sums(listing)
    # The heap: 1000 kB anonymous, 600 of them private; the library's 60 kB of copies, private
    # (its 40 kB of clean file pages are not anonymous); a region of two huge pages.
    assert pages == AnonymousPages(5156 * 1024, 4756 * 1024, 4096 * 1024)
    # (No executable mapping of the library here: none of its pages is code.)
    assert (charged, private, pss) == (4966 * 1024, 4796 * 1024, 4966 * 1024)
