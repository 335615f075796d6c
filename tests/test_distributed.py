"""Several ranks under torchrun (gloo, loopback) write one checkpoint, identical to a single-node one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
import torch.distributed.checkpoint as dcp

import parallel_dcp
from tests.conftest import assert_same

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def torchrun(mode: str, src: Path, dst: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nnodes=1",
            "--nproc_per_node=2",
            str(ROOT / "tests" / "dist_job.py"),
            mode,
            str(src),
            str(dst),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        # the ranks import this checkout's parallel_dcp, not the one installed in the environment
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )


@pytest.fixture
def source(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(3)
    tensors = {f"layers.{i}.weight": torch.randn(64, 48 + i, generator=g) for i in range(8)}
    tensors["embed"] = torch.randn(1000, 256, generator=g).to(torch.bfloat16)  # 500 KiB: split in chunks
    st.save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path / "model.safetensors"


def test_two_ranks_write_the_checkpoint_one_node_would(tmp_path: Path, source: Path) -> None:
    done = torchrun("ok", source, tmp_path / "dist")
    assert done.returncode == 0, done.stdout + done.stderr
    reports = [json.loads(found) for found in re.findall(r"\{[^{}]*\}", done.stdout)]  # ranks' lines may interleave
    assert sorted(r.pop("rank") for r in reports) == [0, 1]
    assert reports[0] == reports[1] and reports[0]["files"] >= 2  # every rank returns the same result

    parallel_dcp.convert(source, tmp_path / "single", workers=2, chunk_size="256KiB")
    expected = st.load_file(source)
    assert_same(parallel_dcp.load(tmp_path / "dist"), parallel_dcp.load(tmp_path / "single"))
    assert_same(parallel_dcp.load(tmp_path / "dist"), expected)
    target = {k: torch.empty_like(v) for k, v in expected.items()}
    dcp.load(target, checkpoint_id=str(tmp_path / "dist"), no_dist=True)
    assert_same(target, expected)
    info = parallel_dcp.inspect(tmp_path / "dist")
    assert info["committed"] and len(info["files"]) >= 3  # shards written by both ranks
    assert parallel_dcp.verify(tmp_path / "dist", against=source).ok


def test_a_rank_failing_mid_write_commits_nothing_and_every_rank_says_why(tmp_path: Path, source: Path) -> None:
    done = torchrun("fail", source, tmp_path / "dist")
    assert done.returncode != 0
    assert "rank 0 failed" in done.stderr and "rank 1 failed" in done.stderr, done.stderr
    assert "injected failure" in done.stderr and "worker 0" in done.stderr and "keys" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no checkpoint, no staging


def test_a_damaged_checksummed_source_commits_nothing_on_any_rank(tmp_path: Path, source: Path) -> None:
    """The ranks split the one source file's tensors (and its large tensor into row ranges): one task
    of one rank hashes the whole file (every rank plans the same duties), and its mismatch fails the
    job on every rank before the commit."""
    ours = tmp_path / "ours.safetensors"  # written by parallel_dcp: its checksums in its header
    parallel_dcp.convert(source, ours, workers=1)
    data = ours.read_bytes()
    at = data.find(st.load_file(source)["embed"].view(torch.int16).numpy().tobytes()[:256]) + 1000
    before = ours.stat()
    with open(ours, "r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0x5A]))
    os.utime(ours, ns=(before.st_atime_ns, before.st_mtime_ns))
    done = torchrun("ok", ours, tmp_path / "dist")
    assert done.returncode != 0
    assert "its bytes are not the ones its checksum" in done.stderr, done.stderr
    assert not (tmp_path / "dist" / ".metadata").exists()


def test_distributed_without_a_launcher_is_a_clear_error(tmp_path: Path, source: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "parallel_dcp", "convert", str(source), str(tmp_path / "out"), "--distributed"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")},
    )
    assert done.returncode == 1 and "needs a torch.distributed launcher" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()
