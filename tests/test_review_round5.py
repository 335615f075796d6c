"""What the fifth review round broke, each pinned by a test: safetensors files of uint16/32/64,
the fnuz float8s and float8_e8m0fnu (the MX scale type), which the safetensors library writes
and reads, were refused as "which torch cannot hold", and a conversion of such tensors (or of
complex128, which safetensors cannot hold) to safetensors failed in a worker with a bare KeyError
after the job had started; `--quantize fp8-block` wrote weights ending in a partial block, which
transformers 5 dequantizes with other blocks' scales (silently); `--dtype` without `--dequantize`
cast FP8 codes and scales; a tensor named ``__metadata__`` made an unreadable safetensors file; an
empty tensor of a safetensors file failed a conversion to torch.save in a worker; a directory of
one ``pytorch_model.bin`` (no index) was no source; a shard written with O_DIRECT passed the plan at
the advised limit and was refused at admission; a legacy torch.save file was loaded 6x over the
limit; an existing writable destination under a parent the user cannot write was refused; a FIFO
named as the source hung; a single-file save's leftover records were not listed, and a
neighbour's resume records were removed."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch

import parallel_dcp
from parallel_dcp.errors import CorruptCheckpointError, InvalidStateDictError, UnsafeCheckpointError
from parallel_dcp.storage.staging import stage_file
from tests.fresh_interpreter import run_fresh
from tests.quantized_checkpoints import FP8_WEIGHTS, PLAIN, fp8_checkpoint

_SAFETENSORS_DTYPES = [
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
]


def _random_bits(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Every bit pattern possible: random bytes viewed as ``dtype``."""
    count = dtype.itemsize * int(torch.tensor(shape).prod())
    raw = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    return raw.view(dtype).reshape(shape)


def _header_dtypes(path: Path) -> dict[str, str]:
    data = path.read_bytes()
    header = json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]])
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", _SAFETENSORS_DTYPES, ids=str)
def test_safetensors_dtypes_the_library_holds_load_and_convert_both_ways(tmp_path: Path, dtype: torch.dtype) -> None:
    tensor = _random_bits(dtype, (3, 8))
    src = tmp_path / "in.safetensors"
    st.save_file({"a": tensor}, src)
    loaded = parallel_dcp.load(src)["a"]
    assert loaded.dtype == dtype and torch.equal(_bits(loaded), _bits(tensor))
    parallel_dcp.convert(src, tmp_path / "dcp", workers=1)
    out = tmp_path / "out.safetensors"
    parallel_dcp.convert(tmp_path / "dcp", out, workers=1)
    assert _header_dtypes(out) == _header_dtypes(src)  # the name stock writes
    back = st.load_file(out)["a"]
    assert back.dtype == dtype and torch.equal(_bits(back), _bits(tensor))
    assert parallel_dcp.verify(out, against=src).ok


@pytest.mark.parametrize("dtype", [torch.complex128, torch.float4_e2m1fn_x2], ids=str)
def test_a_dtype_safetensors_cannot_hold_is_refused_by_name_before_anything_is_written(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    parallel_dcp.save({"fine": torch.ones(2), "odd": _random_bits(dtype, (2, 2))}, tmp_path / "dcp", workers=1)
    for out in (tmp_path / "one.safetensors", tmp_path / "sharded"):
        with pytest.raises(ValueError, match=rf"safetensors cannot hold these dtypes: {str(dtype)[6:]} \(odd\)"):
            parallel_dcp.convert(tmp_path / "dcp", out, to="safetensors", workers=1)
        assert not out.exists()
    with pytest.raises(ValueError, match="cannot hold"):
        parallel_dcp.convert(tmp_path / "dcp", tmp_path / "dry", to="safetensors", dry_run=True)
    parallel_dcp.convert(tmp_path / "dcp", tmp_path / "fine.safetensors", keys=["fine"], workers=1)  # the way out


def test_a_packed_float4_safetensors_file_is_refused_as_unsupported_not_as_beyond_torch(tmp_path: Path) -> None:
    src = tmp_path / "f4.safetensors"
    st.save_file({"w": _random_bits(torch.float4_e2m1fn_x2, (2, 3))}, src)
    with pytest.raises(CorruptCheckpointError, match=r"dtype F4 .*which parallel_dcp does not read") as caught:
        parallel_dcp.load(src)
    assert "torch cannot hold" not in str(caught.value)


def _bf16_folder(path: Path, shapes: dict[str, tuple[int, int]]) -> Path:
    path.mkdir()
    g = torch.Generator().manual_seed(1)
    st.save_file(
        {k: torch.randn(*s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}, path / "model.safetensors"
    )
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    return path


_SHAPES = {
    "model.layers.0.mlp.up_proj.weight": (192, 64),  # 2 row blocks of 128, the second partial
    "model.layers.0.self_attn.q_proj.weight": (96, 64),  # one block each way (shorter than it)
    "model.layers.0.mlp.down_proj.weight": (64, 256),  # whole blocks
}


def test_the_default_rule_leaves_weights_ending_in_a_partial_block_plain(tmp_path: Path) -> None:
    """transformers 5 dequantized a 192-row weight of 128-row blocks in 96-row blocks (the block
    from the shapes), with other blocks' scales: wrong weights, no error."""
    src = _bf16_folder(tmp_path / "src", _SHAPES)
    with pytest.warns(UserWarning, match=r"1 weights span several 128x128 blocks .*up_proj.*left unquantized"):
        parallel_dcp.convert(src, tmp_path / "q", to="safetensors", quantize="fp8-block", workers=1)
    out = st.load_file(tmp_path / "q" / "model.safetensors")
    assert out["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.up_proj.weight_scale_inv" not in out
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert out["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["modules_to_not_convert"] == ["model.layers.0.mlp.up_proj"]
    # a block that divides it quantizes it; naming it quantizes it with a partial edge block, and says so
    parallel_dcp.convert(src, tmp_path / "q64", to="safetensors", quantize="fp8-block:64", workers=1)
    assert st.load_file(tmp_path / "q64" / "model.safetensors")[
        "model.layers.0.mlp.up_proj.weight_scale_inv"
    ].shape == (3, 1)
    with pytest.warns(UserWarning, match="quantized with partial edge blocks"):
        parallel_dcp.convert(src, tmp_path / "qk", to="safetensors", quantize="fp8-block", quantize_keys=["*up_proj*"])
    assert st.load_file(tmp_path / "qk" / "model.safetensors")["model.layers.0.mlp.up_proj.weight_scale_inv"].shape == (
        2,
        1,
    )


def test_a_default_rule_left_with_only_partial_blocks_says_so(tmp_path: Path) -> None:
    src = _bf16_folder(tmp_path / "src", {"model.layers.0.mlp.up_proj.weight": (192, 64)})
    with (
        pytest.warns(UserWarning),
        pytest.raises(parallel_dcp.QuantizationError, match="end in partial 128x128 blocks"),
    ):
        parallel_dcp.convert(src, tmp_path / "q", to="safetensors", quantize="fp8-block", workers=1)
    assert not (tmp_path / "q").exists()


def test_a_cast_of_an_fp8_source_without_dequantize_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """``--dtype bf16`` without ``--dequantize`` cast the FP8 codes to bf16 and rounded the float32
    scales; the output kept its quantization_config, and transformers loaded other weights."""
    src = fp8_checkpoint(tmp_path / "fp8")
    for out in (tmp_path / "out", tmp_path / "dcp"):
        with pytest.raises(parallel_dcp.QuantizationError, match="holds FP8 weights with scales") as caught:
            parallel_dcp.convert(src, out, to="safetensors" if out.name == "out" else None, dtype="bfloat16")
        assert set(caught.value.keys) == set(FP8_WEIGHTS)
        assert not out.exists()
    parallel_dcp.convert(src, tmp_path / "copied", to="safetensors", workers=1)  # as they are: fine
    parallel_dcp.convert(src, tmp_path / "bf16", to="safetensors", dequantize=True, dtype="bfloat16", workers=1)
    plain = [k for k in PLAIN if k.endswith(".weight")][:1]  # selecting no pair: a cast as any other
    parallel_dcp.convert(src, tmp_path / "plain.safetensors", keys=plain, dtype="float32", workers=1)


def test_a_tensor_named_as_the_safetensors_header_is_refused_for_a_safetensors_output(tmp_path: Path) -> None:
    """A tensor named ``__metadata__`` replaced the header's metadata: a file no reader opens."""
    parallel_dcp.save({"__metadata__": torch.ones(2), "w": torch.ones(3)}, tmp_path / "dcp", workers=1)
    for out in (tmp_path / "one.safetensors", tmp_path / "sharded"):
        with pytest.raises(ValueError, match="safetensors reserves the key __metadata__"):
            parallel_dcp.convert(tmp_path / "dcp", out, to="safetensors", workers=1)
        assert not out.exists()
    parallel_dcp.convert(tmp_path / "dcp", tmp_path / "x.pt", workers=1)  # torch.save holds it
    renamed = tmp_path / "renamed.safetensors"
    parallel_dcp.convert(tmp_path / "dcp", renamed, rename=[(r"__metadata__", "meta")], workers=1)
    assert set(st.load_file(renamed)) == {"meta", "w"}


def test_an_empty_tensor_of_a_safetensors_file_converts_to_torch_save(tmp_path: Path) -> None:
    """Read through the file's mmap, an empty tensor points at the next one's bytes: torch.save
    refused the two as one storage of two dtypes, in a worker, after the job started."""
    src = tmp_path / "in.safetensors"
    tensors = {"a_empty": torch.empty(0, 5), "b": torch.arange(4, dtype=torch.int8)}
    st.save_file(tensors, src)
    for out, to in ((tmp_path / "x.pt", None), (tmp_path / "sharded", "torch")):
        parallel_dcp.convert(src, out, to=to, workers=1)
        assert parallel_dcp.verify(out, against=src).ok
    loaded = torch.load(tmp_path / "x.pt")
    assert loaded["a_empty"].shape == (0, 5) and torch.equal(loaded["b"], tensors["b"])


def test_a_directory_of_one_pytorch_model_bin_is_a_torch_source(tmp_path: Path) -> None:
    """Hugging Face writes one shard as ``pytorch_model.bin`` without an index, and so does a
    conversion ``--to torch`` into a directory: neither could be read back (no format found)."""
    folder = tmp_path / "hf"
    folder.mkdir()
    weights = {"w": torch.arange(6.0).reshape(2, 3)}
    torch.save(weights, folder / "pytorch_model.bin")
    torch.save({"not": "weights"}, folder / "training_args.bin")  # another .bin beside it: not read
    assert torch.equal(parallel_dcp.load(folder)["w"], weights["w"])
    parallel_dcp.convert(folder, tmp_path / "out", to="torch", workers=1)
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith(".")) == ["pytorch_model.bin"]
    assert parallel_dcp.verify(tmp_path / "out", against=folder).ok
    assert set(parallel_dcp.load(tmp_path / "out")) == {"w"}


def test_dtype_leaves_what_the_transformers_class_keeps_in_float32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The class's lists, read from transformers where it is installed (here a stand-in module:
    the client suite checks the real one against ``from_pretrained(src, dtype=...)``)."""
    import types

    fake = types.ModuleType("transformers")
    fake.RouterForCausalLM = type(  # type: ignore[attr-defined]
        "RouterForCausalLM", (), {"_keep_in_fp32_modules_strict": ["gate.weight", "e_score_correction_bias"]}
    )
    src = tmp_path / "src"
    src.mkdir()
    tensors = {
        "model.layers.0.mlp.gate.weight": torch.randn(4, 8),
        "model.layers.0.mlp.gate.e_score_correction_bias": torch.randn(4),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(8, 8),
    }
    st.save_file(tensors, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"architectures": ["RouterForCausalLM"], "dtype": "float32"}))
    monkeypatch.setitem(sys.modules, "transformers", fake)
    parallel_dcp.convert(src, tmp_path / "out", to="safetensors", dtype="bfloat16", workers=1)
    out = st.load_file(tmp_path / "out" / "model.safetensors")
    assert {k: v.dtype for k, v in out.items()} == {
        "model.layers.0.mlp.gate.weight": torch.float32,
        "model.layers.0.mlp.gate.e_score_correction_bias": torch.float32,
        "model.layers.0.mlp.gate_proj.weight": torch.bfloat16,
    }
    assert torch.equal(out["model.layers.0.mlp.gate.weight"], tensors["model.layers.0.mlp.gate.weight"])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    assert parallel_dcp.verify(tmp_path / "out", against=src, dtype="bfloat16").ok
    parallel_dcp.convert(src, tmp_path / "dcp", dtype="bfloat16", workers=1)  # DCP: torchtitan's, all cast
    assert {v.dtype for v in parallel_dcp.load(tmp_path / "dcp").values()} == {torch.bfloat16}
    # a DCP checkpoint exported to Hugging Face with the model's files: the copied config says the class
    parallel_dcp.convert(src, tmp_path / "dcp32", workers=1)
    exported = tmp_path / "exported"
    parallel_dcp.convert(tmp_path / "dcp32", exported, to="safetensors", dtype="bfloat16", copy_files_from=src)
    held = st.load_file(exported / "model.safetensors")
    assert held["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    assert held["model.layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16
    monkeypatch.delitem(sys.modules, "transformers")  # (not installed here; the real one has no such class)
    parallel_dcp.convert(src, tmp_path / "plain", to="safetensors", dtype="bfloat16", workers=1)
    assert {v.dtype for v in st.load_file(tmp_path / "plain" / "model.safetensors").values()} == {torch.bfloat16}


def test_the_limit_advised_for_a_sharded_output_written_direct_plans_and_runs(tmp_path: Path) -> None:
    """A shard task of one tensor was not checked with its output stream's aligned buffers: the
    plan (and the dry run) passed at the advised limit, and the task was refused at admission,
    after the workers had started, under every limit from the advice up to twice it."""
    from parallel_dcp.storage.io_mode import direct_refusal

    if direct_refusal(tmp_path) is not None:
        pytest.skip("no O_DIRECT here")
    parallel_dcp.save({f"layer.{i}.w": torch.randn(512, 1024) for i in range(8)}, tmp_path / "dcp", workers=1)
    with pytest.raises(parallel_dcp.MemoryLimitExceeded, match=r"at least (\d+) MiB") as caught:
        parallel_dcp.convert(tmp_path / "dcp", tmp_path / "x", to="safetensors", io="direct", memory_limit="1MiB")
    advised = f"{caught.value.measured // 2**20}MiB"
    out = tmp_path / "out"
    kwargs: dict[str, Any] = {"to": "safetensors", "io": "direct", "workers": 2, "memory_limit": advised}
    plan = parallel_dcp.convert(tmp_path / "dcp", out, dry_run=True, **kwargs)
    assert plan.predicted_peak_memory <= plan.memory_limit
    parallel_dcp.convert(tmp_path / "dcp", out, **kwargs)  # refused at its first task's admission before
    assert parallel_dcp.verify(out, against=tmp_path / "dcp").ok


def test_a_folder_without_an_index_is_its_model_safetensors_as_transformers_reads_it(tmp_path: Path) -> None:
    """Every top-level .safetensors file was merged in: a LoRA's adapter_model.safetensors beside
    model.safetensors became part of the model."""
    folder = tmp_path / "hf"
    folder.mkdir()
    st.save_file({"w": torch.ones(2)}, folder / "model.safetensors")
    st.save_file({"base_model.lora_A.weight": torch.zeros(2)}, folder / "adapter_model.safetensors")
    assert set(parallel_dcp.load(folder)) == {"w"}
    (folder / "model.safetensors").unlink()
    assert set(parallel_dcp.load(folder)) == {"base_model.lora_A.weight"}  # no model.safetensors: every file


def test_a_legacy_torch_save_file_larger_than_the_limit_is_refused_before_it_is_loaded(tmp_path: Path) -> None:
    """A legacy (non-zip) file is loaded whole when opened: 128 MiB of it was loaded under a
    21 MiB limit (6x over), and the job refused only in its write phase."""
    src = tmp_path / "legacy.pt"
    torch.save({f"l{i}": torch.zeros(256, 1024) for i in range(24)}, src, _use_new_zipfile_serialization=False)
    for call in (
        lambda: parallel_dcp.convert(src, tmp_path / "out", memory_limit="16MiB"),
        lambda: parallel_dcp.load(src, memory_limit="16MiB"),
        lambda: parallel_dcp.verify(src, against=src, memory_limit="16MiB"),
    ):
        with pytest.raises(parallel_dcp.MemoryLimitExceeded, match=r"legacy \(non-zip\) format.*zip format"):
            call()
    assert not (tmp_path / "out").exists()
    with pytest.warns(UserWarning, match="legacy"):  # fits: converted, with the warning it always had
        parallel_dcp.convert(src, tmp_path / "roomy", memory_limit="512MiB", workers=1)


def test_a_torch_save_file_with_int_keys_loads_as_torch_load_gives_it(tmp_path: Path) -> None:
    """An optimizer's state dict (int keys) in a torch.save file was refused by load with "DCP
    stores string keys only", although the file is not DCP."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(3)).sum().backward()
    optimizer.step()
    src = tmp_path / "train.pt"
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, src)
    loaded = parallel_dcp.load(src)
    expected = torch.load(src)
    assert list(loaded["optim"]["state"]) == [0, 1]
    assert torch.equal(loaded["optim"]["state"][0]["exp_avg"], expected["optim"]["state"][0]["exp_avg"])
    torch.optim.Adam(model.parameters()).load_state_dict(loaded["optim"])
    cast = parallel_dcp.load(src, dtype="bfloat16")
    assert cast["optim"]["state"][1]["exp_avg_sq"].dtype == torch.bfloat16 and cast["optim"]["state"][0]["step"]
    with pytest.raises(parallel_dcp.MemoryLimitExceeded, match="read whole"):
        parallel_dcp.load(src, memory_limit=100)
    with pytest.raises(InvalidStateDictError, match="not a string"):  # a conversion to DCP: refused, as before
        parallel_dcp.convert(src, tmp_path / "dcp")


def test_a_copied_config_promising_quantized_weights_the_shards_lack_is_written_without_it(tmp_path: Path) -> None:
    """A dequantized checkpoint written out with its release's files kept the release's
    quantization_config: transformers would build quantized layers for plain weights."""
    release = fp8_checkpoint(tmp_path / "fp8")
    assert "quantization_config" in json.loads((release / "config.json").read_text())
    parallel_dcp.convert(release, tmp_path / "dcp", dequantize=True, workers=1)  # plain bf16, as DCP
    out = tmp_path / "hf"
    parallel_dcp.convert(tmp_path / "dcp", out, to="safetensors", copy_files_from=release, workers=1)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config == {
        k: v for k, v in json.loads((release / "config.json").read_text()).items() if k != "quantization_config"
    }
    kept = tmp_path / "kept"  # the FP8 release itself, as it is: its config copied byte for byte
    parallel_dcp.convert(release, tmp_path / "fp8-dcp", workers=1)
    parallel_dcp.convert(tmp_path / "fp8-dcp", kept, to="safetensors", copy_files_from=release, workers=1)
    assert (kept / "config.json").read_bytes() == (release / "config.json").read_bytes()


def saves_into_its_own_directory_under_a_parent_it_cannot_write(where: str) -> list[str]:
    """As an ordinary user (uid 65534) owning ``where/mine`` but not ``where``: a save into
    ``mine`` (written inside only). Every failure, none when it commits."""
    base = Path(where)
    parallel_dcp.save({"w": torch.arange(4.0)}, base / "warm", workers=1)  # every import, while root may read them
    parallel_dcp.load(base / "warm")
    os.setgid(65534)
    os.setuid(65534)
    try:
        parallel_dcp.save({"w": torch.arange(4.0)}, base / "mine", workers=1)
    except Exception as exc:
        return [f"{type(exc).__name__}: {exc}"]
    return [] if torch.equal(parallel_dcp.load(base / "mine")["w"], torch.arange(4.0)) else ["wrong data"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_an_existing_writable_destination_under_a_parent_the_user_cannot_write_is_used() -> None:
    """A container's mounted /output (its parent, /, root's) was refused: "directory / is not writable"."""
    base = Path(tempfile.mkdtemp(prefix="parallel_dcp-parent-", dir="/tmp"))  # (tmp_path's parents are 0700)
    try:
        (base / "mine").mkdir()
        os.chmod(base, 0o755)
        os.chown(base / "mine", 65534, 65534)
        save = "saves_into_its_own_directory_under_a_parent_it_cannot_write"
        assert run_fresh("tests.test_review_round5", save, str(base)) == []
    finally:
        shutil.rmtree(base)


def _dies_holding_records(destination: str) -> None:
    """A save to ``destination`` killed after its owner record, before any temporary file."""
    pid = os.fork()
    if pid == 0:
        try:
            stage_file(Path(destination), overwrite=True)
        finally:
            os._exit(0)  # no cleanup: as a SIGKILL leaves it
    os.waitpid(pid, 0)


def test_the_leftover_records_of_a_single_file_save_are_listed_and_a_neighbours_resume_is_kept(
    tmp_path: Path,
) -> None:
    """``inspect out.pt`` missed a save to it killed before its temporary file (its records do not
    carry the output's name); a save to ``a.pt`` removed a dead conversion's finished tasks kept
    for ``--resume`` of ``b.pt`` beside it."""
    torch.save({"w": torch.ones(2)}, tmp_path / "out.pt")
    _dies_holding_records(str(tmp_path / "out.pt"))
    report = parallel_dcp.inspect(tmp_path / "out.pt")
    assert report["leftovers"] and report["leftovers"][0]["destination"] == str(tmp_path / "out.pt")
    # a resumable leftover of b.pt (its job record and one finished task), then a save to a.pt
    save_id = "0123456789ab"
    record = {"save_id": save_id, "host": socket.gethostname(), "pid": 2**22 + 1, "destination": str(tmp_path / "b.pt")}
    (tmp_path / f".parallel_dcp.owner.{save_id}").write_text(json.dumps(record))
    (tmp_path / f".parallel_dcp.job.{save_id}").write_text("{}")
    (tmp_path / f".parallel_dcp.done.{save_id}.0").write_text("{}")
    parallel_dcp.convert(tmp_path / "out.pt", tmp_path / "a.pt", workers=1, overwrite=True)
    assert (tmp_path / f".parallel_dcp.done.{save_id}.0").exists()


def test_a_fifo_named_as_the_source_is_refused_not_waited_on(tmp_path: Path) -> None:
    """The safetensors library's open blocked on it: convert and inspect hung with no output."""
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    for call in (lambda: parallel_dcp.inspect(fifo), lambda: parallel_dcp.convert(fifo, tmp_path / "out")):
        with pytest.raises(UnsafeCheckpointError, match="is not a regular file"):
            call()
    assert not (tmp_path / "out").exists()


def test_a_tied_model_quantized_lists_its_lm_head_as_not_converted(tmp_path: Path) -> None:
    """With tied embeddings the output holds no lm_head.weight, so modules_to_not_convert left it
    out, and transformers' FP8 quantizer would make the (tied) head an FP8 layer."""
    src = _bf16_folder(tmp_path / "src", {"model.embed_tokens.weight": (64, 64), **_SHAPES})
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    with pytest.warns(UserWarning):  # (the partial-block weight of _SHAPES)
        parallel_dcp.convert(src, tmp_path / "q", to="safetensors", quantize="fp8-block", workers=1)
    skipped = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "lm_head" in skipped and "model.embed_tokens" in skipped


def test_a_full_file_system_or_too_many_open_files_is_explained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC on inodes named only a hidden temporary file; EMFILE said only its errno."""
    from parallel_dcp.jobs import pipeline

    for code, said in ((errno.ENOSPC, "full (of bytes, or of inodes"), (errno.EMFILE, "ulimit -n")):

        def fails(*args: Any, code: int = code, **kwargs: Any) -> Any:
            raise OSError(code, os.strerror(code), ".parallel_dcp.owner.0123456789ab")

        monkeypatch.setattr(pipeline, "stage_job", fails)
        with pytest.raises(OSError) as caught:
            parallel_dcp.save({"w": torch.ones(2)}, tmp_path / "ckpt", workers=1)
        assert any(
            said in note and (code == errno.EMFILE or str(tmp_path / "ckpt") in note) for note in caught.value.__notes__
        )
