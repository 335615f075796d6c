"""Lazy views (a tensor whose conjugate or negative bit is set: ``x.conj()``, ``x.conj().imag``)
are saved as their values, as stock's ``dcp.save`` saves them: their bytes are not their values.
A writer that copied their bytes wrote the conjugate or the negation without a word (a Saver,
whose workers read the caller's memory), or failed in a worker after the save had started
(``save``: ``view`` refuses a tensor with its negative bit set)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader

import parallel_dcp
from parallel_dcp import _compat
from parallel_dcp.errors import InvalidStateDictError
from parallel_dcp.formats.memory_format import MemorySource
from parallel_dcp.formats.remote_memory_source import RemoteMemorySource
from tests.conftest import assert_same

# Savers in every test: their workers are forked from one fork server kept for the module.
pytestmark = pytest.mark.usefixtures("kept_fork_server")


def _lazy_state() -> dict[str, Any]:
    torch.manual_seed(0)
    big = torch.randn(128, 256, dtype=torch.complex64)  # past PENDING_MIN_BYTES: the writer would copy it
    small = torch.randn(3, 5, dtype=torch.complex128)
    real = torch.randn(96, 64)
    grad = torch.randn(64, 64, dtype=torch.complex64, requires_grad=True)
    return {
        "conj": big.conj(),
        "conj_small": small.conj(),
        "conj_t": big.conj().t(),  # a lazy view with other strides
        "neg": torch._neg_view(real),
        "imag_of_conj": big.conj().imag,  # a real tensor with its negative bit set, and gaps
        "neg_slice": torch._neg_view(real)[10:20],  # a contiguous slice of a larger storage
        "conj_grad": grad.conj(),
        "plain": torch.randn(128, 256),
        "step": 7,
    }


def _values(sd: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint of ``sd`` must hold: each tensor's values, resolved and detached."""
    return {k: v.detach().resolve_conj().resolve_neg() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def _stock_load(path: Path, sd: dict[str, Any]) -> dict[str, Any]:
    """``path`` read by stock ``dcp.load`` into fresh tensors shaped as ``sd``'s values."""
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in _values(sd).items()}
    dcp.load(target, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return target


def test_the_state_holds_lazy_views() -> None:
    sd = _lazy_state()
    assert sd["conj"].is_conj() and sd["neg"].is_neg() and sd["imag_of_conj"].is_neg()  # what the tests are about
    # Their bytes (the view with its bit cleared) are not their values.
    assert not torch.equal(sd["conj"].conj(), _values(sd)["conj"])
    assert not torch.equal(torch._neg_view(sd["neg"]), _values(sd)["neg"])


@pytest.mark.parametrize("executor", ["processes", "threads"])
@pytest.mark.parametrize("chunk_size", [None, "16KiB"], ids=["whole", "chunked"])
def test_save_writes_lazy_views_as_their_values(tmp_path: Path, executor: str, chunk_size: str | None) -> None:
    sd = _lazy_state()
    options: dict[str, Any] = {} if chunk_size is None else {"chunk_size": chunk_size}
    parallel_dcp.save(sd, tmp_path / "out", workers=2, executor=executor, **options)
    assert_same(_stock_load(tmp_path / "out", sd), _values(sd))
    assert_same(parallel_dcp.load(tmp_path / "out"), _values(sd))


@pytest.mark.parametrize("chunk_size", [None, "16KiB"], ids=["whole", "chunked"])
def test_every_save_of_a_saver_writes_lazy_views_as_their_values(tmp_path: Path, chunk_size: str | None) -> None:
    sd = _lazy_state()
    options: dict[str, Any] = {} if chunk_size is None else {"chunk_size": chunk_size}
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(sd, tmp_path / "first", **options)
        saver.save(sd, tmp_path / "later", **options)  # the layout kept: its plan (and parts) reused
        saver.save(sd, tmp_path / "promised", layout_unchanged=True, **options)
    for name in ("first", "later", "promised"):
        assert_same(_stock_load(tmp_path / name, sd), _values(sd))


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "python-check"])
def test_a_tensor_replaced_by_a_lazy_view_of_its_bytes_is_saved_as_its_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, guard: bool
) -> None:
    """Same address, dtype, shape and strides, only a bit differs: the layout check sees it (the
    C guard compares dispatch keys; without one, the Python passes compare the bits)."""
    if not guard:
        monkeypatch.setattr(_compat, "layout_guard", lambda *args: None)
    torch.manual_seed(1)
    z, r = torch.randn(64, 128, dtype=torch.complex64), torch.randn(300, 100)
    sd: dict[str, Any] = {"z": z, "r": r, "w": torch.randn(50)}
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(sd, tmp_path / "a")
        saver.save(sd, tmp_path / "b")  # the kept layout now steady: the next save dispatches ahead of its check
        sd["z"], sd["r"] = z.conj(), torch._neg_view(r)
        saver.save(sd, tmp_path / "c")
        sd["z"], sd["r"] = z, r  # and back
        saver.save(sd, tmp_path / "d")
    assert_same(
        _stock_load(tmp_path / "c", {**sd, "z": z.conj(), "r": torch._neg_view(r)}),
        _values({**sd, "z": z.conj(), "r": torch._neg_view(r)}),
    )
    assert_same(_stock_load(tmp_path / "d", sd), _values(sd))


def test_a_lazy_view_is_charged_as_the_copy_a_worker_makes() -> None:
    sd = _lazy_state()
    for source in (MemorySource("x", state_dict=sd), RemoteMemorySource("x", state_dict=sd)):
        sizes = source.tensor_sizes()
        for key in ("conj", "conj_t", "neg", "neg_slice", "conj_grad"):
            assert sizes[key] == (sd[key].nbytes, sd[key].nbytes), (type(source).__name__, key)
            assert source.copied_bytes(key) == sd[key].nbytes
        assert sizes["plain"][1] == 0  # a plain contiguous tensor is written from where it lies


def test_the_metadata_records_what_stock_records(tmp_path: Path) -> None:
    sd = _lazy_state()
    dcp.save(sd, checkpoint_id=str(tmp_path / "stock"), no_dist=True)
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(sd, tmp_path / "saver")
    parallel_dcp.save(sd, tmp_path / "save", workers=2)

    def properties(path: Path) -> dict[str, Any]:
        metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return {
            k: (m.properties.dtype, m.properties.requires_grad, m.size)
            for k, m in metadata.items()
            if hasattr(m, "properties")
        }

    assert properties(tmp_path / "saver") == properties(tmp_path / "stock")
    assert properties(tmp_path / "save") == properties(tmp_path / "stock")


def _plain_lazy_state() -> dict[str, Any]:
    """Lazy views torch.save and stock's dcp.save keep as such (the bit in the record's pickle)."""
    torch.manual_seed(2)
    z = torch.randn(300, 300, dtype=torch.complex64)
    return {
        "conj": z.conj(),
        "neg": torch._neg_view(torch.randn(300, 300)),
        "conj_small": torch.randn(3, dtype=torch.complex64).conj(),
        "plain": torch.randn(5),
    }


def test_a_stock_checkpoint_of_lazy_views_loads_as_their_values(tmp_path: Path) -> None:
    """Stock's records carry the bits (torch.save's ``metadata`` argument); the record parser read
    their bytes as the values."""
    sd = _plain_lazy_state()
    dcp.save(sd, checkpoint_id=str(tmp_path / "stock"), no_dist=True)
    expected = _values(sd)
    assert_same(_stock_load(tmp_path / "stock", sd), expected)  # stock's own reader
    assert_same(parallel_dcp.load(tmp_path / "stock"), expected)
    into = {k: torch.zeros_like(v) for k, v in expected.items()}
    parallel_dcp.load(tmp_path / "stock", into=into)
    assert_same(into, expected)
    assert parallel_dcp.verify(tmp_path / "stock").problems == []


@pytest.mark.parametrize("options", [{}, {"chunk_size": "64KiB"}, {"to": "safetensors"}], ids=["dcp", "chunked", "st"])
def test_a_torch_save_file_of_lazy_views_converts_to_their_values(tmp_path: Path, options: dict[str, Any]) -> None:
    """Its contiguous tensors were copied from the file's bytes (raw ranges): the conjugate, the negation."""
    sd = _plain_lazy_state()
    torch.save(sd, tmp_path / "model.pt")
    parallel_dcp.convert(tmp_path / "model.pt", tmp_path / "out", workers=2, **options)
    if options.get("to") == "safetensors":
        from safetensors.torch import load_file

        got = {}
        for file in sorted((tmp_path / "out").glob("*.safetensors")):
            got.update(load_file(str(file)))
        assert_same(got, _values(sd))
    else:
        assert_same(_stock_load(tmp_path / "out", sd), _values(sd))


def test_load_into_a_lazy_view_is_refused_and_fast_reader_fills_it_as_stock(tmp_path: Path) -> None:
    """Filled by its address, a conj target read back the conjugate of what was saved."""
    sd = {"c": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64), "f": torch.tensor([1.0, -2.0, 3.0])}
    parallel_dcp.save(sd, tmp_path / "ck", workers=1)
    z, f = torch.zeros(2, dtype=torch.complex64), torch.zeros(3)
    with pytest.raises(InvalidStateDictError, match=r"into\['c'\] is a lazy view"):
        parallel_dcp.load(tmp_path / "ck", into={"c": z.conj(), "f": f})
    with pytest.raises(InvalidStateDictError, match=r"into\['f'\] is a lazy view"):
        parallel_dcp.load(tmp_path / "ck", into={"c": z, "f": torch._neg_view(f)})
    stock = {"c": torch.zeros(2, dtype=torch.complex64).conj(), "f": torch._neg_view(torch.zeros(3))}
    dcp.load(stock, storage_reader=FileSystemReader(str(tmp_path / "ck")), no_dist=True)
    ours = {"c": torch.zeros(2, dtype=torch.complex64).conj(), "f": torch._neg_view(torch.zeros(3))}
    dcp.load(ours, storage_reader=parallel_dcp.FastReader(tmp_path / "ck"), no_dist=True)
    for got in (stock, ours):
        assert_same(_values(got), sd)


def test_a_filled_target_is_marked_modified_for_autograd(tmp_path: Path) -> None:
    """Filled by its address, a Parameter a graph had saved kept its version: backward used the
    new values without a word, where stock's copy_ makes it raise."""
    w = torch.nn.Parameter(torch.ones(4))
    parallel_dcp.save({"w": torch.full((4,), 5.0)}, tmp_path / "ck", workers=1)
    for load in ("into", "fast"):
        loss = (w * w).sum()  # saves w for backward
        before = w._version
        if load == "into":
            parallel_dcp.load(tmp_path / "ck", into={"w": w})
        else:
            dcp.load({"w": w}, storage_reader=parallel_dcp.FastReader(tmp_path / "ck"), no_dist=True)
        assert w._version > before
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        with torch.no_grad():
            w.fill_(1.0)
