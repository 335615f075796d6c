"""transformers loads a Llama taken to torchtitan 0.3.0's layout and back by the presets, equal to the original.

Runs in the transformers venv of ``tools/test-clients`` (transformers 5.25). A tiny Llama with
grouped-query attention, saved by transformers itself, goes

    HF folder ── convert --preset hf-llama3-to-torchtitan ──▶ DCP (torchtitan names, q/k rows interleaved)
              ◀── convert --preset torchtitan-to-hf-llama3 --to safetensors --copy-files-from HF folder ──

and ``LlamaForCausalLM.from_pretrained`` of the result holds the original's parameters bit for bit
and gives its logits. The DCP in the middle must differ from a plain rename (its q/k rows are
permuted): a preset that only renamed would pass the round trip, so that is checked too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

REPO = Path(__file__).resolve().parents[2]


def make_llama(dest: Path, dtype: torch.dtype, tied: bool = False) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(29)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    LlamaForCausalLM(config).to(dtype).eval().save_pretrained(dest)
    return dest


def convert(*args: str | Path) -> None:
    cmd = [sys.executable, "-m", "parallel_dcp", "convert", *map(str, args), "--workers", "2", "-q"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert run.returncode == 0, f"{' '.join(cmd)} failed:\n{run.stdout}\n{run.stderr}"


@pytest.mark.parametrize(
    ("dtype", "chunk_size", "tied"),
    [
        (torch.float32, None, False),
        (torch.float32, "4KB", False),
        (torch.bfloat16, None, False),
        (torch.bfloat16, "4KB", False),
        (torch.float32, None, True),
    ],
    ids=["float32-whole", "float32-row-ranges", "bfloat16-whole", "bfloat16-row-ranges", "tied-embeddings"],
)
def test_llama_round_trip_through_torchtitan_layout(
    tmp_path: Path, dtype: torch.dtype, chunk_size: str | None, tied: bool
) -> None:
    from transformers import LlamaForCausalLM

    original_dir = make_llama(tmp_path / "hf", dtype, tied)
    chunks = ["--chunk-size", chunk_size] if chunk_size else []
    convert(original_dir, tmp_path / "titan", "--preset", "hf-llama3-to-torchtitan", *chunks)
    convert(
        tmp_path / "titan",
        tmp_path / "back",
        "--to",
        "safetensors",
        "--preset",
        "torchtitan-to-hf-llama3",
        "--copy-files-from",
        original_dir,
        *chunks,
    )
    original = LlamaForCausalLM.from_pretrained(original_dir, dtype=dtype).eval()
    back = LlamaForCausalLM.from_pretrained(tmp_path / "back", dtype=dtype).eval()
    want, got = original.state_dict(), back.state_dict()
    assert list(got) == list(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, original(ids).logits)

    # the DCP in the middle holds q/k permuted (a rename alone would round-trip too)
    q = torch.empty(64, 64, dtype=dtype)
    dcp.load({"layers.0.attention.qkv_linear.wq.weight": q}, checkpoint_id=str(tmp_path / "titan"), no_dist=True)
    hf_q = want["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q, hf_q)
    assert torch.equal(q.view(4, 8, 2, 64)[:, :, 0], hf_q.view(4, 2, 8, 64)[:, 0])  # pairs' first rows: first halves
