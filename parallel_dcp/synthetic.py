"""Synthetic state dicts for the demo, the benchmark and the tests, shaped like real ones."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["llm_like", "lopsided", "many_small", "tensor_bytes"]


def llm_like(gib: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A few large embedding-like tensors, many medium ones, a few small; fp32 and bf16."""
    gen = torch.Generator().manual_seed(seed)
    budget = int(gib * 2**30)
    sd: dict[str, torch.Tensor] = {}
    hidden = 1024 if budget >= 2**28 else 64  # tiny sizes (tests) keep many keys
    emb_rows = max(1, budget // 8 // (hidden * 4))
    sd["tok_embeddings.weight"] = torch.randn(emb_rows, hidden, generator=gen)
    sd["output.weight"] = torch.randn(emb_rows, hidden, generator=gen).to(torch.bfloat16)
    used = sum(t.nbytes for t in sd.values())
    layer = 0
    while used < budget:
        for name, shape, dtype in (
            ("attention.wqkv.weight", (3 * hidden, hidden), torch.bfloat16),
            ("attention.wo.weight", (hidden, hidden), torch.float32),
            ("feed_forward.w1.weight", (4 * hidden, hidden), torch.bfloat16),
            ("feed_forward.w2.weight", (hidden, 4 * hidden), torch.float32),
            ("attention_norm.weight", (hidden,), torch.float32),
            ("ffn_norm.weight", (hidden,), torch.float32),
        ):
            t = torch.randn(*shape, generator=gen).to(dtype)
            sd[f"layers.{layer}.{name}"] = t
            used += t.nbytes
        layer += 1
    return sd


def lopsided(gib: float, share: float = 0.6, seed: int = 0) -> dict[str, torch.Tensor]:
    """One embedding of ``share`` of the bytes beside an LLM-like rest: the key-per-task worst case."""
    gen = torch.Generator().manual_seed(seed)
    hidden = 1024 if gib * 2**30 >= 2**28 else 64
    rows = max(2, int(gib * 2**30 * share) // (hidden * 4))
    sd = {"tok_embeddings.weight": torch.randn(rows, hidden, generator=gen)}
    rest = llm_like(gib * (1 - share), seed + 1)
    rest.pop("tok_embeddings.weight")
    return sd | rest


def many_small(count: int, seed: int = 0) -> dict[str, Any]:
    """Optimizer-like state: ``count`` small tensors (exp_avg / exp_avg_sq of 64..4096 floats)."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {}
    for i in range(count // 2):
        n = 64 * (1 + i % 64)
        state[f"{i}"] = {"exp_avg": torch.randn(n, generator=gen), "exp_avg_sq": torch.rand(n, generator=gen)}
    return {"optimizer": {"state": state, "param_groups": [{"lr": 1e-3, "params": list(range(count // 2))}]}}


def tensor_bytes(sd: Any) -> int:
    if isinstance(sd, torch.Tensor):
        return sd.nbytes
    if isinstance(sd, dict):
        return sum(tensor_bytes(v) for v in sd.values())
    if isinstance(sd, list):
        return sum(tensor_bytes(v) for v in sd)
    return 0
