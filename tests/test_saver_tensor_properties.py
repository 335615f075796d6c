"""A Saver writes the tensor properties ``save`` and stock's ``dcp.save`` write: ``requires_grad``
read from the caller's tensors on every save (its workers read the bytes from another process,
and a tensor read into a fresh buffer does not require grad)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import parallel_dcp
from tests.conftest import assert_same

# Savers in every test: their workers are forked from one fork server kept for the module.
pytestmark = pytest.mark.usefixtures("kept_fork_server")


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    wide = torch.randn(64, 96, requires_grad=True)
    return {
        "big": torch.nn.Parameter(torch.randn(128, 256)),  # past PENDING_MIN_BYTES: the writer copies it
        "small": torch.nn.Parameter(torch.randn(7)),  # copied by the worker
        "bf16": torch.randn(300, 7).to(torch.bfloat16).requires_grad_(),
        "view": wide[:, ::3],  # a view with gaps of a tensor that requires grad
        "frozen": torch.randn(128, 256),  # large, no grad
        "steps": torch.arange(5),
        "step": 3,
    }


def _properties(path: Path) -> dict[str, tuple[torch.dtype, bool, torch.Size]]:
    metadata = FileSystemReader(str(path)).read_metadata()
    return {
        key: (meta.properties.dtype, meta.properties.requires_grad, meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }


def _stock(sd: dict[str, Any], path: Path) -> dict[str, tuple[torch.dtype, bool, torch.Size]]:
    dcp.save(sd, storage_writer=FileSystemWriter(str(path)), no_dist=True)
    return _properties(path)


@pytest.mark.parametrize("chunk_size", [None, "64KiB"], ids=["whole", "chunked"])
def test_every_save_of_a_saver_records_requires_grad_as_save_does(tmp_path: Path, chunk_size: str | None) -> None:
    sd = _state()
    options: dict[str, Any] = {} if chunk_size is None else {"chunk_size": chunk_size}
    stock = _stock(sd, tmp_path / "stock")
    assert stock["big"][1] and stock["view"][1] and not stock["frozen"][1]  # what the test is about
    assert _properties(tmp_path / "stock") == stock
    parallel_dcp.save(sd, tmp_path / "save", workers=2, executor="processes", **options)
    assert _properties(tmp_path / "save") == stock
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(sd, tmp_path / "first", **options)
        saver.save(sd, tmp_path / "later", **options)  # the layout kept: its plan reused
        saver.save(sd, tmp_path / "promised", layout_unchanged=True, **options)
        for name in ("first", "later", "promised"):
            assert _properties(tmp_path / name) == stock, name
            assert_same(
                parallel_dcp.load(tmp_path / name),
                {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in sd.items()},
            )


def test_requires_grad_changed_between_saves_is_what_the_later_save_records(tmp_path: Path) -> None:
    sd = _state()
    with parallel_dcp.Saver(workers=2) as saver:
        saver.save(sd, tmp_path / "first")
        sd["big"].requires_grad_(False)  # frozen for fine-tuning, in place: the layout is the same
        sd["frozen"].requires_grad_(True)
        saver.save(sd, tmp_path / "later")
    stock = _stock(sd, tmp_path / "stock")
    assert not stock["big"][1] and stock["frozen"][1]
    assert _properties(tmp_path / "later") == stock
