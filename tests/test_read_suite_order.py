"""The read suite's fairness rules, on made-up rows (no timing): each round runs the rows in an
order of its own, and a copy is held to the fastest of its plain reads, whichever it is."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from parallel_dcp.benchmark.device import queued_read
from parallel_dcp.benchmark.measure import Case, round_order, run_interleaved, run_order
from parallel_dcp.benchmark.read_peers import fresh_row, plain_rows
from parallel_dcp.benchmark.reading import read_summary


def _cases(count: int, log: list[str] | None = None) -> list[Case]:
    def run(name: str) -> object:
        def record(out: str) -> None:
            if log is not None:
                log.append(name)

        return record

    return [Case(name=f"row {i}", family=f"row {i}", procs=1 + i % 2, run=run(f"row {i}")) for i in range(count)]


def test_each_round_of_a_shuffled_suite_runs_every_row_once_in_an_order_of_its_own() -> None:
    cases = _cases(8)
    orders = [[c.name for c in round_order(cases, r, shuffled=True)] for r in range(6)]
    for order in orders:
        assert sorted(order) == sorted(c.name for c in cases)
    assert len({tuple(o) for o in orders}) > 1, "every round in the same order"
    # no row runs right after the same row in every round
    follows = {name: {o[o.index(name) - 1] for o in orders if o.index(name)} for name in orders[0]}
    assert all(len(before) > 1 for before in follows.values() if before)
    # the same orders in every run of the benchmark (seeded by the round), and the fixed order otherwise
    assert orders == [[c.name for c in round_order(cases, r, shuffled=True)] for r in range(6)]
    assert [c.name for c in round_order(cases, 3, shuffled=False)] == [c.name for c in run_order(cases)]


def test_run_interleaved_follows_the_round_orders_and_records_what_ran_before(tmp_path: Path) -> None:
    log: list[str] = []
    cases = _cases(5, log)
    measured = run_interleaved(cases, reps=2, warmup=1, root=str(tmp_path), shuffled=True)
    rounds = [[c.name for c in round_order(cases, r, shuffled=True)] for r in range(3)]
    assert log == [name for order in rounds for name in order]
    for m in measured:  # each timed repetition names the row just before it in its round
        assert len(m.after) == len(m.walls) == 2
        for order, after in zip(rounds[1:], m.after, strict=True):
            at = order.index(m.case.name)
            assert after == (order[at - 1] if at else None)


def _rows(times: dict[str, float]) -> dict[str, dict[str, object]]:
    return {name: {"median_s": t, "details": {}} for name, t in times.items()}


def test_a_copy_is_held_to_its_fastest_plain_read_whichever_it_is() -> None:
    n = 2
    times = {name: 2.0 for tag in ("hf", "dcp") for name in plain_rows(tag, n)}
    times["plain read 8x1M buffered [hf]"] = 1.0  # the loader's readers, buffered: the fastest here
    times["plain read x2 direct [dcp]"] = 1.5
    times |= {"load w=2 [hf]": 1.25, "load w=2 [dcp]": 1.5, "stock load_file + touch [hf]": 2.5}
    times[fresh_row("hf", n)] = 0.5  # faster than every plain read, yet never the limit: not a plain read
    rows = _rows(times)
    rows["fio direct x2 [dcp]"] = {"median_s": 3.0, "details": {"fio_seconds": [1.2, 1.2, 1.4]}}
    summary = read_summary(rows, n)
    assert summary["hf"]["best_plain_read"] == "plain read 8x1M buffered [hf]"
    assert summary["hf"]["share_of_best_plain_read"] == 1.0 / 1.25
    assert summary["hf"]["share_of_fresh_plain_read"] == 0.5 / 1.25  # beside it, as its own figure
    assert summary["dcp"]["share_of_fresh_plain_read"] is None  # not run
    # fio's own job time (not its wall time, which holds its start-up) when it is the fastest
    assert summary["dcp"]["best_plain_read"] == "fio direct x2 [dcp] (job time)"
    assert summary["dcp"]["share_of_best_plain_read"] == 1.2 / 1.5


def test_the_queued_read_reads_every_byte_of_every_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = []
    for i, size in enumerate((3 << 20, (1 << 20) + 4096, 5000)):
        path = tmp_path / f"f{i}"
        path.write_bytes(os.urandom(size))
        files.append(str(path))
    seen: list[tuple[int, int, int]] = []
    real = os.preadv

    def preadv(fd: int, buffers: list[mmap.mmap], at: int) -> int:
        got = real(fd, buffers, at)
        seen.append((os.fstat(fd).st_size, at, got))
        return got

    monkeypatch.setattr(os, "preadv", preadv)
    for fresh in (False, True):  # into ready buffers, and into one fresh mapping of all the bytes
        seen.clear()
        queued_read(files, 3, 1 << 20, direct=False, fresh=fresh)("")
        for path in files:
            size = os.path.getsize(path)
            assert sum(got for s, _, got in seen if s == size) == size
            assert sorted(at for s, at, _ in seen if s == size) == list(range(0, size, 1 << 20))
