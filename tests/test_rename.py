"""Rename rules: HF Llama names -> torchtitan names -> back, bit for bit; collisions refused before any write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
import torch.distributed.checkpoint as dcp

import parallel_dcp
from parallel_dcp import PRESETS, RenameError
from parallel_dcp.cli import main
from parallel_dcp.jobs.rename import compile_rules, parse_rule
from parallel_dcp.storage.metadata import read_metadata
from tests.conftest import assert_same
from tests.test_convert import read_hf_safetensors, write_hf_safetensors

# The names of torchtitan 0.3.0's Llama 3 (its presets' rules; renaming alone, no q/k permutation).
TO_TITAN = [list(rule) for rule in PRESETS["hf-llama3-to-torchtitan"].rules]
TO_HF = [list(rule) for rule in PRESETS["torchtitan-to-hf-llama3"].rules]


def hf_llama(layers: int = 2) -> dict[str, torch.Tensor]:
    """Every tensor name of a Hugging Face Llama, small."""
    g = torch.Generator().manual_seed(1)
    sd = {"model.embed_tokens.weight": torch.randn(50, 16, generator=g).to(torch.bfloat16)}
    for i in range(layers):
        for p in "qkvo":
            sd[f"model.layers.{i}.self_attn.{p}_proj.weight"] = torch.randn(16, 16, generator=g)
        for p in ("gate", "up", "down"):
            sd[f"model.layers.{i}.mlp.{p}_proj.weight"] = torch.randn(24 if p != "down" else 16, 16, generator=g)
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.randn(16, generator=g)
        sd[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.randn(16, generator=g)
    sd["model.norm.weight"] = torch.randn(16, generator=g)
    sd["lm_head.weight"] = torch.randn(50, 16, generator=g).half()
    return sd


def titan_names(layers: int = 2) -> set[str]:
    names = {"tok_embeddings.weight", "norm.weight", "lm_head.weight"}
    for i in range(layers):
        names |= {f"layers.{i}.attention.qkv_linear.w{p}.weight" for p in "qkv"} | {f"layers.{i}.attention.wo.weight"}
        names |= {f"layers.{i}.feed_forward.w{n}.weight" for n in (1, 2, 3)}
        names |= {f"layers.{i}.attention_norm.weight", f"layers.{i}.ffn_norm.weight"}
    return names


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(directory.rglob("*"))
    }


@pytest.mark.parametrize("workers", [1, 2])
def test_hf_to_torchtitan_dcp_and_back_bit_for_bit(tmp_path: Path, workers: int) -> None:
    sd = hf_llama()
    write_hf_safetensors(sd, tmp_path / "hf", shards=3)
    result = parallel_dcp.convert(tmp_path / "hf", tmp_path / "titan", rename=TO_TITAN, workers=workers)
    assert isinstance(result, parallel_dcp.SaveResult) and result.keys == len(sd)

    metadata = read_metadata(tmp_path / "titan")
    assert set(metadata.state_dict_metadata) == titan_names()
    # a flat source gives a flat output: what torchtitan's model.state_dict() holds
    assert metadata.planner_data == {k: (k,) for k in metadata.state_dict_metadata}
    # the stock reader loads it into a torchtitan-named flat state dict, the very tensors
    back = {
        "layers.1.attention.qkv_linear.wk.weight": torch.empty(16, 16),
        "layers.0.feed_forward.w3.weight": torch.empty(24, 16),
        "lm_head.weight": torch.empty(50, 16, dtype=torch.float16),
    }
    dcp.load(back, checkpoint_id=str(tmp_path / "titan"), no_dist=True)
    assert_same(back["layers.1.attention.qkv_linear.wk.weight"], sd["model.layers.1.self_attn.k_proj.weight"])
    assert_same(back["layers.0.feed_forward.w3.weight"], sd["model.layers.0.mlp.up_proj.weight"])
    assert_same(back["lm_head.weight"], sd["lm_head.weight"])

    parallel_dcp.convert(tmp_path / "titan", tmp_path / "hf2", to="safetensors", rename=TO_HF, shard_size=2000)
    assert_same(read_hf_safetensors(tmp_path / "hf2"), sd)


def test_nesting_follows_the_new_names(tmp_path: Path) -> None:
    sd = {"model": {"layers": {"0": {"q": torch.ones(3)}}, "head": torch.zeros(2)}, "step": 7}
    parallel_dcp.save(sd, tmp_path / "nested")
    parallel_dcp.convert(
        tmp_path / "nested",
        tmp_path / "out",
        rename=[(r"model\.layers\.(\d+)\.q", r"model.layers.\1.wq"), (r"model\.head", "head"), ("step", "meta.step")],
    )
    planner = read_metadata(tmp_path / "out").planner_data
    # the levels the new name still starts with are kept; the rest of the name is one level
    assert planner["model.layers.0.wq"] == ("model", "layers", "0", "wq")
    assert planner["head"] == ("head",)
    assert planner["meta.step"] == ("meta.step",)
    loaded = parallel_dcp.load(tmp_path / "out")
    assert_same(loaded, {"model": {"layers": {"0": {"wq": torch.ones(3)}}}, "head": torch.zeros(2), "meta.step": 7})


def test_callable_and_unmatched_names_kept(tmp_path: Path) -> None:
    sd = {"a.weight": torch.arange(4.0), "b.weight": torch.arange(3.0)}
    st.save_file(sd, tmp_path / "m.safetensors")
    parallel_dcp.convert(
        tmp_path / "m.safetensors",
        tmp_path / "o.safetensors",
        rename=lambda name: "x." + name if name.startswith("a.") else None,
    )
    assert_same(st.load_file(tmp_path / "o.safetensors"), {"x.a.weight": sd["a.weight"], "b.weight": sd["b.weight"]})


def test_rename_applies_after_key_selection(tmp_path: Path) -> None:
    sd = hf_llama(1)
    st.save_file(sd, tmp_path / "m.safetensors")
    parallel_dcp.convert(tmp_path / "m.safetensors", tmp_path / "o.safetensors", keys="*q_proj*", rename=TO_TITAN)
    assert set(st.load_file(tmp_path / "o.safetensors")) == {"layers.0.attention.qkv_linear.wq.weight"}


@pytest.mark.parametrize(
    ("rules", "message", "listed"),
    [
        ([(r"model\.layers\.\d+\.(.*)", r"\1")], "several keys to one name", ["self_attn.q_proj.weight"]),
        ([(r"lm_head\.weight", "model.norm.weight")], "several keys to one name", ["model.norm.weight"]),
        ([(r"lm_head\.weight", "")], "empty names", ["lm_head.weight"]),
        ([(r"model\.norm\.weight", "model")], "nesting", ["model (a value)"]),
    ],
)
def test_collisions_refused_before_anything_is_written(
    tmp_path: Path, rules: list[tuple[str, str]], message: str, listed: list[str]
) -> None:
    sd = hf_llama(2)
    parallel_dcp.save(
        {"model": {k.removeprefix("model."): v for k, v in sd.items() if k.startswith("model.")}}
        | {"lm_head.weight": sd["lm_head.weight"]},
        tmp_path / "src",
    )
    before = snapshot(tmp_path)
    with pytest.raises(RenameError, match=message) as info:
        parallel_dcp.convert(tmp_path / "src", tmp_path / "dst", rename=rules)
    for name in listed:
        assert any(name in new or name in olds for new, olds in info.value.collisions.items()), info.value.collisions
        assert name in str(info.value)
    assert snapshot(tmp_path) == before  # no destination, no staging directory


def test_collision_lists_every_source(tmp_path: Path) -> None:
    st.save_file({"a.w": torch.ones(1), "b.w": torch.ones(1), "c.v": torch.ones(1)}, tmp_path / "m.safetensors")
    with pytest.raises(RenameError) as info:
        parallel_dcp.convert(tmp_path / "m.safetensors", tmp_path / "o", rename=[(r".*\.(w|v)", r"\1")])
    assert info.value.collisions == {"w": ["a.w", "b.w"]}
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ([("(unclosed", "x")], "bad regular expression"),
        ([("a", "b", "c")], "pair"),
        ("a=b", "not a single string"),
        ([(r"(a)\.w", r"\2")], "cannot rename"),
    ],
)
def test_bad_rules(tmp_path: Path, rules: object, message: str) -> None:
    st.save_file({"a.w": torch.ones(1)}, tmp_path / "m.safetensors")
    with pytest.raises(RenameError, match=message):
        parallel_dcp.convert(tmp_path / "m.safetensors", tmp_path / "o", rename=rules)  # type: ignore[arg-type]
    assert not (tmp_path / "o").exists()


def test_rules_first_match_wins_and_cli_syntax() -> None:
    rename = compile_rules([(r"a\.(.*)", r"first.\1"), (r"a\.b", "second"), (r"(?P<x>c)", r"\g<x>\g<x>")])
    assert [rename(n) for n in ("a.b", "c", "d")] == ["first.b", "cc", "d"]
    assert parse_rule(r"model\.(.*)=m.\1") == (r"model\.(.*)", r"m.\1")
    assert parse_rule(r"(?=x)x=y") == (r"(?=x)x", "y")
    with pytest.raises(RenameError):
        parse_rule("no-equals-sign")


def test_cli_rename_and_rename_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The flags' effect, run in this process (main(argv), what ``python -m parallel_dcp`` runs;
    tests/test_cli.py and test_cli_startup.py run the program itself)."""
    sd = hf_llama(1)
    st.save_file(sd, tmp_path / "m.safetensors")

    def convert(*args: str | Path) -> tuple[int, str]:
        try:
            code = main(["convert", *map(str, args)])
        except SystemExit as exited:  # a usage error: python -m parallel_dcp exits with its code
            code = exited.code if isinstance(exited.code, int) else 1
        return code, capsys.readouterr().err

    (tmp_path / "rules.json").write_text(json.dumps(TO_TITAN))
    code, err = convert(
        tmp_path / "m.safetensors", tmp_path / "t", "--rename-file", tmp_path / "rules.json",
        "--rename", r"layers\.0\.(.*)=blocks.0.\1", "-q",
    )  # fmt: skip
    assert code == 0, err
    names = set(read_metadata(tmp_path / "t").state_dict_metadata)
    # the file's rules come first, then --rename, and the first match wins: the --rename rule
    # sees only names the file's rules left alone (none here)
    assert names == titan_names(1)
    code, err = convert(tmp_path / "t", tmp_path / "b.safetensors", "--rename", r"layers\.0\.(.*)=blocks.0.\1", "-q")
    assert code == 0, err
    assert {n for n in st.load_file(tmp_path / "b.safetensors") if n.startswith("blocks.0.")} == {
        n.replace("layers.0.", "blocks.0.") for n in titan_names(1) if n.startswith("layers.0.")
    }
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    code, err = convert(tmp_path / "m.safetensors", tmp_path / "x", "--rename-file", bad)
    # A usage error naming the flag (issue 31, friction 1), refused before anything is written.
    assert code == 2 and "argument --rename-file: " in err and "JSON list" in err
    assert not (tmp_path / "x").exists()
