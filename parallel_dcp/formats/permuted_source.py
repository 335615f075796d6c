"""A source whose attention weights are seen with their rows permuted per head (rotary layouts).

    inner source                           PermutedSource (what the job plans)
      q weight [H * D, C]   rows per head:   halves   [x0 .. x(D/2-1) | y0 .. y(D/2-1)]
                                       ──▶   pairs    [x0 y0 x1 y1 ...]           (to_interleaved)
      anything else          ──────────▶   as it is

Hugging Face's Llama conversion stores each head's q/k rows as two halves (its rotary embedding
rotates ``x[:D/2]`` against ``x[D/2:]``); Meta's and torchtitan's Llama hold interleaved pairs
(their complex rotary embedding multiplies ``(x0, y0), (x1, y1), ...``). The permutation moves
rows only inside one head, so a row range that starts and ends on head boundaries is permuted on
its own: :meth:`PermutedSource.split_alignment` makes the planner cut row ranges there, and a
range that is not aligned anyway (a plan made elsewhere) is widened to whole heads, permuted and
narrowed. Column ranges permute all their rows. The permutation runs in the worker, per unit,
and needs one more buffer of the unit's size (the permuted copy): :meth:`copied_bytes` and
:meth:`chunk_memory` count it, so the memory governor admits it before it exists.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from parallel_dcp.formats.base import Source
from parallel_dcp.formats.wrapped_source import WrappedSource

if TYPE_CHECKING:
    from parallel_dcp.engine.chunks import Chunk

__all__ = ["PermutedSource", "RowPermutation", "permute_rows", "permuted_source"]


@dataclass(frozen=True, slots=True)
class RowPermutation:
    """Rows of each of ``heads`` heads of ``head_dim`` rows: halves to interleaved pairs
    (``to_interleaved``) or back."""

    heads: int
    head_dim: int
    to_interleaved: bool

    def describe(self) -> str:
        way = "halves -> interleaved pairs" if self.to_interleaved else "interleaved pairs -> halves"
        return f"{self.heads} heads x {self.head_dim} rows, {way}"


def permute_rows(rows: torch.Tensor, head_dim: int, to_interleaved: bool) -> torch.Tensor:
    """``rows`` (whole heads along dim 0) with each head's rows permuted; a new contiguous tensor.

    Exactly torchtitan 0.3.0's ``Llama3StateDictAdapter._reverse_permute`` (``to_interleaved``,
    its ``from_hf``) and ``_permute`` (its ``to_hf``), for any number of columns.
    """
    if rows.shape[0] % head_dim:
        raise ValueError(f"{rows.shape[0]} rows are not whole heads of {head_dim} rows")
    heads, rest = rows.shape[0] // head_dim, tuple(rows.shape[1:])
    split = (heads, 2, head_dim // 2) if to_interleaved else (heads, head_dim // 2, 2)
    return rows.reshape(*split, *rest).transpose(1, 2).contiguous().reshape(rows.shape)


@dataclass
class PermutedSource(WrappedSource):
    """``inner`` with the tensors of ``permutations`` (by key) seen with their rows permuted."""

    permutations: dict[str, RowPermutation] = field(default_factory=dict)

    def _head_rows(self, chunk: Chunk) -> Chunk:
        """``chunk`` widened to whole heads (itself when it is a column range or aligned)."""
        step = self.permutations[chunk.key].head_dim
        if chunk.dim != 0:
            return chunk
        start = chunk.start - chunk.start % step
        stop = min(chunk.shape[0], -(-chunk.stop // step) * step)
        return dataclasses.replace(chunk, start=start, stop=stop)

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        data = self._inner().read(keys)
        for key, tensor in data.items():
            permutation = self.permutations.get(key)
            if permutation is not None:
                data[key] = permute_rows(tensor, permutation.head_dim, permutation.to_interleaved)
                del tensor  # the source's copy goes before the next key's is read
        return data

    def read_chunk(self, chunk: Chunk) -> torch.Tensor:
        permutation = self.permutations.get(chunk.key)
        if permutation is None:
            return self._inner().read_chunk(chunk)
        whole = self._head_rows(chunk)
        rows = permute_rows(self._inner().read_chunk(whole), permutation.head_dim, permutation.to_interleaved)
        if whole == chunk:
            return rows
        return rows.narrow(0, chunk.start - whole.start, chunk.stop - chunk.start).contiguous()

    def split_alignment(self, key: str, dim: int) -> int:
        permutation = self.permutations.get(key)
        inner = self._inner().split_alignment(key, dim)
        if permutation is not None and dim == 0:
            return math.lcm(permutation.head_dim, inner)  # whole heads, and whole blocks of a dequantized weight
        return inner

    def copied_bytes(self, key: str) -> int:
        extra = self.entries[key].nbytes if key in self.permutations else 0  # the permuted copy
        return self._inner().copied_bytes(key) + extra

    def chunk_memory(self, chunk: Chunk) -> int:
        if chunk.key not in self.permutations:
            return self._inner().chunk_memory(chunk)
        whole = self._head_rows(chunk)
        itemsize = self.entries[chunk.key].dtype.itemsize
        narrowed = chunk.nbytes(itemsize) if whole != chunk else 0
        return self._inner().chunk_memory(whole) + whole.nbytes(itemsize) + narrowed

    def transient_bytes(self, key: str) -> int:
        return self._inner().transient_bytes(key)

    def check(self, keys: Iterable[str] | None = None) -> None:
        self._inner().check(keys)

    def release(self) -> None:
        self._inner().release()

    def fingerprint(self) -> dict[str, Any]:
        # The permutation is part of what the output is made of: a resume must not mix layouts.
        # JSON values (lists, not tuples): a resume compares this with the record it read back.
        permuted = {key: [p.heads, p.head_dim, p.to_interleaved] for key, p in sorted(self.permutations.items())}
        return self._inner().fingerprint() | {"permute_rows": permuted}


def permuted_source(source: Source, permutations: dict[str, RowPermutation]) -> PermutedSource:
    """``source`` with the rows of ``permutations``' tensors permuted (every other key as it is).

    Raises:
        ValueError: a tensor whose rows are not ``heads * head_dim``, or an odd ``head_dim``.
    """
    bad = []
    for key, p in permutations.items():
        entry = source.entries[key]
        if p.head_dim % 2 or not entry.shape or entry.shape[0] != p.heads * p.head_dim:
            bad.append(f"{key} {list(entry.shape)} is not {p.heads} heads x {p.head_dim} rows (an even head_dim)")
    if bad:
        raise ValueError("cannot permute rows per head: " + "; ".join(bad[:10]) + _more(len(bad)))
    return PermutedSource.around(
        source,
        entries=dict(source.entries),
        values=source.values,
        mapping=dict(source.mapping),
        permutations=dict(permutations),
    )


def _more(count: int) -> str:
    return f" ... ({count} in all)" if count > 10 else ""
