"""Stock dcp.load with FastReader reads a checkpoint written by a 2-rank torchrun job of DTensors
(Shard(0)) into plain full tensors in one process, and into DTensors of Shard(1) in a 2-rank job."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import parallel_dcp
from parallel_dcp import ReadStats
from tests.conftest import assert_same
from tests.dtensor_job import source

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def torchrun(mode: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nnodes=1",
            "--nproc_per_node=2",
            str(ROOT / "tests" / "dtensor_job.py"),
            mode,
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dtensor") / "ckpt"
    done = torchrun("save", path)
    assert done.returncode == 0, done.stdout + done.stderr
    return path


def test_full_tensors_in_one_process(sharded: Path) -> None:
    expected = source()
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    reader = parallel_dcp.FastReader(sharded, workers=2)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert_same(target, expected)
    assert reader.stats.fallback == 0 and reader.stats.fast == 2 * len(expected)  # two stored chunks each
    stats = ReadStats()
    assert_same(parallel_dcp.load(sharded, workers=2, stats=stats), expected)
    assert stats.fallback == 0 and stats.fast == 2 * len(expected)


def test_dtensors_of_another_sharding_in_two_ranks(sharded: Path) -> None:
    done = torchrun("load", sharded)
    assert done.returncode == 0, done.stdout + done.stderr
    # the two ranks print at the same time: their lines may run into each other ("}{")
    decoder = json.JSONDecoder()
    reports = [decoder.raw_decode(done.stdout, m.start())[0] for m in re.finditer(r'\{"rank"', done.stdout)]
    assert sorted(r["rank"] for r in reports) == [0, 1], done.stdout
    for report in reports:
        assert report["equal"] == {"w": True, "e": True, "b": True}, report
        assert report["fallback"] == 0 and report["fast"] >= 3, report
