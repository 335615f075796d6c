"""``--dtype`` keeps transformers' float32 modules when the source is named as its weights file
(``SRC/model.safetensors``, ``SRC/pytorch_model.bin``) as it does for the folder: the
``config.json`` beside the file is the model's. It was read only for a folder, so naming the file
rounded T5's ``wo`` under float16, with no warning (s16 review, F8)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import assert_params_equal


@pytest.mark.parametrize("safe", [True, False], ids=["model.safetensors", "pytorch_model.bin"])
@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_a_weights_file_named_alone_keeps_what_its_folder_keeps(
    run_cli: Callable[..., object], tmp_path: Path, safe: bool, to: str
) -> None:
    import transformers

    config = transformers.T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    src = tmp_path / "src"
    model.save_pretrained(src)
    weights = src / "model.safetensors"
    if not safe:  # (transformers 5 writes safetensors only: the .bin as torch.save writes it)
        torch.save(model.state_dict(), src / "pytorch_model.bin")
        weights.unlink()
        weights = src / "pytorch_model.bin"
    out = tmp_path / "out"
    run_cli("convert", weights, out, "--to", to, "--dtype", "float16")
    if not (out / "config.json").exists():  # (a file source copies no side files)
        shutil.copy(src / "config.json", out / "config.json")
    own = transformers.T5ForConditionalGeneration.from_pretrained(src, dtype=torch.float16).eval()
    ours = transformers.T5ForConditionalGeneration.from_pretrained(out, dtype=torch.float16).eval()
    kept = [k for k in own.state_dict() if "DenseReluDense.wo.weight" in k]
    assert kept and all(own.state_dict()[k].dtype == torch.float32 for k in kept)
    assert_params_equal(ours, own)


@pytest.mark.parametrize("option", [["--dtype", "float16"], ["--quantize", "fp8-block:32"]], ids=["dtype", "quantize"])
def test_another_models_file_beside_the_config_is_refused(
    run_cli: Callable[..., object], tmp_path: Path, bert_dir: Path, option: list[str]
) -> None:
    """A BERT's weights as ``other.safetensors`` beside a T5's config.json: T5's ``wo`` kept BERT's
    ``word_embeddings`` in float32, and ``--quantize`` wrote T5's config.json beside BERT's weights,
    in silence. transformers never pairs that config with that file; the conversion is refused,
    naming both, before anything is written."""
    import transformers

    config = transformers.T5Config(
        vocab_size=128,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=1,
        num_heads=4,
        decoder_start_token_id=0,
        architectures=["T5ForConditionalGeneration"],
    )
    src = tmp_path / "src"
    src.mkdir()
    config.save_pretrained(src)
    shutil.copy(bert_dir / "model.safetensors", src / "other.safetensors")
    done = run_cli("convert", src / "other.safetensors", tmp_path / "out", "--to", "safetensors", *option, check=False)
    assert done.returncode != 0  # type: ignore[attr-defined]
    said = done.stderr  # type: ignore[attr-defined]
    assert "T5ForConditionalGeneration (model_type 't5') has none of the file's" in said, said
    assert "other.safetensors to a folder of its own" in said
    assert not (tmp_path / "out").exists()
