"""storage/scatter_copy.py: many copies in this process in one process_vm_writev call each ~1,000
(without the GIL), and the same bytes by memmove where the kernel refuses or cuts the call short."""

from __future__ import annotations

import ctypes
import errno
from typing import Any

import numpy
import pytest
import torch

from parallel_dcp.storage import scatter_copy as sc


def _case(count: int, size: int) -> tuple[bytearray, list[torch.Tensor], numpy.ndarray, numpy.ndarray]:
    """``count`` records of ``size`` bytes in one buffer (each its own bytes), and a target each."""
    rng = numpy.random.default_rng(count)
    buffer = bytearray(rng.integers(0, 256, size * count + 7, dtype=numpy.uint8).tobytes())
    targets = [torch.zeros(size, dtype=torch.uint8) for _ in range(count)]
    base = numpy.frombuffer(buffer, dtype=numpy.uint8).ctypes.data
    sources = base + 7 + numpy.arange(count, dtype=numpy.int64)[::-1] * size  # unaligned, in reverse
    return buffer, targets, sources, numpy.array([t.data_ptr() for t in targets], dtype=numpy.int64)


def _expected(buffer: bytearray, count: int, size: int, i: int) -> bytes:
    at = 7 + (count - 1 - i) * size
    return bytes(buffer[at : at + size])


@pytest.mark.parametrize("refused", [False, True])
def test_every_pair_is_copied_across_several_calls(refused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if refused:
        monkeypatch.setattr(sc, "_call", [None])
    count, size = 2500, 24  # three calls of at most 1024 pairs
    buffer, targets, sources, addresses = _case(count, size)
    sc.scatter_copy(sources, addresses, size)
    assert all(bytes(t.numpy()) == _expected(buffer, count, size, i) for i, t in enumerate(targets))


def test_lengths_per_pair_and_zero_lengths() -> None:
    buffer, targets, sources, addresses = _case(5, 16)
    lengths = numpy.array([16, 0, 3, 16, 1], dtype=numpy.int64)
    sc.scatter_copy(sources, addresses, lengths)
    for i, t in enumerate(targets):
        n = int(lengths[i])
        assert bytes(t.numpy()[:n]) == _expected(buffer, 5, 16, i)[:n]
        assert not t.numpy()[n:].any()


class _Refusing:
    """A process_vm_writev that fails with ``err`` (or writes only ``short`` bytes, doing nothing)."""

    def __init__(self, err: int = 0, short: int | None = None) -> None:
        self.err, self.short, self.calls = err, short, 0

    def __call__(self, *args: Any) -> int:
        self.calls += 1
        if self.short is not None:
            return self.short
        ctypes.set_errno(self.err)
        return -1


@pytest.mark.parametrize(
    ("fake", "kept"),
    [
        (_Refusing(errno.EPERM), False),
        (_Refusing(errno.ENOSYS), False),
        (_Refusing(errno.EFAULT), True),
        (_Refusing(short=5), True),
    ],
    ids=["EPERM", "ENOSYS", "EFAULT", "short"],
)
def test_a_refused_or_short_call_is_redone_by_memmove(
    fake: _Refusing, kept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused by the kernel (seccomp, not Linux): memmove from then on; any other failure or a
    short write: that piece again by memmove, the call kept for the next."""
    fake.calls = 0
    monkeypatch.setattr(sc, "_call", [fake])
    count, size = 2000, 8
    buffer, targets, sources, addresses = _case(count, size)
    sc.scatter_copy(sources, addresses, size)
    assert all(bytes(t.numpy()) == _expected(buffer, count, size, i) for i, t in enumerate(targets))
    assert fake.calls == (2 if kept else 1)
    assert (sc._call[0] is fake) == kept
