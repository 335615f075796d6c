"""Presets (issue 29): torchtitan 0.3.0's Llama 3 names and shapes (pinned fixture), the q/k RoPE row
permutation (against an index-by-index reference, whole and in row ranges), composition with the other
options, and every key covered or a clear error before anything is written.

The client suite (tests_clients/torchtitan, tests_clients/hf) checks the same outputs in torchtitan
0.3.0 and transformers themselves; these tests catch a regression without them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch
import torch.distributed.checkpoint as dcp

import parallel_dcp
from parallel_dcp import PRESETS, PresetError, RenameError, RenameWarning
from parallel_dcp.cli import main
from parallel_dcp.engine.chunks import Chunk
from parallel_dcp.formats import open_source
from parallel_dcp.formats.permuted_source import RowPermutation, permute_rows, permuted_source
from parallel_dcp.storage.metadata import read_metadata
from tests.conftest import assert_same, finished_task_records
from tests.test_convert import write_hf_safetensors

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "clients" / "torchtitan_llama3_keys.json").read_text())
CONFIG = FIXTURE["config"]  # the tiny model's Hugging Face config.json
TO_TITAN, TO_HF = "hf-llama3-to-torchtitan", "torchtitan-to-hf-llama3"


def hf_llama(config: dict = CONFIG, seed: int = 0) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama's tensors for ``config``, random."""
    g = torch.Generator().manual_seed(seed)
    dim, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, dim)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_rows, dim),
            p + "self_attn.k_proj.weight": (kv_rows, dim),
            p + "self_attn.v_proj.weight": (kv_rows, dim),
            p + "self_attn.o_proj.weight": (dim, q_rows),
            p + "mlp.gate_proj.weight": (inter, dim),
            p + "mlp.up_proj.weight": (inter, dim),
            p + "mlp.down_proj.weight": (dim, inter),
            p + "input_layernorm.weight": (dim,),
            p + "post_attention_layernorm.weight": (dim,),
        }
    shapes |= {"model.norm.weight": (dim,), "lm_head.weight": (vocab, dim)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def hf_folder(path: Path, tensors: dict[str, torch.Tensor] | None = None, config: dict = CONFIG) -> dict:
    tensors = hf_llama(config) if tensors is None else tensors
    write_hf_safetensors(tensors, path, shards=2)
    (path / "config.json").write_text(json.dumps(config))
    return tensors


def interleave_reference(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF halves -> interleaved pairs, row by row: row 2i of a head is its row i, row 2i+1 its row D/2+i."""
    out = torch.empty_like(rows)
    half = head_dim // 2
    for head in range(rows.shape[0] // head_dim):
        base = head * head_dim
        for i in range(half):
            out[base + 2 * i] = rows[base + i]
            out[base + 2 * i + 1] = rows[base + half + i]
    return out


def titan_expected(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What torchtitan 0.3.0 holds for ``hf``: its names, q/k rows interleaved per head."""
    out = {"tok_embeddings.weight": hf["model.embed_tokens.weight"]}
    names = {
        "self_attn.q_proj.weight": "attention.qkv_linear.wq.weight",
        "self_attn.k_proj.weight": "attention.qkv_linear.wk.weight",
        "self_attn.v_proj.weight": "attention.qkv_linear.wv.weight",
        "self_attn.o_proj.weight": "attention.wo.weight",
        "mlp.gate_proj.weight": "feed_forward.w1.weight",
        "mlp.down_proj.weight": "feed_forward.w2.weight",
        "mlp.up_proj.weight": "feed_forward.w3.weight",
        "input_layernorm.weight": "attention_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
    }
    for i in range(CONFIG["num_hidden_layers"]):
        for hf_name, tt_name in names.items():
            tensor = hf[f"model.layers.{i}.{hf_name}"]
            if "q_proj" in hf_name or "k_proj" in hf_name:
                tensor = interleave_reference(tensor, CONFIG["head_dim"])
            out[f"layers.{i}.{tt_name}"] = tensor
    out |= {"norm.weight": hf["model.norm.weight"], "lm_head.weight": hf["lm_head.weight"]}
    return out


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out |= st.load_file(file)
    return out


def dcp_tensors(path: Path) -> dict[str, torch.Tensor]:
    metadata = read_metadata(path)
    target = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()}
    dcp.load(target, checkpoint_id=str(path), no_dist=True)
    return target


def test_output_names_and_shapes_equal_torchtitans(tmp_path: Path) -> None:
    """The pinned fixture: what torchtitan 0.3.0's Llama 3 holds for the tiny config (names, order, shapes)."""
    hf_folder(tmp_path / "hf")
    parallel_dcp.convert(tmp_path / "hf", tmp_path / "titan", preset=TO_TITAN, workers=1)
    metadata = read_metadata(tmp_path / "titan").state_dict_metadata
    assert sorted([k, list(m.size)] for k, m in metadata.items()) == sorted(FIXTURE["keys"])
    assert PRESETS[TO_TITAN].expected_keys(CONFIG["num_hidden_layers"]) == [k for k, _ in FIXTURE["keys"]]


@pytest.mark.parametrize("chunk_size", [None, "4KB", "6KB"], ids=["whole", "head-ranges", "uneven-ranges"])
def test_q_k_rows_permuted_per_head_and_back_bit_for_bit(tmp_path: Path, chunk_size: str | None) -> None:
    hf = hf_folder(tmp_path / "hf")
    parallel_dcp.convert(tmp_path / "hf", tmp_path / "titan", preset=TO_TITAN, workers=2, chunk_size=chunk_size)
    assert_same(dcp_tensors(tmp_path / "titan"), titan_expected(hf))
    chunks = read_metadata(tmp_path / "titan").state_dict_metadata["layers.0.attention.qkv_linear.wq.weight"].chunks
    if chunk_size is not None:  # row ranges, each starting on a head boundary (head_dim 16 rows)
        assert len(chunks) > 1 and all(c.offsets[0] % CONFIG["head_dim"] == 0 for c in chunks)
    parallel_dcp.convert(
        tmp_path / "titan",
        tmp_path / "back",
        to="safetensors",
        preset=TO_HF,
        model_config=tmp_path / "hf" / "config.json",
        workers=2,
        chunk_size=chunk_size,
    )
    assert_same(hf_tensors(tmp_path / "back"), hf)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == CONFIG


def test_an_unaligned_row_range_is_widened_to_whole_heads(tmp_path: Path) -> None:
    """A row range that does not start on a head (a plan made without the alignment) is still right."""
    q = torch.randn(64, 8)
    st.save_file({"q": q}, tmp_path / "m.safetensors")
    source = open_source(tmp_path / "m.safetensors")
    view = permuted_source(source, {"q": RowPermutation(4, 16, True)})
    whole = interleave_reference(q, 16)
    assert view.split_alignment("q", 0) == 16 and view.split_alignment("q", 1) == 1
    for start, stop, dim in [(5, 37, 0), (16, 48, 0), (60, 64, 0), (0, 3, 1)]:
        chunk = Chunk("q", dim, start, stop, (64, 8))
        assert_same(view.read_chunk(chunk), whole.narrow(dim, start, stop - start))
        # the permuted copy (of the widened range) is counted before it exists
        assert view.chunk_memory(chunk) > source.chunk_memory(chunk)
    assert view.copied_bytes("q") == source.copied_bytes("q") + q.nbytes
    assert_same(permute_rows(permute_rows(q, 16, True), 16, False), q)
    source.close()


def test_grouped_query_attention_and_head_dim_from_hidden_size(tmp_path: Path) -> None:
    """k has num_key_value_heads heads; without head_dim, it is hidden_size / num_attention_heads."""
    config = {k: v for k, v in CONFIG.items() if k != "head_dim"} | {"num_key_value_heads": 1}
    hf = hf_llama(config | {"head_dim": 16})
    hf_folder(tmp_path / "hf", hf, config)
    parallel_dcp.convert(tmp_path / "hf", tmp_path / "titan", preset=TO_TITAN, workers=1)
    out = dcp_tensors(tmp_path / "titan")
    assert out["layers.1.attention.qkv_linear.wk.weight"].shape == (16, 64)
    assert_same(
        out["layers.1.attention.qkv_linear.wk.weight"],
        interleave_reference(hf["model.layers.1.self_attn.k_proj.weight"], 16),
    )


@pytest.mark.parametrize("dst", ["out.safetensors", "out.pt", "dcp"])
def test_composes_with_dtype_keys_rename_and_every_format(tmp_path: Path, dst: str) -> None:
    hf = hf_folder(tmp_path / "hf")
    parallel_dcp.convert(
        tmp_path / "hf",
        tmp_path / dst,
        preset=TO_TITAN,
        dtype="bfloat16",
        keys="model.layers.0.*",  # a part of the model: the whole-model check is off
        rename=[(r"layers\.0\.(.*)", r"model.layers.0.\1")],  # after the preset's rules, on its names
        workers=1,
    )
    if dst == "dcp":
        out = dcp_tensors(tmp_path / dst)
    elif dst.endswith(".pt"):
        out = torch.load(tmp_path / dst, weights_only=True)
    else:
        out = st.load_file(tmp_path / dst)
    expected = {"model." + k: v.to(torch.bfloat16) for k, v in titan_expected(hf).items() if k.startswith("layers.0.")}
    assert_same(out, expected)


def test_dry_run_writes_nothing_and_names_the_preset(tmp_path: Path) -> None:
    hf_folder(tmp_path / "hf")
    plan = parallel_dcp.convert(tmp_path / "hf", tmp_path / "titan", preset=TO_TITAN, dry_run=True, workers=1)
    assert not (tmp_path / "titan").exists()
    assert any("hf-llama3-to-torchtitan" in note and "torchtitan 0.3.0" in note for note in plan.notes)
    assert any("rows permuted per head" in note for note in plan.notes)


def test_resume_continues_a_preset_conversion_and_refuses_a_changed_one(tmp_path: Path) -> None:
    hf = hf_folder(tmp_path / "hf")
    result = parallel_dcp.convert(tmp_path / "hf", tmp_path / "titan", preset=TO_TITAN, workers=1, resume=True)
    assert isinstance(result, parallel_dcp.SaveResult)
    assert_same(dcp_tensors(tmp_path / "titan"), titan_expected(hf))
    # the permutation is part of what the output is made of (the source's fingerprint)
    source = open_source(tmp_path / "hf")
    q = "model.layers.0.self_attn.q_proj.weight"
    view = permuted_source(source, {q: RowPermutation(4, 16, True)})
    assert view.fingerprint() != source.fingerprint()
    source.close()


def test_inv_freq_buffers_are_dropped_and_a_key_without_a_rule_is_refused(tmp_path: Path) -> None:
    hf = hf_llama()
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    hf_folder(tmp_path / "ok", hf)
    parallel_dcp.convert(tmp_path / "ok", tmp_path / "titan", preset=TO_TITAN, workers=1)
    assert sorted(read_metadata(tmp_path / "titan").state_dict_metadata) == sorted(k for k, _ in FIXTURE["keys"])

    hf = hf_llama()
    for i in range(12):
        hf[f"model.layers.0.self_attn.extra{i:02d}.bias"] = torch.ones(4)
    hf_folder(tmp_path / "bad", hf)
    with pytest.raises(PresetError) as info:
        parallel_dcp.convert(tmp_path / "bad", tmp_path / "out", preset=TO_TITAN, workers=1)
    message = str(info.value)
    assert "12 keys" in message and "nothing was written" in message
    assert 1 <= message.count(".bias'") <= 10 and "more" in message  # a long list is cut, with its count
    assert len(info.value.keys) == 12
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("no-config", "none was found"),
        ("no-heads", "num_attention_heads"),
        ("wrong-heads", "do not have the rows"),
        ("no-head", "misses 1 key"),
        ("a-layer-missing", "misses 9 keys"),
    ],
)
def test_bad_configs_and_incomplete_models_fail_before_writing(tmp_path: Path, change: str, message: str) -> None:
    hf, config = hf_llama(), dict(CONFIG)
    if change == "no-heads":
        del config["num_attention_heads"]
    if change == "wrong-heads":
        config["num_attention_heads"] = 3
    if change == "no-head":  # untied, so the model holds a head of its own
        del hf["lm_head.weight"]
    if change == "a-layer-missing":
        config["num_hidden_layers"] = 3
    hf_folder(tmp_path / "hf", hf, config)
    if change == "no-config":
        (tmp_path / "hf" / "config.json").unlink()
    with pytest.raises(PresetError, match=message):
        parallel_dcp.convert(tmp_path / "hf", tmp_path / "out", preset=TO_TITAN, workers=1)
    assert not (tmp_path / "out").exists()


def test_tied_embeddings_give_torchtitan_its_head_and_hf_none(tmp_path: Path) -> None:
    """tie_word_embeddings (Llama 3.2 1B/3B): torchtitan's tied model holds lm_head.weight (its from_hf
    copies the embedding), a tied Hugging Face model holds none (its to_hf drops it)."""
    config = CONFIG | {"tie_word_embeddings": True}
    hf = hf_llama(config)
    del hf["lm_head.weight"]
    hf_folder(tmp_path / "hf", hf, config)
    parallel_dcp.convert(tmp_path / "hf", tmp_path / "titan", preset=TO_TITAN, workers=1)
    expected = titan_expected(hf | {"lm_head.weight": hf["model.embed_tokens.weight"]})
    assert_same(dcp_tensors(tmp_path / "titan"), expected)
    parallel_dcp.convert(
        tmp_path / "titan", tmp_path / "back", to="safetensors", preset=TO_HF, copy_files_from=tmp_path / "hf"
    )
    assert_same(hf_tensors(tmp_path / "back"), hf)


def test_reverse_preset_finds_its_config_beside_the_source_or_in_copy_files_from(tmp_path: Path) -> None:
    hf = hf_folder(tmp_path / "hf")
    parallel_dcp.convert(tmp_path / "hf", tmp_path / "titan", preset=TO_TITAN, workers=1)
    with pytest.raises(PresetError, match="model_config"):
        parallel_dcp.convert(tmp_path / "titan", tmp_path / "back", to="safetensors", preset=TO_HF, workers=1)
    assert not (tmp_path / "back").exists()
    parallel_dcp.convert(
        tmp_path / "titan", tmp_path / "back", to="safetensors", preset=TO_HF, copy_files_from=tmp_path / "hf"
    )
    assert_same(hf_tensors(tmp_path / "back"), hf)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == CONFIG


def test_unknown_preset_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(PresetError, match="hf-llama3-to-torchtitan"):
        parallel_dcp.convert(tmp_path / "nothing", tmp_path / "out", preset="hf-llama2")


def test_rename_strict_refuses_unmatched_keys_and_the_warning_names_them(tmp_path: Path) -> None:
    sd = {f"a.{i:02d}": torch.ones(2) for i in range(12)} | {"b.weight": torch.zeros(3)}
    st.save_file(sd, tmp_path / "m.safetensors")
    rules = [(r"b\.(.*)", r"c.\1")]
    with pytest.raises(RenameError) as info:
        parallel_dcp.convert(tmp_path / "m.safetensors", tmp_path / "o.safetensors", rename=rules, rename_strict=True)
    assert "12 keys" in str(info.value) and "'a.00'" in str(info.value) and "'a.11'" not in str(info.value)
    assert not (tmp_path / "o.safetensors").exists()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallel_dcp.convert(tmp_path / "m.safetensors", tmp_path / "o.safetensors", rename=rules)
    texts = [str(w.message) for w in caught if issubclass(w.category, RenameWarning)]
    assert any("12 keys" in t and "matched no rename rule" in t and "'a.00'" in t for t in texts), texts
    assert set(st.load_file(tmp_path / "o.safetensors")) == {f"a.{i:02d}" for i in range(12)} | {"c.weight"}


def test_user_rules_after_a_preset_can_be_strict(tmp_path: Path) -> None:
    hf_folder(tmp_path / "hf")
    with pytest.raises(RenameError, match="rename_strict"):
        parallel_dcp.convert(
            tmp_path / "hf",
            tmp_path / "out",
            preset=TO_TITAN,
            rename=[(r"layers\.(.*)", r"blocks.\1")],  # tok_embeddings, norm, lm_head match none
            rename_strict=True,
        )
    assert not (tmp_path / "out").exists()


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """A command run in this process, as ``python -m parallel_dcp`` runs it (``sys.exit(main())``,
    a usage error's SystemExit included): its exit code, stdout and stderr. These tests check the
    commands' output; tests/test_cli.py and test_cli_startup.py run the program itself."""

    def run(*args: str | Path) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            code = main([str(a) for a in args])
        except SystemExit as exited:
            code = 0 if exited.code is None else exited.code if isinstance(exited.code, int) else 1
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_cli_presets_lists_each_with_client_and_version(run_cli: Callable[..., tuple[int, str, str]]) -> None:
    code, out, err = run_cli("presets")
    assert code == 0, err
    assert "hf-llama3-to-torchtitan  (torchtitan 0.3.0)" in out
    assert "torchtitan-to-hf-llama3" in out
    listed = json.loads(run_cli("presets", "--json")[1])
    assert {p["name"]: p["client_version"] for p in listed}[TO_TITAN] == "0.3.0"
    assert [p.name for p in parallel_dcp.presets()] == sorted(PRESETS)


def test_cli_convert_with_a_preset_and_its_errors(tmp_path: Path, run_cli: Callable[..., tuple[int, str, str]]) -> None:
    hf = hf_folder(tmp_path / "hf")
    code, _, err = run_cli("convert", tmp_path / "hf", tmp_path / "titan", "--preset", TO_TITAN, "--workers", "1", "-q")
    assert code == 0, err
    assert_same(dcp_tensors(tmp_path / "titan"), titan_expected(hf))
    code, _, err = run_cli("convert", tmp_path / "titan", tmp_path / "back", "--to", "safetensors", "--preset", TO_HF)
    assert code == 1 and "--model-config" in err and not (tmp_path / "back").exists()
    code, out, err = run_cli(
        "convert", tmp_path / "titan", tmp_path / "back", "--to", "safetensors", "--preset", TO_HF, "--config",
        tmp_path / "hf", "--dry-run",
    )  # fmt: skip
    assert code == 0 and "torchtitan-to-hf-llama3" in out, err
    code, _, err = run_cli("convert", tmp_path / "hf", tmp_path / "x", "--rename", "a=b", "--rename-strict", "-q")
    assert code == 1 and "rename_strict" in err and not (tmp_path / "x").exists()


@pytest.mark.slow
def test_distributed_conversion_with_a_preset(tmp_path: Path) -> None:
    hf = hf_folder(tmp_path / "hf")
    run = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc_per_node=2",
            "-m", "parallel_dcp", "convert", str(tmp_path / "hf"), str(tmp_path / "titan"), "--preset", TO_TITAN,
            "--distributed", "--workers", "1", "--chunk-size", "4KB", "-q",
        ],
        capture_output=True, text=True, timeout=240, cwd=ROOT, check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert_same(dcp_tensors(tmp_path / "titan"), titan_expected(hf))


def test_dequantize_then_preset_splits_on_whole_heads_and_whole_blocks(tmp_path: Path) -> None:
    """An FP8 Llama: dequantized, then permuted; row ranges fall on multiples of lcm(head_dim 16, block 32)."""
    from parallel_dcp.formats.quantized import quantize_fp8

    tensors = hf_llama()
    for name in [k for k in tensors if k.endswith(("q_proj.weight", "k_proj.weight"))]:
        tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(tensors[name], (32, 32))
    config = CONFIG | {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32]}}
    write_hf_safetensors(tensors, tmp_path / "fp8", shards=2)
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    parallel_dcp.convert(tmp_path / "fp8", tmp_path / "bf16.safetensors", dequantize=True, workers=1)
    dequantized = st.load_file(tmp_path / "bf16.safetensors")
    parallel_dcp.convert(
        tmp_path / "fp8", tmp_path / "titan", preset=TO_TITAN, dequantize=True, workers=2, chunk_size="2KB"
    )
    assert_same(dcp_tensors(tmp_path / "titan"), titan_expected(dequantized))
    chunks = read_metadata(tmp_path / "titan").state_dict_metadata["layers.0.attention.qkv_linear.wq.weight"].chunks
    assert len(chunks) > 1 and all(c.offsets[0] % 32 == 0 for c in chunks)


def test_a_failed_preset_conversion_resumes_only_with_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Task 0 finishes, the others fail (as out of space would): resume keeps task 0's files, redoes the
    rest, and the output equals a fresh one; resuming it without the preset is refused."""
    import time

    from parallel_dcp import ResumeError, WorkerError
    from parallel_dcp.jobs import targets

    hf = hf_folder(tmp_path / "hf")
    out = tmp_path / "titan"
    original = targets.DcpTarget.write

    def write(self: object, job: object, task: Any, data: object, staging: object, options: object) -> object:
        if task.index >= 1:
            deadline = time.monotonic() + 60
            while not finished_task_records(out):  # task 0 sealed its record: a kill now keeps it
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            raise OSError(28, "No space left on device (injected)")
        return original(self, job, task, data, staging, options)  # type: ignore[arg-type]

    monkeypatch.setattr(targets.DcpTarget, "write", write)
    with pytest.raises(WorkerError, match="No space left"):
        parallel_dcp.convert(tmp_path / "hf", out, preset=TO_TITAN, workers=2, chunk_size="4KB")
    monkeypatch.undo()
    with pytest.raises(ResumeError):
        parallel_dcp.convert(tmp_path / "hf", out, workers=2, chunk_size="4KB", resume=True)
    result = parallel_dcp.convert(tmp_path / "hf", out, preset=TO_TITAN, workers=2, chunk_size="4KB", resume=True)
    assert isinstance(result, parallel_dcp.SaveResult) and result.resumed and 0 < result.bytes_kept < result.bytes
    assert_same(dcp_tensors(out), titan_expected(hf))
