"""A Hugging Face folder source means the weights transformers loads from it (review s15 rev1 F9, F5).

transformers 5 (modeling_utils.py ``_get_resolved_checkpoint_files``) loads the first of
``model.safetensors``, ``model.safetensors.index.json``, ``pytorch_model.bin``,
``pytorch_model.bin.index.json`` it finds in a folder and ignores the rest; the folders here hold a
second set beside that one, with other values, and every reader (open, convert, load, inspect,
``--dry-run``) must take the client's. (The client suite, tests_clients/hf/test_folder_choice.py,
loads the same folders in transformers itself.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import parallel_dcp
from parallel_dcp.formats import detect_format, folder_weights, open_source
from parallel_dcp.jobs.inspect import inspect_checkpoint


def _values(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(8, 16, generator=generator) for i in range(3)}


def _write(values: dict[str, torch.Tensor], path: Path) -> None:
    """``values`` as a safetensors file or a torch.save file, by ``path``'s suffix."""
    if path.suffix == ".safetensors":
        save_file(values, path)
    else:
        torch.save(values, path)


def _sharded(folder: Path, values: dict[str, torch.Tensor], fmt: str) -> None:
    """``values`` as two shards and their index, as transformers writes them (``fmt``: safetensors or torch)."""
    suffix, index = (
        (".safetensors", "model.safetensors.index.json")
        if fmt == "safetensors"
        else (".bin", "pytorch_model.bin.index.json")
    )
    stem = "model" if fmt == "safetensors" else "pytorch_model"
    keys = list(values)
    shards = {f"{stem}-0000{i + 1}-of-00002{suffix}": part for i, part in enumerate((keys[:2], keys[2:]))}
    for name, part in shards.items():
        chunk = {k: values[k] for k in part}
        _write(chunk, folder / name)
    weight_map = {k: name for name, part in shards.items() for k in part}
    (folder / index).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_single_file_before_an_index_beside_it(tmp_path: Path, fmt: str) -> None:
    """F9: model.safetensors (or pytorch_model.bin) beside an older upload's index and shards: the
    single file is what transformers loads, so it is what every reader reads."""
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    old, new = _values(0), _values(1)
    _sharded(folder, old, fmt)
    lone = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    _write(new, folder / lone)

    source = open_source(folder)
    assert [Path(f).name for f in source.files] == [lone]
    source.close()
    assert _equal(parallel_dcp.load(folder), new)
    parallel_dcp.convert(folder, tmp_path / "out", workers=2)
    assert _equal(parallel_dcp.load(tmp_path / "out"), new)
    assert [f["name"] for f in inspect_checkpoint(folder)["files"]] == [lone]  # (not the unread index)
    plan = parallel_dcp.convert(folder, tmp_path / "plan", workers=2, dry_run=True)
    assert any(
        f"reads {lone} " in note and "model-00001-of-00002" not in note.split("not read")[0] for note in plan.notes
    )
    assert any("not read: " in note and "-00001-of-00002" in note for note in plan.notes)


def test_pytorch_model_bin_beside_a_peft_adapter(tmp_path: Path) -> None:
    """F5: pytorch_model.bin (the model) beside adapter_model.safetensors (a PEFT adapter): the
    folder is a torch folder, as transformers loads it; the adapter is never taken for the model."""
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "adapter_config.json").write_text("{}")
    save_file({"lora_A": torch.ones(4, 4)}, folder / "adapter_model.safetensors")
    model = _values(0)
    torch.save(model, folder / "pytorch_model.bin")

    assert detect_format(folder) == "torch"
    assert _equal(parallel_dcp.load(folder), model)
    parallel_dcp.convert(folder, tmp_path / "out", to="torch", workers=2)
    assert _equal(parallel_dcp.load(tmp_path / "out"), model)
    source = open_source(folder)
    assert folder_weights(source) == (["pytorch_model.bin"], ["adapter_model.safetensors"])
    source.close()


def test_the_client_order_across_formats(tmp_path: Path) -> None:
    """The safetensors index comes before pytorch_model.bin (the hub's layout after the safetensors
    conversion bot: both sets, the same values); model.safetensors before all."""
    folder = tmp_path / "repo"
    folder.mkdir()
    values = _values(0)
    _sharded(folder, values, "safetensors")
    torch.save(_values(1), folder / "pytorch_model.bin")
    assert detect_format(folder) == "safetensors"
    assert _equal(parallel_dcp.load(folder), values)


def test_a_folder_with_no_standard_name(tmp_path: Path) -> None:
    """No client name: every .safetensors is read as before, an adapter beside them not; an
    adapter alone (a PEFT folder) is read."""
    folder = tmp_path / "mistral"
    folder.mkdir()
    model = _values(0)
    save_file(model, folder / "consolidated.safetensors")
    save_file({"lora_A": torch.ones(4, 4)}, folder / "adapter_model.safetensors")
    assert _equal(parallel_dcp.load(folder), model)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file({"lora_A": torch.ones(4, 4)}, adapter / "adapter_model.safetensors")
    assert sorted(parallel_dcp.load(adapter)) == ["lora_A"]


def test_two_sets_without_an_index_are_refused_not_merged(tmp_path: Path) -> None:
    """Mistral's ``consolidated.safetensors`` beside Hugging Face shards whose index a filtered
    download left out (review s15 rev2 F5): the two copies were converted as one checkpoint."""
    folder = tmp_path / "mistral"
    folder.mkdir()
    _sharded(folder, _values(0), "safetensors")
    (folder / "model.safetensors.index.json").unlink()
    save_file(_values(1), folder / "consolidated.safetensors")
    with pytest.raises(parallel_dcp.CorruptCheckpointError, match=r"two sets of weights.*consolidated\.safetensors"):
        parallel_dcp.convert(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_variant_beside_its_plain_file_is_not_read(tmp_path: Path) -> None:
    """A diffusers folder with ``diffusion_pytorch_model.safetensors`` and its ``.fp16`` variant
    (review s15 rev2 F3): diffusers loads the plain file; both read, every tensor was "in two shards"."""
    folder = tmp_path / "unet"
    folder.mkdir()
    plain = _values(0)
    save_file(plain, folder / "diffusion_pytorch_model.safetensors")
    save_file({k: v.half() for k, v in _values(1).items()}, folder / "diffusion_pytorch_model.fp16.safetensors")
    parallel_dcp.convert(folder, tmp_path / "out")
    assert _equal(parallel_dcp.load(tmp_path / "out"), plain)


def _named_folder(tmp_path: Path, named: object) -> Path:
    """A folder whose ``model.safetensors`` holds seed 0 and whose config.json names ``named`` as
    ``transformers_weights`` (absent: ``...``)."""
    folder = tmp_path / "m"
    folder.mkdir()
    save_file(_values(0), folder / "model.safetensors")
    config: dict[str, object] = {"model_type": "bert"}
    if named is not ...:
        config["transformers_weights"] = named
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _index_of(folder: Path, index: str, values: dict[str, torch.Tensor], shards_in: str = "") -> None:
    """``values`` as two shards in ``folder`` (``c-1``, ``c-2``; in its subfolder ``shards_in``
    and named so, ``sub/c-1.safetensors``, where given), and the index ``index`` (a path below
    ``folder``) naming them, as transformers reads an index: shard names relative to the folder,
    not to the index (a name below it was refused as "may be malicious": review s17 F2)."""
    keys = list(values)
    weight_map = {}
    if shards_in:
        (folder / shards_in).mkdir(exist_ok=True)
    for name, part in (("c-1.safetensors", keys[:2]), ("c-2.safetensors", keys[2:])):
        name = f"{shards_in}/{name}" if shards_in else name
        save_file({k: values[k] for k in part}, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    (folder / index).parent.mkdir(parents=True, exist_ok=True)
    (folder / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _sub(folder: Path, name: str, values: dict[str, torch.Tensor]) -> None:
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    _write(values, folder / name)


# (transformers_weights, how to lay the folder out, the files read: the names a dry run shows)
FOLLOWED = [
    ("custom.safetensors", lambda f: _sub(f, "custom.safetensors", _values(1)), ["custom.safetensors"]),
    ("./custom.safetensors", lambda f: _sub(f, "custom.safetensors", _values(1)), ["custom.safetensors"]),
    ("sub/custom.safetensors", lambda f: _sub(f, "sub/custom.safetensors", _values(1)), ["sub/custom.safetensors"]),
    (
        "custom.safetensors.index.json",
        lambda f: _index_of(f, "custom.safetensors.index.json", _values(1)),
        ["c-1.safetensors", "c-2.safetensors", "custom.safetensors.index.json"],
    ),
    (
        "sub/c.safetensors.index.json",
        lambda f: _index_of(f, "sub/c.safetensors.index.json", _values(1)),
        ["sub/c.safetensors.index.json", "c-1.safetensors", "c-2.safetensors"],
    ),
    (
        "model.safetensors.index.json",  # (before model.safetensors, which the client's order reads first)
        lambda f: _index_of(f, "model.safetensors.index.json", _values(1)),
        ["c-1.safetensors", "c-2.safetensors", "model.safetensors.index.json"],
    ),
    (
        "sub/c.safetensors.index.json",
        lambda f: _index_of(f, "sub/c.safetensors.index.json", _values(1), shards_in="sub"),
        ["sub/c.safetensors.index.json", "sub/c-1.safetensors", "sub/c-2.safetensors"],
    ),
    (
        "model.safetensors.index.json",
        lambda f: _index_of(f, "model.safetensors.index.json", _values(1), shards_in="sub"),
        ["model.safetensors.index.json", "sub/c-1.safetensors", "sub/c-2.safetensors"],
    ),
    ("adapter_model.bin", lambda f: _sub(f, "adapter_model.bin", _values(1)), ["adapter_model.bin"]),
    (None, lambda f: _sub(f, "custom.safetensors", _values(1)), ["model.safetensors"]),  # (JSON null: none named)
]


@pytest.mark.parametrize(("named", "lay_out", "read"), FOLLOWED, ids=[str(row[0]) for row in FOLLOWED])
def test_config_transformers_weights_is_followed(
    tmp_path: Path, named: str | None, lay_out: Callable[[Path], None], read: list[str]
) -> None:
    """``config.json``'s ``transformers_weights`` is the file transformers 5 loads before any other
    (review s15 rev2 F1: we converted ``model.safetensors`` instead, silently; then refused the
    folder): every reader reads the file it names, as transformers 5.25 does (its client suite:
    tests_clients/hf/test_folder_choice.py), and a dry run names it."""
    folder = _named_folder(tmp_path, named)
    lay_out(folder)
    want = _values(0) if named is None else _values(1)

    assert detect_format(folder) == ("torch" if named == "adapter_model.bin" else "safetensors")
    assert _equal(parallel_dcp.load(folder), want)
    parallel_dcp.convert(folder, tmp_path / "out", workers=2)
    assert _equal(parallel_dcp.load(tmp_path / "out"), want)
    source = open_source(folder)
    assert sorted(folder_weights(source)[0]) == sorted(read)
    source.close()
    plan = parallel_dcp.convert(folder, tmp_path / "plan", workers=2, dry_run=True, rename=[(r"(.*)", r"x.\1")])
    if named is not None:  # (a view of the source, renamed here, reads and says what it does)
        assert any(
            f"reads {', '.join(read)} of " in n and "config.json names (transformers_weights)" in n for n in plan.notes
        )
    # A Hugging Face output holds its own shards: its config.json names none of the source's files.
    parallel_dcp.convert(folder, tmp_path / "hf", to="safetensors", workers=2)
    assert "transformers_weights" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    assert _equal(parallel_dcp.load(tmp_path / "hf"), want)


def _link_out(folder: Path) -> None:
    _write(_values(1), folder.parent / "outside.safetensors")
    (folder / "custom.safetensors").symlink_to(folder.parent / "outside.safetensors")


def _folder_link_out(folder: Path) -> None:
    _sub(folder.parent, "elsewhere/custom.safetensors", _values(1))
    (folder / "sub").symlink_to(folder.parent / "elsewhere")


# (transformers_weights, how to lay the folder out, the error, its message). transformers 5.25
# fails on each too (a ValueError, FileNotFoundError, AttributeError or OSError), but for the links
# out of the folder and the absolute name inside it, which it follows and we never do.
REFUSED = [
    ("../custom.safetensors", None, parallel_dcp.UnsafeCheckpointError, r"absolute name or one with '\.\.'"),
    ("sub/../custom.safetensors", None, parallel_dcp.UnsafeCheckpointError, r"absolute name or one with '\.\.'"),
    ("/abs/custom.safetensors", None, parallel_dcp.UnsafeCheckpointError, r"Name the file relative to the folder"),
    ("custom.safetensors", _link_out, parallel_dcp.UnsafeCheckpointError, r"leads out of .*refusing to follow it"),
    ("sub/custom.safetensors", _folder_link_out, parallel_dcp.UnsafeCheckpointError, r"leads out of"),
    ("missing.safetensors", None, FileNotFoundError, r"'missing\.safetensors', which does not exist"),
    ("c.safetensors.index.json", None, FileNotFoundError, r"which does not exist"),
    (
        "custom.safetensors",
        lambda f: (f / "custom.safetensors").mkdir(),
        parallel_dcp.CorruptCheckpointError,
        "a folder",
    ),
    ("", None, parallel_dcp.CorruptCheckpointError, "which transformers refuses"),
    (5, None, parallel_dcp.CorruptCheckpointError, "transformers_weights 5, which transformers refuses"),
    ("pytorch_model.bin", None, parallel_dcp.CorruptCheckpointError, "which transformers refuses"),
    ("custom.pt", None, parallel_dcp.CorruptCheckpointError, "which transformers refuses"),
]


@pytest.mark.parametrize(
    ("named", "lay_out", "error", "said"), REFUSED, ids=[f"{row[0]!s}-{i}" for i, row in enumerate(REFUSED)]
)
def test_config_transformers_weights_the_client_fails_on_is_refused(
    tmp_path: Path, named: object, lay_out: Callable[[Path], None] | None, error: type[Exception], said: str
) -> None:
    """A name transformers fails on (or one leading out of the folder) is refused by every reader,
    by name, before anything is written; never passed over for ``model.safetensors``."""
    folder = _named_folder(tmp_path, named)
    if lay_out is not None:
        lay_out(folder)
    with pytest.raises(error, match=said):
        parallel_dcp.convert(folder, tmp_path / "out", workers=2)
    assert not (tmp_path / "out").exists()
    with pytest.raises(error, match=said):
        parallel_dcp.convert(folder, tmp_path / "plan", workers=2, dry_run=True)
    with pytest.raises(error, match=said):
        parallel_dcp.load(folder)
    with pytest.raises(error, match=said):
        inspect_checkpoint(folder)


def test_a_config_json_linked_out_of_the_folder_is_refused_not_passed_over(tmp_path: Path) -> None:
    """config.json a link out of the folder (a shared config) naming ``custom.safetensors``:
    transformers follows the link and loads ``custom.safetensors``; we never follow a link out, and
    converted ``model.safetensors`` instead, silently (review s17 F1). It is refused by name: what
    the folder means cannot be known without it."""
    folder = _named_folder(tmp_path, "custom.safetensors")
    save_file(_values(1), folder / "custom.safetensors")
    (folder / "config.json").rename(tmp_path / "shared.json")
    (folder / "config.json").symlink_to(tmp_path / "shared.json")
    said = r"config\.json.*(leads out of|symlink).*transformers_weights"
    with pytest.raises(parallel_dcp.UnsafeCheckpointError, match=said):
        parallel_dcp.convert(folder, tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()
    with pytest.raises(parallel_dcp.UnsafeCheckpointError, match=said):
        parallel_dcp.load(folder)


def test_config_json_is_read_once_an_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening a folder source lists it and reads its config.json once (detecting the format and
    choosing the files take the one look), by the one rule for a source's small files; so do
    ``load`` and ``inspect``, which tell the format before they open the source."""
    from parallel_dcp.formats import folder_files

    folder = _named_folder(tmp_path, "custom.safetensors")
    save_file(_values(1), folder / "custom.safetensors")
    reads: list[str] = []
    real = folder_files.read_in_tree

    def counted(path: Path, tree: Path, *, limit: int) -> bytes:
        reads.append(path.name)
        return real(path, tree, limit=limit)

    monkeypatch.setattr(folder_files, "read_in_tree", counted)
    source = open_source(folder)
    source.close()
    assert reads == ["config.json"]
    assert [Path(f).name for f in source.files] == ["custom.safetensors"]
    for job in (parallel_dcp.load, inspect_checkpoint):  # (each tells the format, then opens the source)
        reads.clear()
        job(folder)
        assert reads == ["config.json"], job


@pytest.mark.parametrize("lone", ["dangling link", "folder"])
def test_a_client_name_that_is_no_file_is_passed_over(tmp_path: Path, lone: str) -> None:
    """``model.safetensors`` a dangling link or a folder beside an index and its shards: transformers
    (``os.path.isfile``) loads the shards; we refused the folder (review s15 rev2 F2)."""
    folder = tmp_path / "m"
    folder.mkdir()
    _sharded(folder, _values(0), "safetensors")
    if lone == "folder":
        (folder / "model.safetensors").mkdir()
    else:
        (folder / "model.safetensors").symlink_to(tmp_path / "gone.safetensors")
    assert detect_format(folder) == "safetensors"
    parallel_dcp.convert(folder, tmp_path / "out")
    assert _equal(parallel_dcp.load(tmp_path / "out"), _values(0))


def test_a_named_file_added_to_a_recorded_folder_is_read_unchecked_and_said(tmp_path: Path) -> None:
    """Our own output (its ``.parallel_dcp.json`` lists its files) whose config.json is edited to
    name a file added in a subfolder: that file is what is read, and, carrying no record, is named
    as read unchecked (a file below the folder's top was never looked for among the added ones)."""
    save_file(_values(0), tmp_path / "model.safetensors")
    parallel_dcp.convert(tmp_path / "model.safetensors", tmp_path / "rec", to="safetensors", workers=1)
    (tmp_path / "rec" / "config.json").write_text(json.dumps({"transformers_weights": "sub/w.safetensors"}))
    _sub(tmp_path / "rec", "sub/w.safetensors", _values(1))

    with pytest.warns(parallel_dcp.SourceNotCheckedWarning, match=r"sub/w\.safetensors, which its reads open"):
        parallel_dcp.convert(tmp_path / "rec", tmp_path / "out", workers=1)
    assert _equal(parallel_dcp.load(tmp_path / "out"), _values(1))
