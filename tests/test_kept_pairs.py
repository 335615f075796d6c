"""A plain conversion (no dequantize, no quantize) never parts a quantized tensor from its scale
(review s17 F7): a selection (``keys``) or a rename (``rename``) that keeps an FP8 weight without its
``weight_scale_inv``, MXFP4 blocks without their scales, or names them so that readers no longer
pair them, is refused before anything is written, dry run included, for every output format.
transformers loaded such a weight as its raw e4m3 codes (max 448 where the weights were below
0.09) under the ``quantization_config`` the output kept, with no word. Selections of plain tensors
only, and of whole pairs, convert as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import parallel_dcp
from parallel_dcp.errors import QuantizationError
from tests.cli_in_process import run_in_process
from tests.quantized_checkpoints import FP8_WEIGHTS, fp8_checkpoint, mxfp4_checkpoint
from tests.test_quantized_sources_refused import compressed_tensors_checkpoint

# (a rename of the scales alone leaves the other keys as they are, and says so)
pytestmark = pytest.mark.filterwarnings("ignore::parallel_dcp.RenameWarning")

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
EXPERTS = "model.layers.0.mlp.experts.down_proj"


def _stored(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out |= load_file(shard)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype and bytes (the FP8 fixture's NaN codes and their dequantized NaNs included)."""
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _nothing_at(out: Path) -> bool:
    return not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize(
    ("keys", "said"),
    [
        ("*.weight", rf"FP8 weight '{Q_PROJ}' without its scale '{Q_PROJ}_scale_inv'"),  # every scale left out
        (r"re:.*(?<!_scale_inv)$", r"parts 4 quantized tensors of .* from their scales"),
        (r"re:.*(?<!layers\.0\.self_attn\.q_proj\.weight_scale_inv)$", rf"parts 1 quantized tensor .*'{Q_PROJ}'"),
        ("*_scale_inv", rf"scale '{Q_PROJ}_scale_inv' without the FP8 weight '{Q_PROJ}'"),  # the scales alone
    ],
)
@pytest.mark.parametrize("to", ["safetensors", "dcp"])
def test_keys_that_part_an_fp8_weight_from_its_scale_are_refused(tmp_path: Path, keys: str, said: str, to: str) -> None:
    src = fp8_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    with pytest.raises(QuantizationError, match=said) as caught:
        parallel_dcp.convert(src, out, to=to, keys=keys, workers=1)
    assert "--dequantize" in str(caught.value) and "nothing was written" in str(caught.value)
    assert caught.value.keys and set(caught.value.keys) <= set(FP8_WEIGHTS) | {k + "_scale_inv" for k in FP8_WEIGHTS}
    assert _nothing_at(out)


def test_one_safetensors_file_and_the_dry_run_are_refused_alike(tmp_path: Path) -> None:
    src = fp8_checkpoint(tmp_path / "src")
    with pytest.raises(QuantizationError, match="without its scale"):
        parallel_dcp.convert(src, tmp_path / "w.safetensors", keys="*.weight", workers=1)
    assert not (tmp_path / "w.safetensors").exists()
    with pytest.raises(QuantizationError, match="without its scale"):
        parallel_dcp.convert(src, tmp_path / "out", to="safetensors", keys="*.weight", dry_run=True, workers=1)


def test_the_cli_says_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The reviewer's 2 a.m. form: ``--keys '*.weight'`` on an FP8 release, to a Hugging Face folder."""
    src = fp8_checkpoint(tmp_path / "src")
    for extra in ([], ["--dry-run"]):
        done = run_in_process(
            capsys, "convert", src, tmp_path / "w", "--to", "safetensors", "--keys", "*.weight", *extra, check_code=None
        )
        assert done.returncode != 0
        assert "without its scale" in done.stderr and "--dequantize" in done.stderr, done.stderr
    assert _nothing_at(tmp_path / "w")


@pytest.mark.parametrize(
    ("rule", "said"),
    [
        ((r"(.*)\.weight_scale_inv", r"\1.weight_scale"), r"a reader looks for '.*weight_scale_inv'"),  # the scales
        ((r"(.*)q_proj\.weight", r"\1q_proj.w"), r"renamed '.*q_proj\.w', not named X\.weight"),  # one weight
    ],
)
def test_a_rename_that_parts_an_fp8_pair_is_refused(tmp_path: Path, rule: tuple[str, str], said: str) -> None:
    src = fp8_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    with pytest.raises(QuantizationError, match=said):
        parallel_dcp.convert(src, out, to="safetensors", rename=[rule], workers=1)
    assert _nothing_at(out)


def test_a_rename_that_makes_a_pair_of_strangers_is_refused(tmp_path: Path) -> None:
    """A plain float tensor renamed to the scale name of an FP8 weight that has none (an FP8 cast):
    a reader would take it for that weight's scale."""
    src = tmp_path / "cast.safetensors"
    save_file({"w.weight": torch.ones(4, 4).to(torch.float8_e4m3fn), "w.bias": torch.ones(1, 1)}, str(src))
    with pytest.raises(QuantizationError, match=r"'w\.weight' and 'w\.weight_scale_inv' .*now pair by name"):
        parallel_dcp.convert(src, tmp_path / "out", to="dcp", rename=[(r"w\.bias", "w.weight_scale_inv")], workers=1)
    assert _nothing_at(tmp_path / "out")
    parallel_dcp.convert(src, tmp_path / "as_is", to="dcp", keys="w.weight", workers=1)  # no scale to part from


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"keys": "*_blocks"}, rf"MXFP4 blocks '{EXPERTS}_blocks' without their scales '{EXPERTS}_scales'"),
        ({"keys": ["*_scales", "*_bias"]}, rf"scales '{EXPERTS}_scales' without the MXFP4 blocks"),
        ({"rename": [(r"(.*)_blocks", r"\1_packed")]}, r"not named X_blocks"),
        ({"rename": [(r"(.*)_scales", r"\1.scales")]}, rf"a reader looks for '{EXPERTS}_scales'"),
    ],
)
def test_mxfp4_blocks_parted_from_their_scales_are_refused(tmp_path: Path, options: dict[str, Any], said: str) -> None:
    src = mxfp4_checkpoint(tmp_path / "src")
    with pytest.raises(QuantizationError, match=said):
        parallel_dcp.convert(src, tmp_path / "out", to="safetensors", workers=1, **options)
    assert _nothing_at(tmp_path / "out")


def test_per_channel_fp8_parted_is_refused_without_advising_dequantize(tmp_path: Path) -> None:
    src = compressed_tensors_checkpoint(tmp_path / "src")
    with pytest.raises(QuantizationError, match=r"per-channel FP8 weight .* without its per-channel scale") as caught:
        parallel_dcp.convert(src, tmp_path / "out", to="safetensors", keys="*.weight", workers=1)
    assert "add dequantize" not in str(caught.value) and "select whole pairs" in str(caught.value)


@pytest.mark.parametrize("to", ["safetensors", "dcp"])
def test_plain_tensors_only_and_whole_pairs_convert_as_before(tmp_path: Path, to: str) -> None:
    src = fp8_checkpoint(tmp_path / "src")
    stored = _stored(src)
    norms = parallel_dcp.convert(src, tmp_path / "norms", to=to, keys="*norm*", workers=1)
    assert norms.keys == 2  # no FP8 weight kept: nothing parted
    layer0 = [r"re:model\.layers\.0\..*"]  # two FP8 weights, each with its scale
    parallel_dcp.convert(src, tmp_path / "layer0", to=to, keys=layer0, workers=1)
    renamed = parallel_dcp.convert(src, tmp_path / "m", to=to, rename=[(r"model\.(.*)", r"m.\1")], workers=1)
    assert renamed.keys == len(stored)
    got = parallel_dcp.load(tmp_path / "layer0")
    wanted = {k: v for k, v in stored.items() if k.startswith("model.layers.0.")}
    assert got.keys() == wanted.keys() and f"{Q_PROJ}_scale_inv" in got
    assert all(_same(got[key], value) for key, value in wanted.items())
    if to == "safetensors":
        assert (
            json.loads((tmp_path / "layer0" / "config.json").read_text())["quantization_config"]["quant_method"]
            == "fp8"
        )


def test_dequantize_with_the_same_keys_is_fine(tmp_path: Path) -> None:
    """``keys`` names the dequantized weights there (the scales are no keys): ``*.weight`` is every weight."""
    src = fp8_checkpoint(tmp_path / "src")
    done = parallel_dcp.convert(src, tmp_path / "out", to="safetensors", keys="*.weight", dequantize=True, workers=1)
    out = _stored(tmp_path / "out")
    assert done.keys == len(out) and out[Q_PROJ].dtype == torch.bfloat16
    assert not any(k.endswith("_scale_inv") for k in out)
    loaded = parallel_dcp.load(src, keys="*.weight", dequantize=True)  # a read: the same dequantized values
    assert loaded.keys() == out.keys()
    assert all(_same(loaded[k], out[k]) for k in out)
