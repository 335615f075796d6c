"""A conversion finds a checksummed source's record where the file it reads is, and a file's
bytes that differ from its record say what may have happened, not only "damaged".

- A copy that does not keep modification times (cp without -p, a download, s3 cp) leaves every
  file newer than its record; that used to turn the check off ("the record is stale"), and a
  shard damaged in the copy converted. Such a file is now hashed like any other: the same bytes
  pass quietly, other bytes are refused, the error saying it may be a rewrite or damage.
- A safetensors file's own record lives in its header, and stock safetensors keeps it when a
  script rewrites the file (``save_file(..., metadata=f.metadata())``): its refusal called an
  edit on purpose "damaged; restore it". It now says the file may have been rewritten so.
- A single file named through a symlink (``latest.pt -> store/model.pt``) is read where the link
  leads, but its record was looked for beside the link (a torch.save file: none found, nothing
  checked, nothing said) or refused as a link (a safetensors header: "refusing to follow it",
  converted unchecked; ``verify`` failed outright). The check now reads the record of the file
  the conversion reads: the sidecar beside the resolved file, or its header. A damaged one is
  named as the user typed it and as found ("run/latest.pt -> store/model.pt"), not only resolved.
- A sidecar beside the link's name alone (the file moved away and linked back, or a link repointed
  over a file we once wrote) converted unchecked without a word: it is not used (it was written
  for whatever file that name held), and the conversion and ``verify`` both say so.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import parallel_dcp
from tests.test_convert_checks_shared_files import _flip_inside as flip_in_file


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return {f"layer{i}.weight": torch.randn(80 + i, 40, generator=gen) for i in range(4)}


def _flip_inside(paths: list[Path], tensor: torch.Tensor) -> Path:
    """Flip one byte in ``tensor``'s bytes in the one of ``paths`` that holds it, keeping the
    modification time (as a device's flipped bit, or damage in a copy that its own time hides)."""
    raw = tensor.contiguous().numpy().tobytes()
    path = next(p for p in paths if p.read_bytes().find(raw[:256]) >= 0)
    flip_in_file(path, tensor)
    return path


def _copied_folder(tmp: Path) -> Path:
    """A sharded safetensors folder copied file by file without modification times, the record
    first (as a downloader that fetches small files first lands it): every shard is newer."""
    dcp = tmp / "made_dcp"
    parallel_dcp.save(_state(), dcp, workers=1)
    original = tmp / "original_hf"
    parallel_dcp.convert(dcp, original, workers=1, to="safetensors", shard_size="20KB")
    copy = tmp / "copy_hf"
    copy.mkdir()
    for path in sorted(original.iterdir(), key=lambda p: p.stat().st_size):
        shutil.copyfile(path, copy / path.name)
        time.sleep(0.01)
    record = (copy / ".parallel_dcp.json").stat().st_mtime_ns
    shards = sorted(copy.glob("*.safetensors"))
    assert len(shards) > 1 and all(p.stat().st_mtime_ns > record for p in shards)
    return copy


def test_a_copy_newer_than_its_record_is_checked(tmp_path: Path) -> None:
    copy = _copied_folder(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", parallel_dcp.SourceNotCheckedWarning)
        parallel_dcp.convert(copy, tmp_path / "clean_dcp", workers=2)
    assert parallel_dcp.verify(tmp_path / "clean_dcp", against=copy).ok

    damaged = _flip_inside(sorted(copy.glob("*.safetensors")), _state()["layer0.weight"])
    with pytest.raises(parallel_dcp.SourceChecksumError) as caught:
        parallel_dcp.convert(copy, tmp_path / "out_dcp", workers=2)
    message = str(caught.value)
    assert f"{damaged}: its bytes are not the ones its checksum in .parallel_dcp.json was taken of" in message
    assert "changed after .parallel_dcp.json was written" in message
    assert "rewrote it on purpose" in message and "--no-source-checks" in message  # the one way
    assert "damaged" in message and "restore it" in message  # and the other
    assert not (tmp_path / "out_dcp").exists()


@pytest.mark.parametrize("add", [False, True], ids=["same-header", "tensor-added"])
def test_a_safetensors_file_rewritten_keeping_its_metadata_is_not_called_damaged(tmp_path: Path, add: bool) -> None:
    """The usual edit script: open, change a tensor (add one), save keeping the metadata."""
    dcp = tmp_path / "made_dcp"
    parallel_dcp.save(_state(), dcp, workers=1)
    src = tmp_path / "edited.safetensors"
    parallel_dcp.convert(dcp, src, workers=1)
    with safe_open(src, "pt") as f:
        metadata = f.metadata()
    tensors = load_file(src)
    assert "parallel_dcp" in metadata
    tensors["layer1.weight"] = tensors["layer1.weight"] * 2
    if add:
        tensors["extra"] = torch.zeros(4)
    save_file(tensors, src, metadata=metadata)
    with pytest.raises(parallel_dcp.SourceChecksumError) as caught:
        parallel_dcp.convert(src, tmp_path / "out_dcp", workers=2)
    message = str(caught.value)
    assert os.fspath(src) in message
    assert re.search(r'(kept|keeping) its "parallel_dcp" metadata entry', message)
    assert "record is stale" in message and "--no-source-checks" in message
    assert "damaged" in message and "restore it" in message
    assert "the source is damaged;" not in message  # never damage alone
    assert not (tmp_path / "out_dcp").exists()
    parallel_dcp.convert(src, tmp_path / "out_dcp", workers=2, check_source=False)
    assert torch.equal(parallel_dcp.load(tmp_path / "out_dcp")["layer1.weight"], tensors["layer1.weight"])


def _linked(tmp: Path, suffix: str) -> tuple[Path, Path]:
    """A single file written by parallel_dcp in a store folder, and a link to it under another
    name in another folder (its record lies beside the file, not beside the link)."""
    dcp = tmp / "made_dcp"
    parallel_dcp.save(_state(), dcp, workers=1)
    store, run = tmp / "store", tmp / "run"
    store.mkdir()
    run.mkdir()
    real = store / f"model{suffix}"
    parallel_dcp.convert(dcp, real, workers=1)
    link = run / f"latest{suffix}"
    link.symlink_to(real)
    return real, link


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_file_named_through_a_link_is_checked_against_the_record_of_the_file_it_leads_to(
    tmp_path: Path, suffix: str
) -> None:
    real, link = _linked(tmp_path, suffix)
    with warnings.catch_warnings():
        warnings.simplefilter("error", parallel_dcp.SourceNotCheckedWarning)
        parallel_dcp.convert(link, tmp_path / "clean_dcp", workers=2)
    assert parallel_dcp.verify(link).ok and parallel_dcp.verify(link).files_checked == 1

    _flip_inside([real], _state()["layer2.weight"])
    with pytest.raises(parallel_dcp.SourceChecksumError) as caught:
        parallel_dcp.convert(link, tmp_path / "out_dcp", workers=2)
    assert f"{real}: its bytes are not the ones its checksum" in str(caught.value)
    assert not (tmp_path / "out_dcp").exists()
    assert any("checksum" in problem for problem in parallel_dcp.verify(link).problems)  # verify reads it too


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_damaged_file_named_through_a_link_is_named_as_typed_and_as_found(tmp_path: Path, suffix: str) -> None:
    """The error named only the resolved path: a user who typed run/latest.pt did not see it."""
    real, link = _linked(tmp_path, suffix)
    _flip_inside([real], _state()["layer1.weight"])
    with pytest.raises(parallel_dcp.SourceChecksumError) as caught:
        parallel_dcp.convert(link, tmp_path / "out_dcp", workers=2)
    assert f"{link} -> {real}: its bytes are not the ones its checksum" in str(caught.value)
    assert not (tmp_path / "out_dcp").exists()


def test_a_record_beside_the_link_alone_is_not_used_and_said_so(tmp_path: Path) -> None:
    """A torch.save file moved to a store and linked back: its sidecar stayed beside the link. The
    file's bytes are damaged; the conversion converted them unchecked and said nothing."""
    real, link = _linked(tmp_path, ".pt")
    moved = real.with_name("model.pt.manifest.json").rename(link.with_name("latest.pt.manifest.json"))
    _flip_inside([real], _state()["layer2.weight"])
    with pytest.warns(parallel_dcp.SourceNotCheckedWarning) as caught:
        parallel_dcp.convert(link, tmp_path / "out_dcp", workers=2)
    message = str(next(w.message for w in caught if w.category is parallel_dcp.SourceNotCheckedWarning))
    assert message.startswith(f"{link}: not checked against its checksums: it is a link to {real}")
    assert f"{moved} beside the link is not used" in message
    report = parallel_dcp.verify(link)
    assert not report.ok and any(f"{moved} beside the link is not used" in p for p in report.problems)


def test_a_record_beside_the_resolved_file_that_cannot_be_read_safely_is_warned_of(tmp_path: Path) -> None:
    """The sidecar beside the file a link leads to is itself a link: refused by the one rule, and
    the conversion says it did not check, never silently."""
    real, link = _linked(tmp_path, ".pt")
    sidecar = real.with_name("model.pt.manifest.json")
    kept = sidecar.rename(tmp_path / "kept.manifest.json")
    sidecar.symlink_to(kept)
    with pytest.warns(parallel_dcp.SourceNotCheckedWarning, match="not checked against its checksums"):
        parallel_dcp.convert(link, tmp_path / "out_dcp", workers=1)


def _linked_folder(tmp: Path) -> Path:
    """A Hugging Face folder whose shards are links into its own blobs/ (as a cache snapshot's),
    its record a regular file."""
    dcp = tmp / "made_dcp"
    parallel_dcp.save(_state(), dcp, workers=1)
    src = tmp / "linked_hf"
    parallel_dcp.convert(dcp, src, workers=1, to="safetensors", shard_size="20KB")
    (src / "blobs").mkdir()
    for shard in sorted(src.glob("*.safetensors")):
        shard.rename(src / "blobs" / f"blob-{shard.name}")
        shard.symlink_to(Path("blobs") / f"blob-{shard.name}")
    return src


def test_a_folders_shards_that_link_within_it_are_checked_where_they_lead(tmp_path: Path) -> None:
    """A Hugging Face folder whose shards are links into its own blobs/ (read where they lead, by
    the in-tree rule) and whose record is a regular file: hashed as read, not refused as links."""
    src = _linked_folder(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", parallel_dcp.SourceNotCheckedWarning)
        parallel_dcp.convert(src, tmp_path / "clean_dcp", workers=2)

    damaged = _flip_inside(sorted((src / "blobs").iterdir()), _state()["layer3.weight"])
    with pytest.raises(parallel_dcp.SourceChecksumError) as caught:
        parallel_dcp.convert(src, tmp_path / "out_dcp", workers=2)
    assert f"{damaged}: its bytes are not the ones its checksum" in str(caught.value)


def test_verify_follows_the_links_convert_follows_and_refuses_those_it_refuses(tmp_path: Path) -> None:
    """verify reported every in-tree linked shard as "a symlink; refusing to follow it" (not ok)
    while convert read and checked them: it now hashes them where they lead, as convert does, and
    a link leaving the folder is refused by both."""
    src = _linked_folder(tmp_path)
    shards = sorted(src.glob("*.safetensors"))
    report = parallel_dcp.verify(src, workers=2)
    assert report.ok and report.files_checked == len(shards) + 1, report.problems  # (and the index)

    damaged = _flip_inside(sorted((src / "blobs").iterdir()), _state()["layer3.weight"])
    shard = next(s for s in shards if s.resolve() == damaged)
    problems = parallel_dcp.verify(src, workers=2).problems
    files = [p for p in problems if p.startswith("file ")]
    assert len(files) == 1 and files[0].startswith(f"file {shard.name} -> {damaged}: checksum"), problems

    outside = tmp_path / "outside"
    outside.mkdir()
    shards[0].unlink()
    shards[0].symlink_to((src / "blobs" / f"blob-{shards[0].name}").rename(outside / shards[0].name))
    for run in (lambda: parallel_dcp.verify(src, workers=2), lambda: parallel_dcp.convert(src, tmp_path / "out")):
        with pytest.raises(parallel_dcp.UnsafeCheckpointError, match=f"{shards[0]} is a symlink leading out of"):
            run()


@pytest.mark.skipif(os.geteuid() != 0, reason="plays another user: needs root to change uid in a child")
def test_a_record_this_user_may_not_read_converts_unchecked_with_a_warning(tmp_path: Path) -> None:
    """Another user's checkpoint whose data this user may read but whose record (mode 0600) it may
    not: the conversion failed with a bare "[Errno 13] Permission denied" (review s13, F5); an
    unreadable record proves nothing about the data, so it converts unchecked, and says so."""
    import tempfile

    # (pytest's folders are root's 0700: a folder the other user can reach, removed at the end)
    base = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else "/var/tmp"))
    base.chmod(0o755)
    try:
        _convert_as_nobody(base)
    finally:
        shutil.rmtree(base)


def _convert_as_nobody(base: Path) -> None:
    src = base / "src"
    parallel_dcp.save(_state(), src, workers=1)
    os.chmod(src / ".parallel_dcp.json", 0o600)
    out = base / "shared"
    out.mkdir()
    os.chown(out, 65534, 65534)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child, as uid 65534
        os.close(read)
        outcome = "?"
        try:
            os.setgid(65534)
            os.setuid(65534)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                parallel_dcp.convert(src, out / "o", workers=1)
            named = [str(w.message) for w in caught if issubclass(w.category, parallel_dcp.SourceNotCheckedWarning)]
            outcome = "warned" if any("Permission denied" in m for m in named) else f"silent {named}"
        except BaseException as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        finally:
            os.write(write, outcome.encode()[:4000])
            os._exit(0)
    os.close(write)
    try:
        got = os.read(read, 4096).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert got == "warned", got
