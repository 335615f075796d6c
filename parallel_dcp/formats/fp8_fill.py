"""An FP8 weight dequantized straight into the writer's buffers, a piece at a time.

    DequantizedSource.read (a DCP output)        ShardWriter (storage.writers)
    ─────────────────────────────────────        ─────────────────────────────
    FP8 weight + its scale, as read  ──▶ PendingTensor(dtype, shape)
                                          │  the record's template prefix
                                          ▼
                                         fill(offset, n, address) ◀── for each piece (1 MiB at most)
                                          │  the output elements those bytes hold, dequantized
                                          │  by dequantize_fp8 into the buffer itself
                                          ▼
                                         hashed there, written; the template's suffix

No output tensor exists: a unit holds its FP8 input, its scale and a strip's temporaries, and the
bytes land in the direct-write buffers (already faulted in and reused), not in fresh memory that
is faulted in and then copied. Each value is computed by :func:`dequantize_fp8` itself, so the
bytes are those of the tensor it would have returned.

A piece is a byte range of the output in storage order; it may start or end inside an element
(the records before it have any length). Such a piece is dequantized into a reused scratch of at
most :data:`~parallel_dcp.formats.quantized.STRIP_ELEMENTS` elements and its bytes copied out; an
aligned one is dequantized in place.

With 128 x 128 blocks (a row block's (block, code) table far smaller than the row block) a piece
is cut at row-block boundaries and each part is three operations over its flat elements: the
codes widened into a reused int32 index, the columns' block offsets added (one row's pattern,
tiled once for the strip), one lookup in the row block's table of (block, code) products made by
``dequantize_fp8``'s own operations (kept while the pieces go through that row block). Calling
:func:`dequantize_fp8` for each piece's partial first row, whole rows and partial last row cost
more in per-call work than the lookups (0.4 s of Python a GiB). Other blocks take that route.
Temporaries stay within :func:`dequantize_work_bytes` of the strip: the index, the tiled
pattern and the scratch are 4 B an element of a strip at most each, the table a quarter of a row
block's elements.
"""

from __future__ import annotations

import ctypes

import torch

from parallel_dcp.formats.quantized import STRIP_ELEMENTS, dequantize_fp8, fp8_values
from parallel_dcp.storage.pending import PendingTensor

__all__ = ["fp8_pending"]


def fp8_pending(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    block: tuple[int, int],
    *,
    row0: int = 0,
    col0: int = 0,
) -> PendingTensor:
    """``dequantize_fp8(weight, scale, dtype, block, row0=row0, col0=col0)`` as a
    :class:`PendingTensor` whose ``fill`` computes the requested bytes where the writer wants them."""
    rows, cols = weight.shape
    fill = _Fill(weight, scale, dtype, block, row0, col0)
    return PendingTensor(dtype, (rows, cols), (cols, 1), rows * cols * dtype.itemsize, fill)


class _Fill:
    """``fill(offset, nbytes, address)`` of :func:`fp8_pending` (see the module doc)."""

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        dtype: torch.dtype,
        block: tuple[int, int],
        row0: int,
        col0: int,
    ) -> None:
        self.weight, self.scale, self.dtype, self.block = weight, scale, dtype, block
        self.row0, self.col0 = row0, col0
        self.rows, self.cols = weight.shape
        br, bc = block
        first_cb = col0 // bc
        ncb = (col0 + self.cols - 1) // bc - first_cb + 1 if self.cols else 0
        self.ncb = ncb
        # A strip: at most STRIP_ELEMENTS, never more than the weight's elements. Each buffer below
        # holds at most 4 B an element of it (the scratch: the dtype's size), the flat route's table
        # too (float32 products and their dtype copy), so all of them stay within 16 B an element:
        # dequantize_work_bytes, what the unit is charged.
        self.step = min(STRIP_ELEMENTS, self.rows * self.cols)
        # The flat route: a row block's table (ncb x 256) no larger than a quarter of its elements
        # (dequantize_fp8's own rule for a table) nor than 4 B an element of the strip, a row
        # within the strip, a contiguous weight.
        self.flat = (
            0 < self.cols <= self.step
            and ncb * 256 * 4 <= min(br, self.rows) * self.cols
            and ncb * 256 * (4 + dtype.itemsize) <= 4 * self.step
            and weight.is_contiguous()
        )
        self._codes: torch.Tensor | None = None  # the weight's bytes, flat
        self._tiled: torch.Tensor | None = None  # each column's block offset, over whole rows of a strip
        self._index: torch.Tensor | None = None  # the strip's int32 indices, reused
        self._scratch: torch.Tensor | None = None  # an unaligned piece's elements, reused
        self._table: tuple[int, torch.Tensor] | None = None  # (row block, its products)

    def held(self) -> int:
        """The bytes of the buffers this fill holds now (between two pieces)."""
        buffers = [self._tiled, self._index, self._scratch, self._table[1] if self._table else None]
        return sum(b.nbytes for b in buffers if b is not None)

    def __call__(self, offset: int, nbytes: int, address: int) -> None:
        itemsize = self.dtype.itemsize
        end = offset + nbytes
        if nbytes <= 0:
            return
        try:
            self._fill(offset, end, address)
        finally:
            if end >= self.rows * self.cols * itemsize:  # the last piece: a task's later units reuse the heap
                self._codes = self._tiled = self._index = self._scratch = self._table = None

    def _fill(self, offset: int, end: int, address: int) -> None:
        itemsize = self.dtype.itemsize
        if offset % itemsize == 0 and end % itemsize == 0:
            target = _tensor_at(address, end - offset).view(self.dtype)
            self._into(offset // itemsize, end // itemsize, target)
            return
        if self._scratch is None:
            self._scratch = torch.empty(self.step, dtype=self.dtype)  # an unaligned piece: at most a strip
        buffer = self._scratch
        raw = buffer.view(torch.uint8)
        while offset < end:
            first = offset // itemsize
            last = min(first + STRIP_ELEMENTS, -(-end // itemsize))
            self._into(first, last, buffer[: last - first])
            n = min(end, last * itemsize) - offset
            ctypes.memmove(address, raw.data_ptr() + offset - first * itemsize, n)
            offset += n
            address += n

    def _into(self, first: int, last: int, out: torch.Tensor) -> None:
        """Elements ``first .. last`` (row-major) of the output into ``out`` (1-D, that many)."""
        if self.flat:
            self._flat_into(first, last, out)
            return
        weight, scale, dtype, block, cols = self.weight, self.scale, self.dtype, self.block, self.cols
        at = 0
        while first < last:
            r, c = divmod(first, cols)
            if c or last - first < cols:  # a partial row
                n = min(cols - c, last - first)
                piece = weight[r : r + 1, c : c + n]
                part = out[at : at + n].view(1, n)
                dequantize_fp8(piece, scale, dtype, block, row0=self.row0 + r, col0=self.col0 + c, out=part)
            else:  # whole rows
                n = (last - first) // cols * cols
                part = out[at : at + n].view(-1, cols)
                dequantize_fp8(
                    weight[r : r + n // cols], scale, dtype, block, row0=self.row0 + r, col0=self.col0, out=part
                )
            first += n
            at += n

    def _flat_into(self, first: int, last: int, out: torch.Tensor) -> None:
        cols, br = self.cols, self.block[0]
        if self._codes is None:
            self._codes = self.weight.view(torch.uint8).reshape(-1)
            bc, col0 = self.block[1], self.col0
            pattern = (torch.arange(col0, col0 + cols) // bc - col0 // bc).to(torch.int32).mul_(256)
            self._tiled = pattern.repeat(self.step // cols)  # whole rows, at most the strip
            self._index = torch.empty(self.step, dtype=torch.int32)
        assert self._tiled is not None and self._index is not None
        tiled = self._tiled.numel()
        at = 0
        while first < last:
            r, c = divmod(first, cols)
            rb = (self.row0 + r) // br
            block_end = ((rb + 1) * br - self.row0) * cols  # the row block's last element, + 1
            n = min(last, block_end, first + tiled - c) - first  # c + n within the tiled rows
            index = self._index[:n]
            index.copy_(self._codes[first : first + n])
            index.add_(self._tiled[c : c + n])
            torch.index_select(self._products(rb), 0, index, out=out[at : at + n])
            first += n
            at += n

    def _products(self, rb: int) -> torch.Tensor:
        """Row block ``rb``'s (column block, code) products in ``dtype``, as dequantize_fp8 makes them."""
        if self._table is None or self._table[0] != rb:
            self._table = None  # the old table goes before the new one is made
            first_cb = self.col0 // self.block[1]
            blocks = self.scale[rb, first_cb : first_cb + self.ncb].to(torch.float32)
            products = (blocks.reshape(-1, 1) * fp8_values(self.weight.dtype)).to(self.dtype).reshape(-1)
            self._table = (rb, products)
        return self._table[1]


def _tensor_at(address: int, nbytes: int) -> torch.Tensor:
    """The ``nbytes`` at ``address`` (memory the caller owns for the call) as a uint8 tensor."""
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8)
