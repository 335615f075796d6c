"""Dequantize FP8 block-scaled and MXFP4 checkpoints, and quantize to FP8 blocks, checked bit for
bit against stock ``QuantizedHuggingFaceStorageReader`` (see tests/quantized_checkpoints.py)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

import parallel_dcp
from parallel_dcp.errors import QuantizationError
from parallel_dcp.formats.quantized import dequantize_fp8, quantize_fp8
from tests.conftest import assert_same
from tests.quantized_checkpoints import (
    FP8_WEIGHTS,
    deepseek_config,
    fp8_checkpoint,
    fp8_weights,
    gpt_oss_fixture,
    gpt_oss_mxfp4_checkpoint,
    mxfp4_checkpoint,
    plain_tensors,
    stock_dequantized,
    transformers_layout,
    write_hf,
)


def load_dcp(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keys of ``like``, read by stock ``dcp.load`` into tensors of the stored dtypes and shapes."""
    stored = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(stored[k].size, dtype=stored[k].properties.dtype) for k in like}  # type: ignore[union-attr]
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def load_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out |= load_file(str(path / name))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_directory_to_dcp_equals_stock(tmp_path: Path, dtype: torch.dtype) -> None:
    src = fp8_checkpoint(tmp_path / "fp8")
    expected = stock_dequantized(src, dtype)
    result = parallel_dcp.convert(src, tmp_path / "out", dequantize=True, dtype=dtype, workers=2)
    assert isinstance(result, parallel_dcp.SaveResult)
    assert result.keys == len(expected)  # the scales are gone
    # --dtype also casts the other floats, as a conversion always does
    assert_same(load_dcp(tmp_path / "out", expected), {k: v.to(dtype) for k, v in expected.items()})


def test_default_dtype_is_bfloat16_and_other_tensors_keep_theirs(tmp_path: Path) -> None:
    src = fp8_checkpoint(tmp_path / "fp8")
    expected = stock_dequantized(src, torch.bfloat16)
    parallel_dcp.convert(src, tmp_path / "out", dequantize=True, workers=1)
    got = load_dcp(tmp_path / "out", expected)
    assert got["model.norm.weight"].dtype == torch.float32  # as stored
    assert_same(got, expected)


def test_every_output_format(tmp_path: Path) -> None:
    src = fp8_checkpoint(tmp_path / "fp8")
    expected = stock_dequantized(src, torch.bfloat16)
    parallel_dcp.convert(src, tmp_path / "hf", dequantize=True, to="safetensors", shard_size="200KB", workers=2)
    assert_same(load_safetensors_dir(tmp_path / "hf"), expected)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == config["torch_dtype"] == "bfloat16"
    parallel_dcp.convert(src, tmp_path / "one.safetensors", dequantize=True, workers=1)
    assert_same(load_file(str(tmp_path / "one.safetensors")), expected)
    parallel_dcp.convert(src, tmp_path / "model.pt", dequantize=True, workers=1)
    assert_same(torch.load(tmp_path / "model.pt", weights_only=True), expected)


def test_dcp_source_holding_fp8_pairs(tmp_path: Path) -> None:
    src = fp8_checkpoint(tmp_path / "fp8")
    parallel_dcp.convert(src, tmp_path / "fp8-dcp", workers=1)  # FP8 and scales as they are
    parallel_dcp.convert(tmp_path / "fp8-dcp", tmp_path / "out", dequantize=True, workers=2)
    expected = stock_dequantized(src, torch.bfloat16)
    assert_same(load_dcp(tmp_path / "out", expected), expected)


def test_huge_weights_split_in_block_aligned_row_ranges(tmp_path: Path) -> None:
    names = {"a.weight": (700, 300), "b.weight": (1000, 260)}
    tensors = {}
    for name, (rows, cols) in names.items():
        tensors[name] = (torch.randn(rows, cols) * 50).to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = torch.rand(math.ceil(rows / 128), math.ceil(cols / 128))
    src = write_hf(tmp_path / "src", tensors, [["a.weight", "b.weight_scale_inv"], ["b.weight", "a.weight_scale_inv"]])
    expected = stock_dequantized(src, torch.bfloat16)
    parallel_dcp.convert(src, tmp_path / "out", dequantize=True, chunk_size=100_000, workers=2)
    metadata = FileSystemReader(str(tmp_path / "out")).read_metadata()
    for name, (rows, _) in names.items():
        chunks = metadata.state_dict_metadata[name].chunks  # type: ignore[union-attr]
        assert len(chunks) > 1
        assert all(c.offsets[0] % 128 == 0 for c in chunks)
        assert sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in chunks)[-1][1] == rows
    assert_same(load_dcp(tmp_path / "out", expected), expected)


def test_block_size_from_config_json(tmp_path: Path) -> None:
    tensors = {"x.weight": (torch.randn(100, 70) * 30).to(torch.float8_e4m3fn), "x.weight_scale_inv": torch.rand(2, 2)}
    src = write_hf(tmp_path / "src", tensors, [["x.weight"], ["x.weight_scale_inv"]], deepseek_config(block=64))
    expected = stock_dequantized(src, torch.bfloat16, block=64)
    parallel_dcp.convert(src, tmp_path / "out", dequantize=True, workers=1)
    assert_same(load_dcp(tmp_path / "out", expected), expected)
    with pytest.raises(QuantizationError, match="does not match the 128x128 blocks"):
        parallel_dcp.convert(src, tmp_path / "bad", dequantize=True, block_size=128)


def test_unaligned_pieces_dequantize_as_the_whole() -> None:
    weights = fp8_weights()
    name = "model.layers.0.mlp.down_proj.weight"
    weight, scale = weights[name], weights[name + "_scale_inv"]
    whole = dequantize_fp8(weight, scale, torch.bfloat16)
    piece = dequantize_fp8(weight[5:131, 129:300], scale, torch.bfloat16, row0=5, col0=129)
    assert_same(piece, whole[5:131, 129:300].contiguous())


def test_mxfp4_equals_stock_unpacking_in_transformers_layout(tmp_path: Path) -> None:
    src = mxfp4_checkpoint(tmp_path / "mx")
    stock = stock_dequantized(src, torch.bfloat16)
    assert stock["model.layers.0.mlp.experts.gate_up_proj"].shape == (3, 10, 5 * 32)  # [E, N, G * 32]
    expected = transformers_layout(stock, src)
    assert expected["model.layers.0.mlp.experts.gate_up_proj"].shape == (3, 5 * 32, 10)  # [E, G * 32, N]
    parallel_dcp.convert(src, tmp_path / "out", dequantize=True, workers=2)
    assert_same(load_dcp(tmp_path / "out", expected), expected)
    parallel_dcp.convert(src, tmp_path / "hf", dequantize=True, dtype="float32", to="safetensors", workers=1)
    assert_same(
        load_safetensors_dir(tmp_path / "hf"),
        {k: v.to(torch.float32) for k, v in transformers_layout(stock_dequantized(src, torch.float32), src).items()},
    )
    assert parallel_dcp.verify(str(tmp_path / "out"), against=str(src), dequantize=True).ok


@pytest.mark.parametrize("to", ["dcp", "safetensors", "safetensors-file", "torch"])
def test_gpt_oss_dequantizes_to_the_names_and_shapes_transformers_holds(tmp_path: Path, to: str) -> None:
    """tests/fixtures/clients/gpt_oss_keys.json: what transformers 5.25's GptOssForCausalLM holds for
    a tiny config with hidden = intermediate (down_proj square, as in the releases)."""
    fixture = gpt_oss_fixture()
    held = {k: (tuple(v["shape"]), v["dtype"]) for k, v in fixture["tensors"].items()}
    g = torch.Generator().manual_seed(4)
    experts = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
    plain = {
        k: torch.randn(shape, generator=g).to(torch.bfloat16)
        for k, (shape, _) in held.items()
        if not k.endswith(experts)
    }
    src = gpt_oss_mxfp4_checkpoint(tmp_path / "mx", fixture["config"], plain)
    kind, dst = {
        "safetensors-file": ("safetensors", tmp_path / "out.safetensors"),
        "torch": ("torch", tmp_path / "out.pt"),
    }.get(to, (to, tmp_path / "out"))
    parallel_dcp.convert(src, dst, dequantize=True, to=kind, workers=2)
    assert _listed(dst) == held


def _listed(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype) of every tensor in a checkpoint of any format, from its headers."""
    from parallel_dcp.formats import open_source

    source = open_source(str(path))
    try:
        return {k: (tuple(e.shape), str(e.dtype).removeprefix("torch.")) for k, e in source.entries.items()}
    finally:
        source.close()


def test_stock_reader_misplans_mxfp4_chunks(tmp_path: Path) -> None:
    """Why the reference corrects the chunk metadata (torch 2.13): stock keeps the packed chunk
    shape, so a plain dcp.load fills only the first G values of each row (or fails)."""
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    src = mxfp4_checkpoint(tmp_path / "mx")
    expected = stock_dequantized(src, torch.bfloat16)
    key = "model.layers.0.mlp.experts.down_proj"
    state = {key + "_blocks": torch.zeros(expected[key].shape, dtype=torch.bfloat16)}
    try:
        dcp.load(state, storage_reader=QuantizedHuggingFaceStorageReader(str(src), torch.bfloat16), no_dist=True)
    except BaseException:
        return
    assert not torch.equal(state[key + "_blocks"], expected[key])


PROJ = ["*_proj.weight"]  # every weight of FP8_WEIGHTS, by name (none is whole 128 x 128 blocks)


def quantize_source(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    tensors = {name: torch.randn(*shape, generator=g).to(torch.bfloat16) for name, shape in FP8_WEIGHTS.items()}
    tensors["model.layers.0.self_attn.q_proj.weight"][:128, :128] = 0  # an all-zero block
    tensors |= plain_tensors()
    config = {"architectures": ["X"], "torch_dtype": "bfloat16"}
    return write_hf(tmp_path / "bf16", tensors, [list(tensors)], config), tensors


def test_quantize_deepseek_layout_read_by_stock(tmp_path: Path) -> None:
    src, tensors = quantize_source(tmp_path)
    # partial edge blocks (the DeepSeek layout, which stock reads): only where asked for by name
    with pytest.warns(UserWarning, match="quantized with partial edge blocks"):
        parallel_dcp.convert(src, tmp_path / "q", quantize="fp8-block", to="safetensors", workers=2, quantize_keys=PROJ)
    names = sorted(os.listdir(tmp_path / "q"))
    assert "model.safetensors.index.json" in names and "model.safetensors" in names  # an index with one shard
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.embed_tokens", "model.layers.1.mlp.gate"],
    }
    out = load_safetensors_dir(tmp_path / "q")
    for name, (rows, cols) in FP8_WEIGHTS.items():
        assert out[name].dtype == torch.float8_e4m3fn
        assert out[name + "_scale_inv"].dtype == torch.float32
        assert out[name + "_scale_inv"].shape == (math.ceil(rows / 128), math.ceil(cols / 128))
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight"):
        assert out[name].dtype == torch.bfloat16 and name + "_scale_inv" not in out  # the default rule
    assert out["model.layers.0.self_attn.q_proj.weight_scale_inv"][0, 0] == 1.0  # the zero block
    # stock reads it, and equals our dequantization bit for bit
    stock = stock_dequantized(tmp_path / "q", torch.float32)
    parallel_dcp.convert(tmp_path / "q", tmp_path / "back", dequantize=True, dtype="float32", workers=1)
    assert_same(load_dcp(tmp_path / "back", stock), {k: v.to(torch.float32) for k, v in stock.items()})
    for name in FP8_WEIGHTS:  # within e4m3's rounding of w, per block
        w = tensors[name].to(torch.float32)
        scale = out[name + "_scale_inv"].repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)
        bound = torch.maximum(w.abs() * 2**-4, scale[:, : w.shape[1]] * 2**-10) * (1 + 1e-6)
        assert bool(((stock[name] - w).abs() <= bound).all()), name


def test_quantize_bound_on_extreme_blocks() -> None:
    w = torch.randn(300, 200) * torch.logspace(-8, 8, 300).unsqueeze(1)
    values, scales = quantize_fp8(w, (64, 64))
    back = dequantize_fp8(values, scales, torch.float32, (64, 64))
    per = scales.repeat_interleave(64, 0)[:300].repeat_interleave(64, 1)[:, :200]
    assert bool(((back - w).abs() <= torch.maximum(w.abs() * 2**-4, per * 2**-10) * (1 + 1e-6)).all())
    assert bool((values.to(torch.float32).abs() <= 448).all())


def test_quantize_keys_block_and_split_pieces(tmp_path: Path) -> None:
    src, _ = quantize_source(tmp_path)
    pattern = "*.q_proj.weight"
    parallel_dcp.convert(
        src, tmp_path / "q", quantize="fp8-block:64", quantize_keys=pattern, chunk_size=20_000, workers=2
    )
    parallel_dcp.convert(src, tmp_path / "whole", quantize="fp8-block:64", quantize_keys=pattern, workers=1)
    whole = parallel_dcp.load(str(tmp_path / "whole"))
    assert {k for k in whole if k.endswith("_scale_inv")} == {
        "model.layers.0.self_attn.q_proj.weight_scale_inv",
        "model.layers.1.self_attn.q_proj.weight_scale_inv",
    }
    assert whole["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (4, 3)
    assert_same(parallel_dcp.load(str(tmp_path / "q")), whole)  # block-aligned pieces quantize as the whole


def test_dry_run_shows_the_default_rule(tmp_path: Path) -> None:
    src, _ = quantize_source(tmp_path)
    plan = parallel_dcp.convert(src, tmp_path / "q", quantize="fp8-block:1", dry_run=True)  # (a block that divides)
    assert isinstance(plan, parallel_dcp.DryRunPlan)
    assert any("except embeddings" in note for note in plan.notes)
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in str(plan.files)
    assert not (tmp_path / "q").exists()


def fp8_variant(tmp_path: Path, change: str) -> Path:
    tensors = fp8_weights()
    name = "model.layers.0.mlp.down_proj.weight"
    if change == "weight without scale":
        del tensors[name + "_scale_inv"]
    elif change == "scale without weight":
        del tensors[name]
    elif change == "scale shape":
        tensors[name + "_scale_inv"] = torch.ones(2, 2)
    elif change == "non-FP8 weight":
        tensors[name] = tensors[name].to(torch.bfloat16)
    return write_hf(tmp_path / change.replace(" ", "-"), tensors, [list(tensors)])


@pytest.mark.parametrize(
    ("change", "named", "says"),
    [
        ("weight without scale", "model.layers.0.mlp.down_proj.weight", "without its scale"),
        ("scale without weight", "model.layers.0.mlp.down_proj.weight_scale_inv", "without its weight"),
        ("scale shape", "model.layers.0.mlp.down_proj.weight_scale_inv", "does not match"),
        ("non-FP8 weight", "model.layers.0.mlp.down_proj.weight", "not FP8"),
    ],
)
def test_fp8_errors_before_anything_is_written(tmp_path: Path, change: str, named: str, says: str) -> None:
    src = fp8_variant(tmp_path, change)
    with pytest.raises(QuantizationError, match=says) as info:
        parallel_dcp.convert(src, tmp_path / "out", dequantize=True)
    assert named in str(info.value) and info.value.keys == [named]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change", ["nan exponent", "blocks without scales", "scales shape"])
def test_mxfp4_errors_before_anything_is_written(tmp_path: Path, change: str) -> None:
    src = mxfp4_checkpoint(tmp_path / "mx")
    tensors = load_safetensors_dir(src)
    key = "model.layers.0.mlp.experts.down_proj"
    if change == "nan exponent":
        tensors[key + "_scales"][1, 2, 0] = 255
    elif change == "blocks without scales":
        del tensors[key + "_scales"]
    else:
        tensors[key + "_scales"] = tensors[key + "_scales"][:, :, :2].contiguous()
    bad = write_hf(tmp_path / "bad", tensors, [list(tensors)])
    with pytest.raises(QuantizationError, match=key):
        parallel_dcp.convert(bad, tmp_path / "out", dequantize=True, workers=1)
    assert not (tmp_path / "out").exists()


def test_bad_arguments() -> None:
    with pytest.raises(QuantizationError, match="exclude"):
        parallel_dcp.convert("a", "b", dequantize=True, quantize="fp8-block")
    with pytest.raises(QuantizationError, match="unknown quantization"):
        parallel_dcp.convert("a", "b", quantize="int4")
    with pytest.raises(QuantizationError, match="bfloat16, float16 or float32"):
        parallel_dcp.convert("a", "b", dequantize=True, dtype="float64")


def test_keys_rename_verify_and_compress_compose(tmp_path: Path) -> None:
    src = fp8_checkpoint(tmp_path / "fp8")
    expected = stock_dequantized(src, torch.bfloat16)
    parallel_dcp.convert(
        src,
        tmp_path / "out",
        dequantize=True,
        keys="model.layers.0.*",
        rename=[(r"model\.(.*)", r"m.\1")],
        workers=2,
    )
    got = parallel_dcp.load(str(tmp_path / "out"))
    wanted = {"m." + k.removeprefix("model."): v for k, v in expected.items() if k.startswith("model.layers.0.")}
    assert_same(got, wanted)
    parallel_dcp.convert(src, tmp_path / "full", dequantize=True, workers=2)
    assert parallel_dcp.verify(str(tmp_path / "full"), against=str(src), dequantize=True).ok
    plain = parallel_dcp.verify(str(tmp_path / "full"), against=str(src))
    assert not plain.ok  # without dequantize the FP8 weights and scales differ
    pytest.importorskip("zstandard")
    parallel_dcp.convert(src, tmp_path / "z", dequantize=True, compress="zstd", workers=1)
    assert_same(load_dcp(tmp_path / "z", expected), expected)


def test_resume_refuses_another_dtype(tmp_path: Path) -> None:
    from parallel_dcp.formats import open_source
    from parallel_dcp.formats.dequantized_source import dequantized_source
    from parallel_dcp.jobs.resume import identity
    from parallel_dcp.jobs.targets import Job, target_for
    from parallel_dcp.options import Options

    src = fp8_checkpoint(tmp_path / "fp8")
    source = open_source(src)
    target = target_for(tmp_path / "out", None)
    ids = [
        identity(Job(dequantized_source(source, dtype), tuple(source.entries)), target, Options())
        for dtype in (torch.bfloat16, torch.float16)
    ]
    assert ids[0] != ids[1]


def test_cli_both_directions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from parallel_dcp.cli import main

    src = fp8_checkpoint(tmp_path / "fp8")
    assert main(["convert", str(src), str(tmp_path / "bf16"), "--dequantize", "--to", "safetensors", "-q"]) == 0
    assert main(["verify", str(tmp_path / "bf16"), "--against", str(src), "--dequantize", "-q"]) == 0
    assert main(["convert", str(tmp_path / "bf16"), str(tmp_path / "q"), "--quantize", "fp8-block:1", "--dry-run"]) == 0
    assert "except embeddings" in capsys.readouterr().out
    args = ["--quantize", "fp8-block:64", "--quantize-keys", "*.q_proj.weight", "--to", "safetensors", "-q"]
    assert main(["convert", str(tmp_path / "bf16"), str(tmp_path / "q"), *args]) == 0
    out = load_safetensors_dir(tmp_path / "q")
    assert out["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert out["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert main(["convert", str(src), str(tmp_path / "x"), "--dequantize", "--dtype", "float64"]) == 1
    assert "bfloat16, float16 or float32" in capsys.readouterr().err


def test_inspect_diff_sees_both_directions(tmp_path: Path) -> None:
    src = fp8_checkpoint(tmp_path / "fp8")
    parallel_dcp.convert(src, tmp_path / "fp8-dcp", workers=1)
    assert parallel_dcp.diff(str(src), str(tmp_path / "fp8-dcp")).same  # FP8 and scales hashed as stored
    parallel_dcp.convert(src, tmp_path / "bf16", dequantize=True, to="safetensors", workers=1)
    report = parallel_dcp.diff(str(src), str(tmp_path / "bf16"))
    assert sorted(report.removed) == sorted(k + "_scale_inv" for k in FP8_WEIGHTS)
    assert {c["key"] for c in report.changed} == set(FP8_WEIGHTS)  # dtype float8_e4m3fn -> bfloat16
    with pytest.warns(UserWarning, match="partial edge blocks"):
        parallel_dcp.convert(
            tmp_path / "bf16", tmp_path / "q", quantize="fp8-block", to="safetensors", quantize_keys=PROJ
        )
    again = parallel_dcp.diff(str(tmp_path / "bf16"), str(tmp_path / "q"))
    assert sorted(again.added) == sorted(k + "_scale_inv" for k in FP8_WEIGHTS)


def test_bench_quantized_suite(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    target = tmp_path / "target"
    target.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    args = ["--suite", "quantized", "--gib", "0.002", "--reps", "1", "--warmup", "0", "--workers", "1", "2"]
    args += ["--targets", "disk", "--disk-dir", str(target), "--sync", "off", "--json", str(tmp_path / "b.json")]
    run = subprocess.run(
        [sys.executable, "-m", "parallel_dcp", "bench", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    scenarios = {s["key"]: s for s in json.loads((tmp_path / "b.json").read_text())["scenarios"]}
    expected = {
        "quantized:fp8/disk/sync-off": ["fp8->bf16 parallel_dcp w=1", "fp8->bf16 parallel_dcp w=2", "fp8->bf16 stock"],
        "quantized:mxfp4/disk/sync-off": ["mxfp4->bf16 parallel_dcp w=2", "mxfp4->bf16 stock"],
        "quantized:quantize/disk/sync-off": ["bf16->fp8 parallel_dcp w=2", "bf16->fp8 torch loop"],
    }
    assert set(scenarios) == set(expected)
    for key, rows in expected.items():
        for name in rows:
            row = scenarios[key]["rows"][name]
            assert row["status"] == "ok", (key, name, row["error"])
        assert scenarios[key]["rows"][rows[-2]]["speedup"] > 0  # ours against the stock path or the loop
    assert list(target.iterdir()) == [], "the benchmark removes what it wrote"


def test_coarse_rows_split_so_the_largest_chunk_fits() -> None:
    from parallel_dcp.engine.chunks import split
    from parallel_dcp.formats.base import Entry

    experts = Entry("experts", torch.bfloat16, (4, 500, 64))  # 64,000 bytes an expert
    pieces = split(experts, threshold=96_000)  # 1.5 experts: ceil(4 / 2) = 2 would overshoot
    assert len(pieces) == 4 and all(p.dim == 0 and p.stop - p.start == 1 for p in pieces)


def test_mxfp4_split_into_chunks_equals_stock(tmp_path: Path) -> None:
    src = mxfp4_checkpoint(tmp_path / "mx")
    expected = transformers_layout(stock_dequantized(src, torch.bfloat16), src)
    parallel_dcp.convert(src, tmp_path / "out", dequantize=True, chunk_size=3000, workers=2)
    metadata = FileSystemReader(str(tmp_path / "out")).read_metadata()
    assert len(metadata.state_dict_metadata["model.layers.0.mlp.experts.gate_up_proj"].chunks) > 1  # type: ignore[union-attr]
    assert_same(load_dcp(tmp_path / "out", expected), expected)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_mxfp4_expert_chunks_along_every_dimension(tmp_path: Path, dim: int) -> None:
    """Output [E, G * 32, N] from blocks [E, N, G, 16]: dim 0 reads its experts, dim 2 its packed
    rows, dim 1 (inside the packed groups) the whole; each equals that range of the whole."""
    from parallel_dcp.engine.chunks import Chunk
    from parallel_dcp.formats import open_source
    from parallel_dcp.formats.dequantized_source import dequantized_source

    src = mxfp4_checkpoint(tmp_path / "mx")
    view = dequantized_source(open_source(str(src)), torch.bfloat16)
    try:
        key = "model.layers.0.mlp.experts.gate_up_proj"
        shape = view.entries[key].shape
        assert shape == (3, 160, 10)
        whole = view.read([key])[key]
        start, stop = {0: (1, 3), 1: (40, 97), 2: (3, 7)}[dim]
        chunk = Chunk(key, dim, start, stop, shape)
        assert_same(view.read_chunk(chunk), whole.narrow(dim, start, stop - start).contiguous())
        assert view.chunk_memory(chunk) > chunk.nbytes(2)
    finally:
        view.close()


def test_mxfp4_experts_dequantize_in_strips(monkeypatch: pytest.MonkeyPatch) -> None:
    """Strips of whole experts, and of rows inside one expert, give the whole transpose."""
    import parallel_dcp.formats.quantized as quantized

    g = torch.Generator().manual_seed(6)
    blocks = torch.randint(0, 256, (3, 12, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (3, 12, 2), dtype=torch.uint8, generator=g)
    expected = quantized.dequantize_mxfp4(blocks, scales, torch.bfloat16).transpose(1, 2).contiguous()
    for strip in (10**6, 12 * 64 * 2, 12 * 64, 5 * 64, 1):  # all, two experts, one, 5 rows, 1 row
        monkeypatch.setattr(quantized, "STRIP_ELEMENTS", strip)
        assert_same(quantized.dequantize_mxfp4_experts(blocks, scales, torch.bfloat16), expected)


def test_mxfp4_experts_strips_of_whole_cache_lines_give_the_whole_transpose(monkeypatch: pytest.MonkeyPatch) -> None:
    """Strips inside one expert are cut to a multiple of 64 rows where more fit (the transposed
    copy's rows then fill whole cache lines); ragged last strips and every expert still covered."""
    import parallel_dcp.formats.quantized as quantized

    g = torch.Generator().manual_seed(7)
    blocks = torch.randint(0, 256, (2, 300, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (2, 300, 2), dtype=torch.uint8, generator=g)
    expected = torch.stack([quantized.dequantize_mxfp4(b, s, torch.bfloat16).t() for b, s in zip(blocks, scales)])
    for strip in (100 * 64, 200 * 64, 63 * 64):  # 64 rows a strip, 192, and 63 (fewer than 64: as they are)
        monkeypatch.setattr(quantized, "STRIP_ELEMENTS", strip)
        assert_same(quantized.dequantize_mxfp4_experts(blocks, scales, torch.bfloat16), expected)


def test_inspect_diff_and_verify_compare_in_transformers_layout(tmp_path: Path) -> None:
    """A bf16 gpt-oss as transformers saves it (experts [E, G * 32, N]) is what our dequantized
    output is: ``inspect --diff`` finds nothing, ``verify --dequantize`` against the MXFP4 passes."""
    from parallel_dcp.cli import main

    src = mxfp4_checkpoint(tmp_path / "mx")
    theirs = transformers_layout(stock_dequantized(src, torch.bfloat16), src)
    write_hf(tmp_path / "theirs", theirs, [list(theirs)])
    assert main(["convert", str(src), str(tmp_path / "ours"), "--dequantize", "--to", "safetensors", "-q"]) == 0
    assert parallel_dcp.diff(str(tmp_path / "theirs"), str(tmp_path / "ours")).same
    assert main(["inspect", str(tmp_path / "theirs"), "--diff", str(tmp_path / "ours")]) == 0
    assert main(["verify", str(tmp_path / "ours"), "--against", str(src), "--dequantize", "-q"]) == 0
