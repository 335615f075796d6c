"""A conversion checks every checksummed source file it reads any bytes of, not only the files one
task reads whole.

The default conversion of a one-file source (a safetensors file carrying its checksums, a torch.save
file with its manifest) or of a DCP shard to DCP on several workers splits the file's tensors between
tasks (and a large tensor into row ranges): no task read all of the file, so none hashed it, and a
flipped byte passed into an output with fresh checksums that ``verify`` accepted. Now each such file
is hashed whole by one of the tasks that read it, and the commit waits for every verdict.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import parallel_dcp
from parallel_dcp.jobs.source_check import SOURCE_CHECK_BYTES
from tests.conftest import save_with_a_stale_manifest


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {f"layer{i}.weight": torch.randn(96 + i, 48, generator=gen) for i in range(6)}


def _big_state() -> dict[str, torch.Tensor]:
    """One tensor a conversion with a small chunk size splits into row ranges."""
    return {"embed.weight": torch.randn(512, 128, generator=torch.Generator().manual_seed(3))}


def _flip_inside(path: Path, tensor: torch.Tensor) -> None:
    """Flip one byte in the middle of ``tensor``'s bytes in ``path``, as a device flips it (the
    modification time stays: a file written after its record may be a rewrite, and its refusal says so)."""
    raw = tensor.contiguous().numpy().tobytes()
    data = path.read_bytes()
    at = data.find(raw[:256])
    assert at >= 0 and data.find(raw[:256], at + 1) < 0
    at += len(raw) // 2
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0x5A]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def _single(tmp: Path, name: str, state: dict[str, torch.Tensor]) -> Path:
    """A single file of ``name``'s format written by parallel_dcp (its checksums recorded)."""
    dcp = tmp / f"made_{name}_dcp"
    parallel_dcp.save(state, dcp, workers=1)
    src = tmp / name
    parallel_dcp.convert(dcp, src, workers=1)
    return src


def safetensors_file(tmp: Path) -> tuple[Path, Path]:
    src = _single(tmp, "src.safetensors", _state())
    return src, src


def torch_file(tmp: Path) -> tuple[Path, Path]:
    src = _single(tmp, "src.pt", _state())
    return src, src


def safetensors_chunks(tmp: Path) -> tuple[Path, Path]:
    src = _single(tmp, "big.safetensors", _big_state())
    return src, src


def hf_directory(tmp: Path) -> tuple[Path, Path]:
    """A sharded safetensors directory (its checksums in .parallel_dcp.json) of one shard."""
    dcp = tmp / "made_hf_dcp"
    parallel_dcp.save(_state(), dcp, workers=1)
    src = tmp / "src_hf"
    parallel_dcp.convert(dcp, src, workers=1, to="safetensors")
    (shard,) = sorted(src.glob("*.safetensors"))
    return src, shard


def dcp_directory(tmp: Path) -> tuple[Path, Path]:
    """A DCP checkpoint saved by one worker: one shard holding every tensor."""
    src = tmp / "src_dcp"
    parallel_dcp.save(_state(), src, workers=1)
    (shard,) = sorted(src.glob("*.distcp"))
    return src, shard


# how the source is made, which tensor is damaged, what the conversion asks (all on two workers,
# to DCP: the file's tensors are split between tasks)
ROUTES = [
    pytest.param(safetensors_file, "layer2.weight", {}, id="safetensors-file"),
    pytest.param(torch_file, "layer2.weight", {}, id="torch-file-with-manifest"),
    pytest.param(hf_directory, "layer2.weight", {}, id="hf-shard"),
    pytest.param(dcp_directory, "layer2.weight", {}, id="dcp-shard"),
    pytest.param(safetensors_chunks, "embed.weight", {"chunk_size": "64KiB"}, id="row-range-chunks"),
    # A selection that leaves the damaged tensor out still reads part of the file: refused too.
    pytest.param(safetensors_file, "layer2.weight", {"keys": ["layer4.weight"], "workers": 1}, id="keys-selection"),
    pytest.param(dcp_directory, "layer2.weight", {"keys": ["layer0.weight", "layer5.weight"]}, id="dcp-keys"),
]

Make = Callable[[Path], tuple[Path, Path]]


def _damaged(tmp: Path, make: Make, tensor: str) -> tuple[Path, Path]:
    src, damaged = make(tmp)
    state = _big_state() if tensor == "embed.weight" else _state()
    _flip_inside(damaged, state[tensor])
    return src, damaged


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("make", "tensor", "asked"), ROUTES)
def test_a_flipped_byte_in_a_file_tasks_share_is_refused(tmp_path: Path, make: Make, tensor: str, asked) -> None:
    src, damaged = _damaged(tmp_path, make, tensor)
    dst = tmp_path / "out_dcp"
    around = sorted(os.listdir(tmp_path))
    with pytest.raises(parallel_dcp.SourceChecksumError) as caught:
        parallel_dcp.convert(src, dst, **({"workers": 2} | asked))
    assert f"{damaged}: its bytes are not the ones its checksum" in str(caught.value)
    assert not os.path.lexists(dst)  # nothing committed, nothing kept for --resume
    assert sorted(os.listdir(tmp_path)) == around


@pytest.mark.parametrize(("make", "tensor", "asked"), [ROUTES[0], ROUTES[1], ROUTES[3], ROUTES[4]])
def test_an_existing_destination_is_left_as_it_was(tmp_path: Path, make: Make, tensor: str, asked) -> None:
    dst = tmp_path / "out_dcp"
    parallel_dcp.save({"old": torch.ones(4)}, dst, workers=1)
    before = _tree(dst)
    src, _ = _damaged(tmp_path, make, tensor)
    with pytest.raises(parallel_dcp.SourceChecksumError):
        parallel_dcp.convert(src, dst, overwrite=True, **({"workers": 2} | asked))
    assert _tree(dst) == before
    assert parallel_dcp.verify(dst).ok


@pytest.mark.parametrize(("make", "tensor", "asked"), ROUTES)
def test_a_clean_source_converts_without_a_warning(tmp_path: Path, make: Make, tensor: str, asked) -> None:
    src, _ = make(tmp_path)
    dst = tmp_path / "out_dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("error", parallel_dcp.SourceNotCheckedWarning)
        result = parallel_dcp.convert(src, dst, **({"workers": 2} | asked))
    assert result.tasks >= (1 if "keys" in asked else 2)
    assert parallel_dcp.verify(dst, against=None if "keys" in asked else src).ok
    if "keys" in asked:
        assert sorted(parallel_dcp.load(dst)) == sorted(asked["keys"])


def test_the_hash_pass_buffer_is_counted_in_the_dry_run(tmp_path: Path) -> None:
    """The task that hashes the file holds the pass's buffer beside its reads: the dry run (the
    figures admission uses) counts it, and counts nothing where no source is checked."""
    src, _ = safetensors_file(tmp_path)
    checked = parallel_dcp.convert(src, tmp_path / "a", workers=2, dry_run=True)
    unchecked = parallel_dcp.convert(src, tmp_path / "b", workers=2, dry_run=True, check_source=False)
    assert checked.tasks == unchecked.tasks == 2
    assert checked.predicted_peak_memory - unchecked.predicted_peak_memory == SOURCE_CHECK_BYTES
    assert any("hashes 1 source file" in note for note in checked.notes)
    assert not any("hashes" in note for note in unchecked.notes)


def test_a_resumed_conversion_hashes_the_files_its_remaining_tasks_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead conversion's finished tasks are kept, but the source file the remaining tasks read
    is hashed again: damaged since, it is refused."""
    from tests.test_resume import _fail_midway

    src = _single(tmp_path, "model.safetensors", {f"w{i}": torch.randn(64, 1024) for i in range(8)})
    out = tmp_path / "out"
    _fail_midway(monkeypatch, src, out, "dcp")
    _flip_inside(src, parallel_dcp.load(src, keys=["w7"])["w7"])
    with pytest.raises(parallel_dcp.SourceChecksumError, match=r"model\.safetensors: its bytes are not"):
        parallel_dcp.convert(src, out, workers=2, resume=True)
    assert not (out / ".metadata").exists()


def test_a_resumed_conversion_that_finds_the_source_damaged_keeps_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resumed run refused for a damaged source keeps no task for a later resume, neither the
    dead run's nor its own: any of them may have read the damaged bytes before the verdict, and a
    resume after the file is restored would commit them (verify of the output then passes: its
    checksums were taken of those bytes)."""
    from tests.test_resume import _fail_midway, finished_task_records

    state = {f"w{i}": torch.randn(64, 1024) for i in range(8)}
    src = _single(tmp_path, "model.safetensors", state)
    out = tmp_path / "out"
    _fail_midway(monkeypatch, src, out, "dcp")
    clean = src.read_bytes()
    stat = src.stat()
    _flip_inside(src, state["w0"])  # (a tensor a finished task read)
    with pytest.raises(parallel_dcp.SourceChecksumError, match=r"model\.safetensors: its bytes are not") as caught:
        parallel_dcp.convert(src, out, workers=2, resume=True)
    assert any("nothing was kept for --resume" in note for note in getattr(caught.value, "__notes__", []))
    assert finished_task_records(out) == []
    src.write_bytes(clean)  # restored
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    result = parallel_dcp.convert(src, out, workers=2, resume=True)
    assert result.bytes_kept == 0
    loaded = parallel_dcp.load(out)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_files_read_with_o_direct_are_named_as_not_checked(tmp_path: Path) -> None:
    """O_DIRECT reads pass the page cache: a hash pass would read the file from storage a second
    time, so it is not checked, and a warning says so instead of silence."""
    src, damaged = _damaged(tmp_path, safetensors_file, "layer2.weight")
    with pytest.warns(parallel_dcp.SourceNotCheckedWarning, match=r"src\.safetensors read with O_DIRECT"):
        parallel_dcp.convert(src, tmp_path / "out_dcp", workers=2, io="direct")
    assert damaged == src


class _StalledHash:
    """An xxh3 hasher whose first piece takes far longer than the task timeout (storage that has
    stopped answering under a hash pass of a large file)."""

    def update(self, piece: object) -> None:
        import time

        time.sleep(600)


def test_a_task_timeout_while_hashing_names_the_file_it_hashes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task that ran past its timeout in its hash pass blamed only its keys (which it had not
    begun to read): the message names the file it hashes first, its size, and says so."""
    import types

    from parallel_dcp.engine.memory import format_bytes
    from parallel_dcp.jobs import source_check

    src = _single(tmp_path, "src.pt", _state())
    monkeypatch.setattr(source_check, "xxhash", types.SimpleNamespace(xxh3_64=_StalledHash))  # (the workers fork)
    with pytest.raises(parallel_dcp.TaskTimeoutError, match=r"past the task timeout of 3 s") as caught:
        parallel_dcp.convert(src, tmp_path / "out_dcp", workers=1, task_timeout=3)
    hashed = f"Before its keys it hashes {src} ({format_bytes(src.stat().st_size)}) whole against its checksum"
    assert f"{hashed}: that may be what ran long" in str(caught.value), str(caught.value)
    assert not (tmp_path / "out_dcp").exists()


def test_a_stale_manifest_is_named_as_not_checked(tmp_path: Path) -> None:
    """A save stopped between its commit's two renames leaves the old save's manifest beside the
    new ``.metadata``: it describes other bytes, so the conversion runs unchecked, and says so in
    the warning a caller filters for unchecked sources."""
    src = tmp_path / "src"
    save_with_a_stale_manifest(src)
    with pytest.warns(parallel_dcp.SourceNotCheckedWarning, match="stale"):
        parallel_dcp.convert(src, tmp_path / "out", to="safetensors", workers=1)
    assert torch.equal(parallel_dcp.load(tmp_path / "out")["w"], torch.ones(64))
