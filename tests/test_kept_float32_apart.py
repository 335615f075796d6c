"""The lists of what transformers keeps in float32 are read in a child process: importing
transformers and a model class in the job's own process cost ~150 MiB for the whole job, charged
against ``--memory-limit``, and several seconds. A stand-in ``transformers`` package on the path
plays the installed library (the client suite checks the real one)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

import parallel_dcp
from parallel_dcp.errors import MemoryLimitExceeded
from parallel_dcp.jobs import built_model

ROUTER = "model.layers.0.mlp.gate.weight"
BIAS = "model.layers.0.mlp.gate.e_score_correction_bias"
PLAIN = "model.layers.0.mlp.gate_proj.weight"


def _installed(root: Path, monkeypatch: pytest.MonkeyPatch, init: str) -> None:
    """A ``transformers`` package under ``root``, found by this process and by its children."""
    (root / "transformers").mkdir(parents=True)
    (root / "transformers" / "__init__.py").write_text(init)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.delitem(sys.modules, "transformers", raising=False)
    monkeypatch.setattr(built_model, "_ANSWERS", {})


def _router_source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    st.save_file({ROUTER: torch.randn(4, 8), BIAS: torch.randn(4), PLAIN: torch.randn(8, 8)}, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"architectures": ["RouterForCausalLM"], "dtype": "float32"}))
    return src


def test_the_lists_are_read_by_a_child_and_transformers_stays_out_of_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _installed(
        tmp_path / "site",
        monkeypatch,
        "class RouterForCausalLM:\n"
        "    _keep_in_fp32_modules_strict = ['gate.weight', 'e_score_correction_bias']\n"
        "    _keep_in_fp32_modules = ['gate_proj']\n",
    )
    src = _router_source(tmp_path)
    parallel_dcp.convert(src, tmp_path / "bf16", to="safetensors", dtype="bfloat16", workers=1)
    assert "transformers" not in sys.modules
    held = {k: v.dtype for k, v in st.load_file(tmp_path / "bf16" / "model.safetensors").items()}
    assert held == {ROUTER: torch.float32, BIAS: torch.float32, PLAIN: torch.bfloat16}
    # float16 keeps the loose list too (T5's "wo"), read from the same child's answer
    parallel_dcp.convert(src, tmp_path / "fp16", to="safetensors", dtype="float16", workers=1)
    held = {k: v.dtype for k, v in st.load_file(tmp_path / "fp16" / "model.safetensors").items()}
    assert held == {ROUTER: torch.float32, BIAS: torch.float32, PLAIN: torch.float32}
    assert "transformers" not in sys.modules
    assert parallel_dcp.verify(tmp_path / "bf16", against=src, dtype="bfloat16").ok


def test_a_class_transformers_does_not_have_keeps_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _installed(tmp_path / "site", monkeypatch, "class OtherForCausalLM:\n    _keep_in_fp32_modules_strict = ['gate']\n")
    src = _router_source(tmp_path)
    parallel_dcp.convert(src, tmp_path / "out", to="safetensors", dtype="bfloat16", workers=1)
    assert {v.dtype for v in st.load_file(tmp_path / "out" / "model.safetensors").values()} == {torch.bfloat16}


def test_a_transformers_that_fails_to_import_is_named_and_everything_is_cast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _installed(tmp_path / "site", monkeypatch, "raise RuntimeError('a broken install')\n")
    src = _router_source(tmp_path)
    with pytest.warns(UserWarning, match=r"RouterForCausalLM.*a broken install.*every floating tensor is cast"):
        parallel_dcp.convert(src, tmp_path / "out", to="safetensors", dtype="bfloat16", workers=1)
    assert {v.dtype for v in st.load_file(tmp_path / "out" / "model.safetensors").values()} == {torch.bfloat16}


def test_a_transformers_found_on_sys_path_alone_is_read_by_the_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path added at run time (``sys.path.insert``), not in PYTHONPATH: the child did not see it,
    warned and cast everything."""
    _installed(
        tmp_path / "site",
        monkeypatch,
        "import sys\n"
        "sys.stdout.buffer.write(b'caf\\xe9 on stdout\\n'); sys.stdout.flush()\n"
        "sys.stderr.buffer.write(b'caf\\xe9 on stderr\\n')\n"
        "class RouterForCausalLM:\n"
        "    _keep_in_fp32_modules_strict = ['gate.weight']\n",
    )
    monkeypatch.delenv("PYTHONPATH")
    src = _router_source(tmp_path)
    parallel_dcp.convert(src, tmp_path / "out", to="safetensors", dtype="bfloat16", workers=1)
    held = {k: v.dtype for k, v in st.load_file(tmp_path / "out" / "model.safetensors").items()}
    assert held == {ROUTER: torch.float32, BIAS: torch.bfloat16, PLAIN: torch.bfloat16}


def test_a_child_that_would_pass_the_memory_limit_is_stopped_and_the_job_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child is part of the job's process tree: it grew it by ~270 MiB (the real transformers)
    under a limit of 48 MiB, counted nowhere (review s16 F4). Now it is read against the limit and
    stopped there, and the job refused before anything is written."""
    _installed(
        tmp_path / "site",
        monkeypatch,
        "import time\n"
        "_held = b'x' * (96 * 2**20)  # (touched pages: what importing transformers and torch holds)\n"
        "time.sleep(2)\n"
        "class RouterForCausalLM:\n"
        "    _keep_in_fp32_modules_strict = ['gate.weight']\n",
    )
    src = _router_source(tmp_path)
    with pytest.raises(MemoryLimitExceeded, match=r"RouterForCausalLM.*passed the memory limit.*of 48\.0 MiB") as err:
        parallel_dcp.convert(src, tmp_path / "out", to="safetensors", dtype="bfloat16", workers=1, memory_limit="48MiB")
    assert err.value.limit == 48 * 2**20 and err.value.measured > err.value.limit
    assert not (tmp_path / "out").exists()
    # under a limit that holds it, the same child is read and its list kept
    parallel_dcp.convert(src, tmp_path / "out", to="safetensors", dtype="bfloat16", workers=1, memory_limit="256MiB")
    held = {k: v.dtype for k, v in st.load_file(tmp_path / "out" / "model.safetensors").items()}
    assert held == {ROUTER: torch.float32, BIAS: torch.bfloat16, PLAIN: torch.bfloat16}


def test_without_transformers_the_cast_says_what_it_could_not_keep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where transformers is not installed (it is no dependency), ``--dtype`` of a folder whose
    config names a class casts every floating tensor, and says so, naming the class and the way to
    keep what transformers' own cast keeps; it was silent (s16 review, F11)."""
    monkeypatch.setattr(built_model.importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setattr(built_model, "_ANSWERS", {})
    src = _router_source(tmp_path)
    not_installed = r"RouterForCausalLM \(transformers is not installed: pip install transformers\)"
    with pytest.warns(UserWarning, match=not_installed):
        parallel_dcp.convert(src, tmp_path / "bf16", to="safetensors", dtype="bfloat16", workers=1)
    held = {k: v.dtype for k, v in st.load_file(tmp_path / "bf16" / "model.safetensors").items()}
    assert held == {ROUTER: torch.bfloat16, BIAS: torch.bfloat16, PLAIN: torch.bfloat16}
