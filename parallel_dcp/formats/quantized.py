"""The arithmetic of quantized checkpoints: FP8 block-scaled and MXFP4, on CPU, vectorised.

    FP8 (DeepSeek-V3/R1, Qwen3 FP8):  X.weight  float8_e4m3fn [R, C]
                                      X.weight_scale_inv float32 [ceil(R/Br), ceil(C/Bc)]
        value = bf16( float32(w) * float32(scale[r // Br, c // Bc]) )
    MXFP4 (gpt-oss):                  X_blocks  uint8 [..., G, B]   two e2m1 values per byte (low nibble first)
                                      X_scales  uint8 [..., G]      E8M0 exponent, biased by 127
        value = ldexp(lut[nibble] in the target dtype, exponent - 127)  -> X [..., G * B * 2]
        experts (X_blocks [E, N, G, B]): X [E, G * B * 2, N], transformers' layout (see below)

Dequantizing repeats, operation for operation, what stock
``torch.distributed.checkpoint.quantized_hf_storage.QuantizedHuggingFaceStorageReader`` computes
(torch 2.13), so the values are equal bit for bit: for FP8 a float32 product of the upcast weight
and the block's scale, rounded once to the target dtype; for MXFP4 the same lookup table in the
target dtype and the same ``torch.ldexp``. Where stock loops over every 128 x 128 block in Python,
these functions take a strip of whole row blocks at a time: FP8 as one lookup per element in a
table of every (block, code) product, MXFP4 as one lookup per byte in a table of every
(exponent, byte) pair's two values; the tables are made by stock's own operations, and
temporaries are bounded by the strip.

MXFP4 expert tensors are written in the layout transformers' ``GptOssExperts`` holds and its
bf16 gpt-oss checkpoints store: ``gate_up_proj [E, hidden, 2 * intermediate]`` and ``down_proj
[E, intermediate, hidden]``, the transpose of the packed rows (``N`` is a row of the output, the
groups run along the input): the same values as transformers' own ``convert_moe_packed_tensors``.
The gpt-oss reference loader's ``[E, N, G * B * 2]`` loads into transformers transposed, and
silently so where hidden = intermediate (every released gpt-oss).

Quantizing writes the DeepSeek layout: one float32 scale per block, ``amax / 448`` (448 is
e4m3's largest finite value), and ``w / scale`` rounded to e4m3. A block of zeros gets the
scale 1.0 (its values are 0 whatever the scale; 0 would make ``w / scale`` a NaN).

Longer than 300 lines because the three kernels (FP8 and MXFP4 dequantize, FP8 quantize) share
their tables, strip sizes and the work bound that admission counts (``dequantize_work_bytes``,
``quantize_work_bytes``): split apart, a strip changed in one would silently leave the bound in
another wrong.
"""

from __future__ import annotations

import math

import torch

from parallel_dcp.errors import dtype_name

__all__ = [
    "DEFAULT_BLOCK",
    "DEQUANTIZE_WORK_BYTES",
    "E8M0_NAN",
    "FP4_VALUES",
    "FP8_DTYPES",
    "FP8_MAX",
    "MAX_BLOCK",
    "QUANTIZE_STRIP_ELEMENTS",
    "STRIP_ELEMENTS",
    "dequantize_fp8",
    "dequantize_mxfp4",
    "dequantize_mxfp4_experts",
    "dequantize_work_bytes",
    "fp8_scale_shape",
    "fp8_values",
    "mxfp4_is_experts",
    "mxfp4_shape",
    "quantize_fp8",
    "quantize_work_bytes",
]

DEFAULT_BLOCK = 128
# The largest block size accepted (from quantize="fp8-block:B", block_size= or a config's
# weight_block_size): a block as large as a tensor is one block, and block arithmetic stays
# far inside torch's int64 (a 20-digit block failed in a worker with a TypeError).
MAX_BLOCK = 1 << 20
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
E8M0_NAN = 255  # the one E8M0 code that is not a power of two
# e2m1 values by nibble, as stock and gpt-oss decode them.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Elements of a dequantizing strip: its int32 index buffer (1 MiB) stays in a core's L2 cache and is
# reused strip after strip. 16 MiB strips, each index freshly allocated, spent more time in page
# faults than in the arithmetic (5504 x 2048 FP8 -> bf16: 60 ms, against 12 ms now; one core).
STRIP_ELEMENTS = 256 * 1024
# What dequantizing holds beside its input and output, per element of the strip at most: FP8, 4 B
# of int32 indices, a (block, code) table of at most a quarter of the strip's elements (float32
# and the output dtype: 2 B), and 4 B of gathered products for a strip not contiguous in the
# output; or, with small blocks, the upcast strip, its spread scales and their column spread
# (4 B each) and the rows' block numbers (4 B); MXFP4, its int32 indices and a strip of output
# to transpose (4 B each).
_WORK_PER_ELEMENT = 16
DEQUANTIZE_WORK_BYTES = _WORK_PER_ELEMENT * STRIP_ELEMENTS
# Rows of a strip copied into a transposed (expert) output: a multiple of this where it fits.
_TRANSPOSE_ROWS = 64
# Elements of a quantizing strip (four float32 temporaries of it: see quantize_work_bytes).
QUANTIZE_STRIP_ELEMENTS = 4 * 1024 * 1024
_FP8_TABLES: dict[torch.dtype, torch.Tensor] = {}  # FP8 code -> float32, made on first use
_MXFP4_TABLES: dict[torch.dtype, torch.Tensor] = {}  # (exponent, byte) -> two values, made on first use


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale tensor's shape for a 2-D weight of ``shape``: one entry per (partial) block."""
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def dequantize_fp8(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    block: tuple[int, int] = (DEFAULT_BLOCK, DEFAULT_BLOCK),
    *,
    row0: int = 0,
    col0: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``weight`` (rows ``row0:`` and columns ``col0:`` of a block-scaled FP8 weight) dequantized
    to ``dtype`` with ``scale``, the whole weight's scale tensor (global block coordinates);
    written into ``out`` (``dtype``, the weight's shape) when given, else into a new tensor.

    Each value is ``dtype(float32(code) * float32(scale))``, the product stock computes (its
    ``float32 block * 0-dim scale`` promotes the scale to float32), rounded once. The weight is
    taken a strip of whole rows at a time (whole row blocks where they fit); where the strip has
    far fewer (block, code) pairs than elements (128 x 128 blocks), the products are made once
    per (block, code) of the strip, by those very operations, and each element is one lookup of
    its block's product for its code. The lookup's int32 indices live in one buffer of the
    strip's size, made once per call and reused by every strip: a fresh 16 MiB index per strip
    cost more in page faults than the arithmetic. Where small blocks (a legal ``[2, 2]``) would
    make the table larger than the strip, the strip is upcast and multiplied by its blocks'
    scales directly (the same two operations, element by element).

    Temporaries are bounded by the strip (at most :data:`STRIP_ELEMENTS` elements, and never more
    than the weight's): :func:`dequantize_work_bytes` of its elements, whatever its shape or block.

    Raises:
        ValueError: ``weight`` is not FP8.
    """
    if weight.dtype not in FP8_DTYPES:
        raise ValueError(f"block-scaled dequantization needs an FP8 weight, not {dtype_name(weight.dtype)}")
    rows, cols = weight.shape
    if out is None:
        out = torch.empty((rows, cols), dtype=dtype)
    elif out.dtype != dtype or tuple(out.shape) != (rows, cols):
        wanted = f"{dtype_name(dtype)} {[rows, cols]}"
        raise ValueError(f"out must be {wanted}, not {dtype_name(out.dtype)} {list(out.shape)}")
    if rows == 0 or cols == 0:
        return out
    br, bc = block
    codes = fp8_values(weight.dtype)
    raw = weight.view(torch.uint8)
    col_step = min(cols, STRIP_ELEMENTS)
    row_step = max(1, STRIP_ELEMENTS // col_step)
    buffer = torch.empty(min(rows, row_step) * col_step, dtype=torch.int32)  # the strip's indices
    for c in range(0, cols, col_step):
        c_end = min(cols, c + col_step)
        # each column's block, relative to the strip's first block column
        first_cb = (col0 + c) // bc
        col_blocks = ((torch.arange(col0 + c, col0 + c_end) // bc) - first_cb).to(torch.int32)
        ncb = int(col_blocks[-1]) + 1
        for r in range(0, rows, row_step):
            r_end = min(rows, r + row_step)
            first_rb = (row0 + r) // br
            nrb = (row0 + r_end - 1) // br - first_rb + 1
            blocks = scale[first_rb : first_rb + nrb, first_cb : first_cb + ncb].to(torch.float32)
            target = out[r:r_end, c:c_end]
            if nrb * ncb * 256 * 4 > target.numel():
                _multiply_strip(weight[r:r_end, c:c_end], blocks, row0 + r, br, col_blocks, target)
                continue
            products = (blocks.reshape(-1, 1) * codes).to(dtype).reshape(-1)  # [block][code]
            index = buffer[: target.numel()].view(r_end - r, c_end - c)
            index.copy_(raw[r:r_end, c:c_end])
            index.add_(col_blocks.mul(256))
            if nrb > 1:
                row_blocks = (torch.arange(row0 + r, row0 + r_end) // br - first_rb).to(torch.int32)
                index.add_(row_blocks.mul_(ncb * 256).view(-1, 1))
            if target.is_contiguous():
                torch.index_select(products, 0, index.view(-1), out=target.view(-1))
            else:
                target.copy_(torch.index_select(products, 0, index.view(-1)).view_as(target))
            del products
    return out


def _multiply_strip(
    piece: torch.Tensor, blocks: torch.Tensor, first_row: int, br: int, col_blocks: torch.Tensor, target: torch.Tensor
) -> None:
    """Small blocks: ``target = dtype(float32(code) * float32(scale))`` element by element (the
    strip upcast, its blocks' scales spread over its columns, then over its rows, and the rows'
    block numbers: at most 16 B an element of the strip)."""
    upcast = piece.to(torch.float32)
    spread = blocks.index_select(1, col_blocks)
    if br > 1:
        first = torch.arange(first_row, first_row + piece.shape[0], dtype=torch.int32)
        spread = spread.index_select(0, first.div_(br, rounding_mode="floor").sub_(first_row // br))
    upcast.mul_(spread)
    target.copy_(upcast)  # rounds once to dtype, as .to(dtype) does


def dequantize_work_bytes(elements: int) -> int:
    """What dequantizing ``elements`` output elements (FP8 or MXFP4) holds beside its input and
    output at most: the temporaries of a strip, which never exceeds the unit being converted."""
    return _WORK_PER_ELEMENT * min(max(elements, 0), STRIP_ELEMENTS)


def fp8_values(dtype: torch.dtype) -> torch.Tensor:
    """Every code of an FP8 ``dtype`` as float32, by torch's own conversion (made on first use)."""
    table = _FP8_TABLES.get(dtype)
    if table is None:
        table = _FP8_TABLES[dtype] = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32)
    return table


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """MXFP4 ``blocks`` ``[..., G, B]`` (uint8) with E8M0 ``scales`` ``[..., G]`` as ``dtype``
    ``[..., G * B * 2]``, equal to stock's: its e2m1 table in ``dtype``, then
    ``torch.ldexp(values, exponent - 127, out=values)``; written into ``out`` (contiguous, of
    that many elements) when given.

    A byte and an exponent have 256 values each, so every (exponent, byte) pair's two outputs
    are made once, by exactly those operations, into a table of 256 x 256 x 2; each byte of the
    input is then one lookup of its pair (instead of two gathers, interleaved stores and an
    ``ldexp`` that converts each element twice). The lookup's int32 indices live in one buffer of
    a strip's size (:data:`STRIP_ELEMENTS` bytes of input), reused strip after strip.
    """
    *prefix, groups, width = blocks.shape
    rows = math.prod(prefix) * groups
    flat = blocks.reshape(rows, width)
    exponents = scales.reshape(rows, 1)
    table = _mxfp4_table(dtype).view(-1, 2)
    out = torch.empty(rows, width * 2, dtype=dtype) if out is None else out.view(rows, width * 2)
    step = max(1, STRIP_ELEMENTS // max(width, 1))  # int32 indices, 4 bytes a byte
    buffer = torch.empty(min(rows, step) * width, dtype=torch.int32)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        index = buffer[: (r1 - r0) * width].view(r1 - r0, width)
        index.copy_(flat[r0:r1])
        index.add_(exponents[r0:r1].to(torch.int32).mul_(256))
        torch.index_select(table, 0, index.view(-1), out=out[r0:r1].view(-1, 2))
    return out.view(*prefix, groups * width * 2)


def mxfp4_is_experts(blocks_shape: tuple[int, ...]) -> bool:
    """Whether MXFP4 blocks of ``blocks_shape`` are stacked experts (``[E, N, G, B]``), which
    dequantize to transformers' ``[E, G * B * 2, N]``; other ranks keep ``[..., N, G * B * 2]``
    (a 2-D one is already ``nn.Linear``'s ``[out, in]``)."""
    return len(blocks_shape) == 4


def mxfp4_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The dequantized shape of MXFP4 blocks ``blocks_shape`` (see :func:`mxfp4_is_experts`)."""
    *prefix, rows, groups, width = blocks_shape
    if mxfp4_is_experts(blocks_shape):
        return (*prefix, groups * width * 2, rows)
    return (*prefix, rows, groups * width * 2)


def dequantize_mxfp4_experts(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Expert MXFP4 ``blocks`` ``[E, N, G, B]`` with ``scales`` ``[E, N, G]`` as ``dtype``
    ``[E, G * B * 2, N]``: :func:`dequantize_mxfp4`'s values, transposed per expert.

    Rows are dequantized a strip at a time (about ``STRIP_ELEMENTS`` values, whole experts when
    they fit) and each strip is copied into the output transposed, so the temporaries are bounded
    by the strip, not by the tensor.
    """
    experts, rows, groups, width = blocks.shape
    cols = groups * width * 2
    out = torch.empty((experts, cols, rows), dtype=dtype)
    if out.numel() == 0:
        return out
    per_expert = rows * cols
    # One strip buffer for the whole call: each strip is dequantized into it, then copied out.
    if per_expert <= STRIP_ELEMENTS:  # whole experts a strip
        step = STRIP_ELEMENTS // per_expert
        buffer = torch.empty(min(experts, step) * per_expert, dtype=dtype)
        for e0 in range(0, experts, step):
            e1 = min(experts, e0 + step)
            strip = dequantize_mxfp4(blocks[e0:e1], scales[e0:e1], dtype, out=buffer[: (e1 - e0) * per_expert])
            out[e0:e1].copy_(strip.transpose(1, 2))
        return out
    step = max(1, STRIP_ELEMENTS // cols)
    # Whole cache lines of the transposed output a row: 64 rows a strip copy at about twice the
    # speed of 91 (gpt-oss's 2880 columns) into the strided output.
    step -= step % _TRANSPOSE_ROWS if step > _TRANSPOSE_ROWS else 0
    buffer = torch.empty(min(rows, step) * cols, dtype=dtype)
    for e in range(experts):
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            strip = dequantize_mxfp4(blocks[e, r0:r1], scales[e, r0:r1], dtype, out=buffer[: (r1 - r0) * cols])
            out[e, :, r0:r1].copy_(strip.t())
    return out


def _mxfp4_table(dtype: torch.dtype) -> torch.Tensor:
    """``[exponent code, byte, nibble]``: stock's ``ldexp(lut[nibble], exponent - 127)`` in ``dtype``."""
    table = _MXFP4_TABLES.get(dtype)
    if table is None:
        lut = torch.tensor(FP4_VALUES, dtype=dtype)
        byte = torch.arange(256, dtype=torch.int64)
        pairs = torch.stack((lut[byte & 0x0F], lut[byte >> 4]), dim=1)  # low nibble first
        table = pairs.unsqueeze(0).expand(256, 256, 2).contiguous()
        exponent = (torch.arange(256, dtype=torch.int32) - 127).view(256, 1, 1)
        torch.ldexp(table, exponent, out=table)
        _MXFP4_TABLES[dtype] = table
    return table


def quantize_fp8(
    weight: torch.Tensor, block: tuple[int, int] = (DEFAULT_BLOCK, DEFAULT_BLOCK)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (2-D, floating; whole row blocks: its first row starts a block) as
    (float8_e4m3fn values, float32 scales ``[ceil(R/Br), ceil(C/Bc)]``) in the DeepSeek layout:
    ``scale = amax(|block|) / 448`` (1.0 for an all-zero block), ``value = e4m3(w / scale)``."""
    rows, cols = weight.shape
    scales = torch.empty(fp8_scale_shape((rows, cols), block), dtype=torch.float32)
    values = torch.empty((rows, cols), dtype=torch.float8_e4m3fn)
    if rows == 0 or cols == 0:
        return values, scales
    br, bc = _effective_block(rows, cols, block)
    padded_cols = scales.shape[1] * bc
    step = _quantize_step(padded_cols, br)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        strip = weight[r0:r1].to(torch.float32, copy=True)  # never the caller's tensor: it is divided in place
        nrb = math.ceil((r1 - r0) / br)
        # Zero padding to whole blocks leaves every block's amax as it is.
        padded = torch.nn.functional.pad(strip.abs(), (0, padded_cols - cols, 0, nrb * br - (r1 - r0)))
        amax = padded.view(nrb, br, scales.shape[1], bc).amax(dim=(1, 3))
        del padded
        scale = amax / FP8_MAX
        scale[amax == 0] = 1.0
        scales[r0 // br : r0 // br + nrb] = scale
        per_column = scale.repeat_interleave(bc, dim=1)[:, :cols].repeat_interleave(br, dim=0)[: r1 - r0]
        strip.div_(per_column).clamp_(-FP8_MAX, FP8_MAX)
        values[r0:r1] = strip.to(torch.float8_e4m3fn)
    return values, scales


def _effective_block(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    """``block`` cut to the weight: a block larger than the weight is one block either way, and
    padding to it would allocate the whole block."""
    return max(1, min(block[0], rows)), max(1, min(block[1], cols))


def _quantize_step(padded_cols: int, block_rows: int) -> int:
    """Rows a quantizing strip takes: whole row blocks, half the dequantizing strip's elements (a
    quantizing strip has four float32 temporaries: the strip, its magnitudes, their padding, the
    scales spread over it), at least one row block."""
    return max(1, QUANTIZE_STRIP_ELEMENTS // 2 // max(padded_cols * block_rows, 1)) * block_rows


def quantize_work_bytes(rows: int, cols: int, block: tuple[int, int]) -> int:
    """The float32 temporaries :func:`quantize_fp8` holds at once for a ``rows`` x ``cols``
    weight (the strip, its magnitudes, their padding to whole blocks, the spread scales)."""
    if rows == 0 or cols == 0:
        return 0
    br, bc = _effective_block(rows, cols, block)
    padded_cols = math.ceil(cols / bc) * bc
    strip_rows = min(rows, _quantize_step(padded_cols, br))
    padded_rows = math.ceil(strip_rows / br) * br
    return 4 * (3 * strip_rows * cols + padded_rows * padded_cols)
