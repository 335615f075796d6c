"""What the sixth review round found, each pinned by a test: a loop of symbolic links named as the
source was reported as "no such file or directory"; a DCP directory whose ``.metadata`` is a FIFO
or a dangling link was "cannot tell the format" (not the refusal naming it); a safetensors file
changed after the job opened it failed in the worker with the library's bare message, naming
neither the file nor the change."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch

import parallel_dcp
from parallel_dcp.cli import main
from parallel_dcp.errors import CorruptCheckpointError, UnsafeCheckpointError
from parallel_dcp.formats import fast_read, open_source


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """The command run in this process (main(argv), what ``python -m parallel_dcp`` runs; the
    program itself is run by tests/test_cli.py): its exit code and stderr."""
    code = main(list(args))
    return code, capsys.readouterr().err


def test_a_loop_of_links_is_named_as_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.pt").symlink_to("b.pt")
    (tmp_path / "b.pt").symlink_to("a.pt")
    with pytest.raises(OSError, match="too many levels of symbolic links") as caught:
        parallel_dcp.load(tmp_path / "a.pt")
    assert not isinstance(caught.value, FileNotFoundError)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(OSError, match="is a file, not a directory"):
        parallel_dcp.load(tmp_path / "file" / "x.pt")
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        open_source(tmp_path / "absent.pt")
    code, err = _cli(capsys, "inspect", str(tmp_path / "a.pt"))
    assert code == 1
    assert "too many levels of symbolic links" in err and "[Errno" not in err


def test_a_dcp_metadata_that_is_a_fifo_or_a_dangling_link_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / ".metadata")
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata is not a regular file"):
        open_source(fifo)
    dangling = tmp_path / "dangling"
    dangling.mkdir()
    (dangling / ".metadata").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata is a symlink"):
        open_source(dangling)
    code, err = _cli(capsys, "convert", str(fifo), str(tmp_path / "out"))
    assert code == 1 and "not a regular file" in err
    assert not (tmp_path / "out").exists()


def test_a_safetensors_file_changed_after_it_was_opened_is_named(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    st.save_file({"w": torch.ones(1024, 16)}, file)
    source = open_source(file)
    with open(file, "r+b") as f:  # cut while the job runs (as a copy still arriving, or another writer)
        f.truncate(100)
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors can no longer be read.*changed or went away"):
        source.read(["w"])


def _hf(folder: Path, value: float = 1.0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    st.save_file({"a": torch.full((64,), value), "b": torch.ones(8)}, folder / "model.safetensors")
    (folder / "config.json").write_text('{"model_type": "x"}')
    return folder


def _tree(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


def test_an_overwrite_replaces_a_copied_folders_files_and_keeps_the_rest(tmp_path: Path) -> None:
    """A release's ``original/`` holds Meta's weights beside ``params.json``: an overwrite that
    copies an ``original/params.json`` replaced the whole folder (deleting ``consolidated.00.pth``
    and the user's notes), and deleted the job's own source file where it lay in that folder."""
    src = _hf(tmp_path / "src", 2.0)
    (src / "original").mkdir()
    (src / "original" / "params.json").write_text('{"dim": 2}')
    dst = _hf(tmp_path / "dst")
    (dst / "original" / "deeper").mkdir(parents=True)
    (dst / "original" / "consolidated.00.pth").write_bytes(b"the user's weights")
    (dst / "original" / "deeper" / "NOTES.txt").write_text("notes")
    (dst / "original" / "params.json").write_text('{"dim": 1}')
    parallel_dcp.convert(src, dst, to="safetensors", overwrite=True, workers=1)
    assert _tree(dst / "original") == {
        "consolidated.00.pth": b"the user's weights",
        "deeper/NOTES.txt": b"notes",
        "params.json": b'{"dim": 2}',
    }
    assert torch.equal(parallel_dcp.load(dst)["a"], torch.full((64,), 2.0))
    assert parallel_dcp.verify(dst).ok
    assert not [p.name for p in dst.iterdir() if p.name.startswith(".") and p.name != ".parallel_dcp.json"]

    # the job's source inside the folder a copy goes into: kept (it is not copied over)
    own = dst / "original" / "consolidated.00.pth"
    torch.save({"a": torch.arange(4.0)}, own)
    before = own.read_bytes()
    parallel_dcp.convert(own, dst, to="safetensors", overwrite=True, copy_files_from=src, workers=1)
    assert own.read_bytes() == before
    assert torch.equal(parallel_dcp.load(dst)["a"], torch.arange(4.0))
    # ... and refused where a copied file would replace it (a sentence-transformers module's weights)
    dense = dst / "2_Dense" / "model.safetensors"
    dense.parent.mkdir()
    st.save_file({"linear.weight": torch.ones(2, 2)}, dense)
    before = dense.read_bytes()
    base = _hf(tmp_path / "base")
    (base / "modules.json").write_text('[{"idx": 0, "name": "1", "path": "2_Dense", "type": "x.Dense"}]')
    (base / "2_Dense").mkdir()
    st.save_file({"linear.weight": torch.zeros(2, 2)}, base / "2_Dense" / "model.safetensors")
    with pytest.raises(parallel_dcp.InvalidDestinationError, match="it is a file of the source"):
        parallel_dcp.convert(dense, dst, to="safetensors", overwrite=True, copy_files_from=base, workers=1)
    assert dense.read_bytes() == before


@pytest.mark.parametrize(
    "planted", ["folder where a file goes", "file where a folder goes", "link where a folder goes"]
)
def test_a_copy_that_cannot_merge_is_refused_before_anything_is_written(tmp_path: Path, planted: str) -> None:
    src = _hf(tmp_path / "src", 2.0)
    (src / "original" / "sub").mkdir(parents=True)
    (src / "original" / "params.json").write_text("{}")
    (src / "original" / "sub" / "x.json").write_text("{}")
    dst = _hf(tmp_path / "dst")
    (dst / "original").mkdir()
    (tmp_path / "elsewhere").mkdir()
    if planted == "folder where a file goes":
        (dst / "original" / "params.json").mkdir()
        (dst / "original" / "params.json" / "mine").write_text("kept")
    elif planted == "file where a folder goes":
        (dst / "original" / "sub").write_text("kept")
    else:
        (dst / "original" / "sub").symlink_to(tmp_path / "elsewhere")
    before = _tree(dst)
    with pytest.raises(parallel_dcp.InvalidDestinationError, match=r"original/(params\.json|sub).*nothing was written"):
        parallel_dcp.convert(src, dst, to="safetensors", overwrite=True, workers=1)
    assert _tree(dst) == before
    assert not list((tmp_path / "elsewhere").iterdir())


@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_a_shard_swapped_for_a_link_out_after_listing_is_refused(tmp_path: Path, kind: str) -> None:
    """Someone who can write the source folder swaps a shard for a symlink to a file elsewhere
    once the job has listed and checked the folder: the worker opened it by name and read the
    file outside (the output held its values)."""
    src, private = tmp_path / "src", tmp_path / "private"
    src.mkdir()
    private.mkdir()
    suffix, index = (
        (".safetensors", "model.safetensors.index.json")
        if kind == "safetensors"
        else (".bin", "pytorch_model.bin.index.json")
    )
    names = [f"model-0000{i}-of-00002{suffix}" for i in (1, 2)]

    def write(tensors: dict[str, torch.Tensor], path: Path) -> None:
        st.save_file(tensors, path) if kind == "safetensors" else torch.save(tensors, path)

    write({"a": torch.arange(8.0)}, src / names[0])
    write({"b": torch.ones(8)}, src / names[1])
    write({"b": torch.full((8,), 42.0)}, private / f"secret{suffix}")
    (src / index).write_text(json.dumps({"metadata": {}, "weight_map": {"a": names[0], "b": names[1]}}))
    source = open_source(src)
    (src / "swap").symlink_to(private / f"secret{suffix}")
    os.replace(src / "swap", src / names[1])
    with pytest.raises(UnsafeCheckpointError, match=rf"{names[1]} is a symlink; refusing to follow it"):
        source.read(["b"])


def test_a_side_file_that_grows_after_it_was_chosen_is_refused_at_the_commit(tmp_path: Path) -> None:
    """Side files are sized (and checked against the memory limit) when chosen and read at the
    commit: one grown to 400 MiB meanwhile was read whole into the coordinator under a 64 MiB
    limit and copied into the output."""
    from parallel_dcp.jobs.copy_files import files_to_copy, read_copies

    src = _hf(tmp_path / "src")
    (src / "notes.txt").write_text("small\n")
    source = open_source(src)
    try:
        copies = files_to_copy(
            source, directory_output=True, copy_files=True, copy_files_from=None, storage_options=None, limit=2**20
        )
    finally:
        source.close()
    assert copies.sizes["notes.txt"] == 6
    os.truncate(src / "notes.txt", 400 * 2**20)  # sparse
    with pytest.raises(ValueError, match=r"notes\.txt, a file to copy beside the weights, grew past the 6 B"):
        read_copies(copies)
    assert read_copies(copies, ["config.json"]) == {"config.json": b'{"model_type": "x"}'}
    os.truncate(src / "notes.txt", 3)  # shrunk: read as it is now (within what was counted)
    assert read_copies(copies, ["notes.txt"]) == {"notes.txt": b"sma"}


def test_a_cache_snapshot_named_through_a_link_is_a_source(tmp_path: Path) -> None:
    """``mymodel -> hub/models--org--m/snapshots/abc``: the snapshot's own links into ``blobs/``
    were refused as leading out, though the same snapshot named directly converts."""
    repo = tmp_path / "hub" / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    made = _hf(tmp_path / "made")
    for name in ("model.safetensors", "config.json"):
        (made / name).rename(repo / "blobs" / f"{name}.blob")
        (repo / "snapshots" / "abc" / name).symlink_to(f"../../blobs/{name}.blob")
    (tmp_path / "mymodel").symlink_to(repo / "snapshots" / "abc")
    parallel_dcp.convert(tmp_path / "mymodel", tmp_path / "out", to="safetensors", workers=1)
    assert _tree(tmp_path / "out")["config.json"] == b'{"model_type": "x"}'
    assert torch.equal(parallel_dcp.load(tmp_path / "out")["a"], torch.ones(64))


def test_an_output_written_into_its_source_is_not_copied_into_itself(tmp_path: Path) -> None:
    """``convert src src/out --overwrite`` took the last output for one of the source's side
    folders: each run nested one more copy (``src/out/out/out/...``)."""
    src = _hf(tmp_path / "src")
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text("{}")
    for _ in range(3):
        parallel_dcp.convert(src, src / "out", to="safetensors", overwrite=True, workers=1)
    assert sorted(_tree(src / "out")) == ["1_Pooling/config.json", "config.json", "model.safetensors"]


def _tied() -> dict[str, torch.Tensor]:
    shared = torch.zeros(256, 64)
    return {"a": shared, "b": shared, "c": torch.zeros(256, 64)}


def _overlapping() -> dict[str, torch.Tensor]:
    base = torch.zeros(256 * 64 + 128 * 64)
    return {"a": base[: 256 * 64].view(256, 64), "b": base[128 * 64 :].view(256, 64), "c": torch.zeros(256, 64)}


@pytest.mark.parametrize("template", [_tied, _overlapping], ids=["tied", "overlapping views"])
@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_targets_sharing_memory_across_keys_load_as_stock_loads_them(
    tmp_path: Path, template: Any, writer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A template whose keys share memory (a tied model) loaded from a checkpoint holding other
    values under those keys: the reading threads filled both at once, giving another mix each
    load and bytes torn between the two (1.0 and 2.0 read as 4.0). Now the last key in the
    template's order holds the shared bytes, as stock's key-by-key copy leaves them."""
    import torch.distributed.checkpoint as dcp

    state = {"a": torch.full((256, 64), 1.0), "b": torch.full((256, 64), 2.0), "c": torch.full((256, 64), 3.0)}
    where = tmp_path / "ckpt"
    if writer == "ours":
        parallel_dcp.save(state, where, workers=2, chunk_size="16KiB")
    else:
        dcp.save(state, checkpoint_id=where)
    expected = template()
    dcp.load(expected, checkpoint_id=where)
    assert set(torch.unique(expected["a"]).tolist()) <= {1.0, 2.0}
    batches: list[set[str]] = []  # the keys each parallel read fills
    read_requests = fast_read.read_requests

    def recorded(where: Any, requests: Any, *args: Any, small: Any = None, **kwargs: Any) -> Any:
        requests = list(requests)
        keys = {r.item.dest_index.fqn for r in requests} | {e[2] for es in (small or {}).values() for e in es}
        batches.append(keys)
        return read_requests(where, requests, *args, small=small, **kwargs)

    monkeypatch.setattr(fast_read, "read_requests", recorded)
    for _ in range(3):
        for reader in ("load", "FastReader"):
            batches.clear()
            into = template()
            if reader == "load":
                parallel_dcp.load(where, into=into, workers=4)
            else:
                dcp.load(into, storage_reader=parallel_dcp.FastReader(where, workers=4))
            assert all(torch.equal(into[k], expected[k]) for k in expected), reader
            if template is _overlapping:
                continue  # (the rows of "b" that "a" does not overlap may be read beside it)
            # never filled at once; "b" after "a"
            assert not any({"a", "b"} <= batch for batch in batches), (reader, batches)
            with_a = [n for n, batch in enumerate(batches) if "a" in batch]
            with_b = [n for n, batch in enumerate(batches) if "b" in batch]
            assert max(with_a) < min(with_b), (reader, batches)


def test_tied_targets_read_from_a_hugging_face_folder_load_as_stock(tmp_path: Path) -> None:
    st.save_file({"a": torch.full((256, 64), 1.0), "b": torch.full((256, 64), 2.0)}, tmp_path / "model.safetensors")
    import torch.distributed.checkpoint as dcp

    torch.save({"a": torch.full((256, 64), 1.0), "b": torch.full((256, 64), 2.0)}, tmp_path / "model.pt")
    for _ in range(3):
        into = _tied()
        del into["c"]
        dcp.load(into, storage_reader=parallel_dcp.FastReader(tmp_path, workers=4))
        assert torch.equal(into["a"], torch.full((256, 64), 2.0))
        for source in (tmp_path / "model.safetensors", tmp_path / "model.pt"):
            into = _tied()
            del into["c"]
            parallel_dcp.load(source, into=into, workers=4)
            assert torch.equal(into["a"], torch.full((256, 64), 2.0)), source


def test_which_keys_are_read_after_the_others() -> None:
    """Adjacent views are no overlap (FSDP's flat buffer); a chain of overlaps is one run, and in
    each run every key but the first in the template's order is read later, in that order."""
    from parallel_dcp.formats.aliased_targets import aliased_later

    flat = torch.zeros(100)
    adjacent = {"x": flat[:50], "y": flat[50:]}
    assert aliased_later(list(adjacent), [], adjacent.items()) == []
    chain = {"c": flat[40:60], "a": flat[:30], "b": flat[20:45], "d": torch.zeros(3), "e": flat[70:80]}
    assert aliased_later(list(chain), [], chain.items()) == ["a", "b"]
    strided = {"even": flat.view(50, 2)[:, 0], "odd": flat.view(50, 2)[:, 1]}  # interleaved: no byte shared
    assert aliased_later(list(strided), [], strided.items()) == []
    fused = torch.zeros(8, 96)  # a fused QKV weight held as column thirds: no byte shared
    thirds = {"q": fused[:, :32], "k": fused[:, 32:64], "v": fused[:, 64:]}
    assert aliased_later(list(thirds), [], thirds.items()) == []
    crossing = {"q": fused[:, :40], "k": fused[:, 32:64]}
    assert aliased_later(list(crossing), [], crossing.items()) == ["k"]
    small = [[(0, 999, "s", flat[:10], None, torch.float32, (10,), flat[:10].data_ptr())]]
    assert aliased_later(["t", "s"], small, [("t", flat[5:20])]) == ["s"]


@pytest.mark.parametrize("killed", ["a worker", "the fork server"])
def test_a_saver_whose_idle_worker_died_starts_new_ones(tmp_path: Path, killed: str) -> None:
    """A Saver's worker killed between saves (the OOM killer, an admin; or its fork server's end)
    failed the next save with "died with SIGKILL while running task 0", blaming the save and
    advising fewer workers, though it ran no task of it."""
    import signal
    import time

    from parallel_dcp._compat import fork_server_pid

    state = {"a": torch.randn(1000), "b": torch.ones(300)}
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(state, tmp_path / "first")
        pool = saver._live()._pool
        assert pool is not None
        before = set(pool.pids)
        os.kill(pool.pids[0] if killed == "a worker" else fork_server_pid(), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not pool.dead() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.warns(RuntimeWarning, match="a worker died while idle"):
            saver.save(state, tmp_path / "second")
        assert saver._live()._pool is not None and not before & set(saver._live()._pool.pids)
    assert torch.equal(parallel_dcp.load(tmp_path / "second")["a"], state["a"])


def test_a_resume_takes_one_chunk_size_however_it_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--chunk-size 512KiB`` then ``524288``: refused as "chunk_size was '512KiB', now '524288'"."""
    from tests.test_resume import _fail_midway, _source

    src, _ = _source(tmp_path)
    out = tmp_path / "out"
    _fail_midway(monkeypatch, src, out, "dcp", chunk_size="512KiB")
    monkeypatch.undo()
    result = parallel_dcp.convert(src, out, workers=2, resume=True, chunk_size=524288)
    assert result.resumed
    _fail_midway(monkeypatch, src, tmp_path / "other", "dcp", chunk_size="512KiB")
    monkeypatch.undo()
    with pytest.raises(parallel_dcp.ResumeError, match="chunk_size was 524288, now 262144"):  # another size
        parallel_dcp.convert(src, tmp_path / "other", workers=2, resume=True, chunk_size="256KiB")


def test_a_tuple_where_a_list_was_saved_is_named_with_what_the_checkpoint_holds(tmp_path: Path) -> None:
    parallel_dcp.save({"nest": {"lst": [torch.ones(3), torch.zeros(2)]}, "w": torch.ones(2)}, tmp_path / "c")
    into = {"nest": {"lst": (torch.empty(3), torch.empty(2))}, "w": torch.empty(2)}
    with pytest.raises(parallel_dcp.KeyNotFoundError, match=r"'nest\.lst.*holds \['nest\.lst\.0', 'nest\.lst\.1'\]"):
        parallel_dcp.load(tmp_path / "c", into=into)
