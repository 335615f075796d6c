"""Whether the side index was used, and why not (issue 32): ``ReadStats.index`` for every reason a
load reads ``.metadata`` instead, and what ``inspect`` and ``verify`` say of a checkpoint's index.

The crafted indexes are those of tests/test_side_index.py; each reason is checked through a real
``load`` and, where the load path cannot reach it, through the reader itself."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.filesystem import FileSystemWriter

import parallel_dcp
from parallel_dcp.benchmark.loading import load_summary
from parallel_dcp.benchmark.report import _load_summary_lines
from parallel_dcp.cli import main
from parallel_dcp.storage import side_index_read
from parallel_dcp.storage.metadata import read_index_or_metadata
from parallel_dcp.storage.safe_reader import open_bounded
from parallel_dcp.storage.side_index import INDEX_FILE
from parallel_dcp.storage.side_index_read import INDEX_MEMORY_FACTOR, examine_index, read_index
from parallel_dcp.storage.side_index_use import (
    ABSENT,
    DAMAGED,
    NOT_ASKED,
    OVER_BUDGET,
    REASONS,
    STALE,
    UNSAFE,
    IndexUse,
)
from tests.test_side_index import (
    CHECKED,
    UNREAD,
    _copy,
    _empty_like,
    _file_name,
    _garbage,
    _huge_count,
    _old_version,
    _same,
    _sealed,
    _shared_record,
    _state,
    _swapped,
    _truncated,
    _twice,
    _without_index,
    _wrong_hash,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("index-stats") / "ckpt"
    parallel_dcp.save(_state(), path, workers=2)
    return path


def _use(path: Path, **kwargs: Any) -> IndexUse:
    """What a load(into=) of ``path`` reports in ``ReadStats.index`` (the load itself checked)."""
    stats = parallel_dcp.ReadStats()
    state = _state()
    _same(parallel_dcp.load(path, into=_empty_like(state), workers=2, stats=stats, **kwargs), state)
    assert stats.index is not None
    return stats.index


def _crafted(saved: Path, tmp_path: Path, craft: Callable[[bytearray], bytearray], seal: bool | None = None) -> Path:
    """A copy of ``saved`` with its index crafted; sealed (its body's hash made right) as
    tests/test_side_index.py does for the crafts only the checks over the columns can see."""
    path = _copy(saved, tmp_path)
    data = craft(bytearray((saved / INDEX_FILE).read_bytes()))
    (path / INDEX_FILE).write_bytes(bytes(_sealed(data) if (craft in CHECKED if seal is None else seal) else data))
    return path


# --- ReadStats.index: each reason through a real load ---------------------------------------------


def test_a_load_into_says_it_read_the_index_and_its_size(saved: Path) -> None:
    use = _use(saved)
    assert use.used and use.reason is None and use.source == INDEX_FILE
    assert use.nbytes == (saved / INDEX_FILE).stat().st_size
    assert use.summary().startswith("plan from the side index (") and use.present


def test_no_index_beside_metadata_is_absent(saved: Path) -> None:
    use = _use(_without_index(saved))
    assert (use.reason, use.used, use.present, use.source) == (ABSENT, False, False, ".metadata")
    assert INDEX_FILE in use.detail and "plan from .metadata (no side index" in use.summary()


def test_entries_an_index_cannot_describe_leave_it_absent(tmp_path: Path) -> None:
    """Split tensors and compressed records: our writers write no index, and the load says so."""
    state = {"big": torch.randn(4099, 96), "small": torch.randn(3)}
    for name, how in (("chunks", {"chunk_size": 200_000}), ("zstd", {"compress": "zstd"})):
        parallel_dcp.save(state, tmp_path / name, workers=2, **how)
        stats = parallel_dcp.ReadStats()
        into = {k: torch.empty_like(v) for k, v in state.items()}
        _same(parallel_dcp.load(tmp_path / name, into=into, workers=2, stats=stats), state)
        assert stats.index is not None and stats.index.reason == ABSENT, name


def test_a_stock_rewrite_leaves_a_stale_index(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    other = _state()
    other["model"]["w"] = torch.arange(12.0).view(3, 4)
    dcp.save(other, storage_writer=FileSystemWriter(str(path), thread_count=2), no_dist=True)
    assert (path / INDEX_FILE).is_file()
    stats = parallel_dcp.ReadStats()
    _same(parallel_dcp.load(path, into=_empty_like(other), workers=2, stats=stats)["model"], other["model"])
    assert stats.index is not None and stats.index.reason == STALE and "bound to" in stats.index.detail
    assert stats.index.nbytes == (path / INDEX_FILE).stat().st_size


def test_an_index_bound_to_other_bytes_of_the_same_size_is_stale(saved: Path, tmp_path: Path) -> None:
    use = _use(_crafted(saved, tmp_path, _wrong_hash))
    assert use.reason == STALE and "same size" in use.detail


@pytest.mark.parametrize(
    ("craft", "says"),
    [
        (_shared_record, "two records share bytes"),
        (_file_name(b"../escape.distcp"), "escape.distcp"),
        (_twice, "a key appears twice"),
        (_truncated, "counts make"),
        (_huge_count, "counts make"),
        (_old_version, "version 99; this reader reads version 1"),
        (_garbage, "not an index"),
        (_swapped, "do not hash to the xxh3_64 in its header"),
    ],
    ids=["shared record", "escaping name", "key twice", "truncated", "huge count", "version", "garbage", "swapped"],
)
def test_a_damaged_index_names_the_check_that_failed(
    saved: Path, tmp_path: Path, craft: Callable[[bytearray], bytearray], says: str
) -> None:
    use = _use(_crafted(saved, tmp_path, craft, seal=craft in CHECKED or "escape" in says))
    assert use.reason == DAMAGED and says in use.detail, use
    assert use.nbytes == (tmp_path / "ckpt" / INDEX_FILE).stat().st_size


def test_an_index_shorter_than_its_header_is_damaged(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    (path / INDEX_FILE).write_bytes(b"PDCPCOL1")
    use = _use(path)
    assert use.reason == DAMAGED and "shorter than its header" in use.detail and use.nbytes == 8


def test_a_planted_symlink_or_fifo_is_unsafe(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    (path / INDEX_FILE).rename(tmp_path / "elsewhere")
    (path / INDEX_FILE).symlink_to(tmp_path / "elsewhere")
    use = _use(path)
    assert use.reason == UNSAFE and "symlink" in use.detail.lower() and use.present
    (path / INDEX_FILE).unlink()
    os.mkfifo(path / INDEX_FILE)
    assert _use(path).reason == UNSAFE  # (never opened blocking)


def test_an_index_over_the_memory_limit_says_so(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a load: an index whose budget (its size x INDEX_MEMORY_FACTOR) passes the limit."""
    size = (saved / INDEX_FILE).stat().st_size
    monkeypatch.setattr(side_index_read, "INDEX_MEMORY_FACTOR", (256 << 20) // size + 1)
    use = _use(saved, memory_limit="256MiB")
    assert use.reason == OVER_BUDGET and "256.0 MiB" in use.detail and use.nbytes == size


def test_the_budget_edge_is_the_readers_own(saved: Path) -> None:
    size = (saved / INDEX_FILE).stat().st_size
    with open_bounded(saved / ".metadata") as stream:
        metadata_size = stream.raw.size  # type: ignore[attr-defined]
        index, use = examine_index(saved, stream, metadata_size, size * INDEX_MEMORY_FACTOR)
        assert index is not None and use.used
        index, use = examine_index(saved, stream, metadata_size, size * INDEX_MEMORY_FACTOR - 1)
        assert index is None and use.reason == OVER_BUDGET


@pytest.mark.parametrize(
    "how",
    [pytest.param({}, id="no into"), pytest.param({"retries": 1}, id="worker processes")],
)
def test_a_load_path_that_reads_metadata_says_it_did_not_ask(saved: Path, how: dict[str, Any]) -> None:
    stats = parallel_dcp.ReadStats()
    _same(parallel_dcp.load(saved, workers=2, stats=stats, **how), _state())
    assert stats.index is not None and stats.index.reason == NOT_ASKED and stats.index.present is None
    assert "load(into=)" in stats.index.detail


def test_a_load_into_with_a_cast_says_it_did_not_ask(tmp_path: Path) -> None:
    """``dtype=`` loads as stored without ``into`` and casts after: .metadata is read."""
    parallel_dcp.save({"w": torch.randn(3)}, tmp_path / "c", workers=1)
    stats = parallel_dcp.ReadStats()
    parallel_dcp.load(tmp_path / "c", into={"w": torch.zeros(3)}, dtype="float32", workers=1, stats=stats)
    assert stats.index is not None and stats.index.reason == NOT_ASKED and "dtype=" in stats.index.detail


def test_other_sources_report_no_index(tmp_path: Path) -> None:
    save_file({"a": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    stats = parallel_dcp.ReadStats()
    parallel_dcp.load(tmp_path / "model.safetensors", stats=stats)
    assert stats.index is None


@pytest.mark.parametrize("craft", CHECKED + UNREAD, ids=lambda f: f.__qualname__.split(".")[0].strip("_"))
def test_the_reason_never_changes_what_is_refused(
    saved: Path, tmp_path: Path, craft: Callable[[bytearray], bytearray]
) -> None:
    """read_index and examine_index agree on every crafted index (the checks are the reader's)."""
    path = _crafted(saved, tmp_path, craft)
    with open_bounded(path / ".metadata") as stream:
        size = stream.raw.size  # type: ignore[attr-defined]
        assert read_index(path, stream, size, None) is None
        index, use = examine_index(path, stream, size, None)
        assert index is None and use.reason in (DAMAGED, STALE) and use.detail
        assert stream.tell() == 0
    assert read_index_or_metadata(path)[2] is None


def test_reasons_are_the_stable_set() -> None:
    assert REASONS == ("absent", "stale", "damaged", "unsafe", "over_budget", "not_asked")
    with pytest.raises(ValueError, match="not one of"):
        IndexUse("gone")
    assert IndexUse(STALE, "x", 5).as_dict() == {
        "used": False,
        "present": True,
        "reason": "stale",
        "detail": "x",
        "bytes": 5,
    }


def test_read_stats_add_keeps_the_latest_index() -> None:
    total = parallel_dcp.ReadStats()
    total.add(parallel_dcp.ReadStats(index=IndexUse(ABSENT)))
    total.add(parallel_dcp.ReadStats())
    assert total.index == IndexUse(ABSENT)


# --- inspect and verify ---------------------------------------------------------------------------


def _cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_says_whether_the_index_is_valid(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _cli(capsys, "inspect", saved)
    assert code == 0 and "side index valid for its .metadata" in out
    code, out, _ = _cli(capsys, "inspect", saved, "--json")
    found = json.loads(out)["side_index"]
    assert found == {"used": True, "present": True, "reason": None, "detail": "", "bytes": found["bytes"]}
    assert found["bytes"] == (saved / INDEX_FILE).stat().st_size
    plain = _without_index(saved)
    assert json.loads(_cli(capsys, "inspect", plain, "--json")[1])["side_index"]["reason"] == ABSENT
    assert "no side index" in _cli(capsys, "inspect", plain)[1]
    damaged = _crafted(saved, tmp_path, _twice)
    code, out, _ = _cli(capsys, "inspect", damaged)
    assert code == 0 and "side index damaged:" in out and "a key appears twice" in out  # the checkpoint loads
    save_file({"a": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    assert json.loads(_cli(capsys, "inspect", tmp_path / "model.safetensors", "--json")[1])["side_index"] is None


def test_verify_passes_an_absent_or_stale_index(saved: Path, tmp_path: Path) -> None:
    report = parallel_dcp.verify(saved, workers=2)
    assert report.ok and report.side_index is not None and report.side_index.used and not report.warnings
    report = parallel_dcp.verify(_without_index(saved), workers=2)
    assert report.ok and report.side_index is not None and report.side_index.reason == ABSENT
    assert not report.warnings
    stale = _crafted(saved, tmp_path, _wrong_hash)
    report = parallel_dcp.verify(stale, workers=2)
    assert report.ok and report.side_index is not None and report.side_index.reason == STALE
    assert not report.warnings and report.as_dict()["side_index"]["reason"] == STALE


@pytest.mark.parametrize("quiet", [False, True], ids=["plain", "quiet"])
def test_verify_warns_of_a_damaged_index_and_passes(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], quiet: bool
) -> None:
    damaged = _crafted(saved, tmp_path, _swapped)
    code, out, err = _cli(capsys, "verify", damaged, "--workers", "2", *(["-q"] if quiet else []))
    shown = err if quiet else out
    assert code == 0
    assert "warning: side index damaged: its columns do not hash" in shown and "reads .metadata" in shown
    if not quiet:
        assert "OK" in out
    code, out, _ = _cli(capsys, "verify", damaged, "--workers", "2", "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["side_index"]["reason"] == DAMAGED
    assert len(report["warnings"]) == 1 and "damaged" in report["warnings"][0]


def test_verify_prints_a_valid_or_stale_index(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(capsys, "verify", saved, "--workers", "2")
    assert code == 0 and "side index valid for its .metadata" in out and "warning" not in out + err
    code, out, err = _cli(capsys, "verify", _without_index(saved), "--workers", "2")
    assert code == 0 and "no side index" in out and "warning" not in out + err


def test_verify_warns_of_an_unsafe_index(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    (path / INDEX_FILE).rename(tmp_path / "elsewhere")
    (path / INDEX_FILE).symlink_to(tmp_path / "elsewhere")
    report = parallel_dcp.verify(path, workers=2)
    assert report.ok and report.side_index is not None and report.side_index.reason == UNSAFE
    assert report.warnings and "side index unsafe" in report.warnings[0]


def test_the_bench_summary_prints_what_the_plan_was_read_from() -> None:
    plan = IndexUse(None, "", 2048).summary()
    rows = {"load into w=2 [pdcp]": {"median_s": 1.0, "details": {"records": 5, "plan": plan}}}
    summary = load_summary(rows, 2)
    assert summary["pdcp"]["into_plan"] == plan and summary["stock"]["into_plan"] is None
    lines = _load_summary_lines(summary)
    assert "[pdcp] load into w=2: plan from the side index (2.0 KiB)" in lines
    assert not any(line.startswith("[stock] load into w=2: plan") for line in lines)
