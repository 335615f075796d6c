"""A checkpoint seen as its FP8 block-quantized form (the DeepSeek layout).

    inner source                         QuantizingSource (what the job plans)
      X.weight  bf16 [R, C]   ──┬──▶  X.weight            float8_e4m3fn [R, C]
                                └──▶  X.weight_scale_inv  float32 [ceil(R/B), ceil(C/B)]
      anything else            ───▶  as it is (cast to ``dtype`` when one is given)

Which weights are quantized: those the ``quantize_keys`` patterns select (the ``keys`` pattern
language), or by default :data:`DEFAULT_RULE`: 2-D floating tensors whose names end in
``.weight``, except embeddings, norms, the output head and MoE routers (``*.gate.weight``, as
Mixtral, Qwen and DeepSeek name them; ``*.router.weight``, as gpt-oss does), which the releases
and transformers' ``modules_to_not_convert`` keep in bf16; and, where the job knows the model
(``replaced``, from jobs/fp8_layers.py), only the weights transformers' FP8 path loads into FP8
layers (its nn.Linear modules, not those ``_keep_in_fp32_modules`` names), judged by the names it
loads them as; one it cannot place is left plain, with a warning. Both output units of a
weight read the weight: when one task holds both, it is quantized once; a huge weight splits into
row ranges of whole blocks (:meth:`QuantizingSource.split_alignment`), each quantized on its own
(every block's scale depends on its rows only, so the pieces equal the whole).

Longer than 300 lines because the view and the choice of its weights (the rule, the partial-block
and layer checks, each with the message that explains it) share the block arithmetic.
"""

from __future__ import annotations

import fnmatch
import math
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from parallel_dcp.errors import QuantizationError, describe_keys
from parallel_dcp.formats.base import Entry, Source
from parallel_dcp.formats.dequantized_source import SCALE_SUFFIX
from parallel_dcp.formats.quantized import (
    DEFAULT_BLOCK,
    FP8_DTYPES,
    MAX_BLOCK,
    fp8_scale_shape,
    quantize_fp8,
    quantize_work_bytes,
)
from parallel_dcp.formats.quantized_pairs import refuse_quantized
from parallel_dcp.formats.wrapped_source import WrappedSource

if TYPE_CHECKING:
    from parallel_dcp.engine.chunks import Chunk

__all__ = [
    "DEFAULT_RULE",
    "QuantizingSource",
    "default_quantize_rule",
    "parse_quantize",
    "quantizing_source",
]

DEFAULT_RULE = (
    "2-D floating tensors whose names end in '.weight', except embeddings ('embed', 'wte', 'wpe'), "
    "norms ('norm'), the output head ('lm_head', 'output.weight') and MoE routers ('*.gate.weight', "
    "'*.router.weight'); of a model transformers knows, only the weights of the nn.Linear modules its FP8 "
    "layers replace (not those its _keep_in_fp32_modules names)"
)
_EXCLUDED = re.compile(r"embed|norm|lm_head|(^|\.)(wte|wpe)\.|(^|\.)output\.weight$|(^|\.)(gate|router)\.weight$")
# The float32 temporaries of quantizing (four of an 8 MiB strip), and what the heap keeps of them
# (measured: about 44 MiB at the peak, 68 MiB still held after a 5504 x 2048 weight).
_WORK_BYTES = 64 * 1024 * 1024


def parse_quantize(spec: str) -> tuple[int, int]:
    """The block of ``"fp8-block"`` (128 x 128) or ``"fp8-block:BLOCK"``.

    Raises:
        QuantizationError: any other spec.
    """
    name, _, size = spec.partition(":")
    if name != "fp8-block":
        raise QuantizationError(f"unknown quantization {spec!r}: use 'fp8-block' or 'fp8-block:BLOCK'")
    if not size:
        return (DEFAULT_BLOCK, DEFAULT_BLOCK)
    if not size.isdigit() or not 1 <= int(size) <= MAX_BLOCK:
        raise QuantizationError(f"the block of {spec!r} must be an integer from 1 to {MAX_BLOCK}")
    return (int(size), int(size))


def default_quantize_rule(entry: Entry, replaced: Callable[[str], bool | None] | None = None) -> bool:
    """:data:`DEFAULT_RULE` for one tensor; ``replaced`` says whether transformers' FP8 path loads
    a key into an FP8 layer (True), as a plain tensor (False), or that it cannot tell (None: left
    plain, never quantized as if replaced); without ``replaced`` the names decide."""
    if not _quantizable(entry) or _EXCLUDED.search(entry.key):
        return False
    return replaced is None or replaced(entry.key) is True


def _quantizable(entry: Entry) -> bool:
    floating = entry.dtype.is_floating_point and entry.dtype not in FP8_DTYPES
    return floating and len(entry.shape) == 2 and entry.key.endswith(".weight")


def _matcher(patterns: str | Sequence[str]) -> Any:
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern[3:] if pattern.startswith("re:") else fnmatch.translate(pattern)))
        except re.error as exc:
            raise QuantizationError(f"bad regular expression in quantize_keys {pattern!r}: {exc}") from exc
    return lambda key: any(p.fullmatch(key) for p in compiled)


@dataclass
class QuantizingSource(WrappedSource):
    """``inner`` with the weights in ``weights`` quantized to FP8 blocks, and other floats cast to ``dtype``."""

    block: tuple[int, int] = (DEFAULT_BLOCK, DEFAULT_BLOCK)
    dtype: torch.dtype | None = None
    weights: dict[str, str] = field(default_factory=dict)  # output key -> inner weight (both units)
    keep: frozenset[str] = frozenset()  # keys ``dtype`` leaves (jobs/kept_float32.py)
    # the modules transformers loads weights left plain into, where it names them otherwise (its renames)
    loaded_plain: tuple[str, ...] = ()

    def check(self, keys: Iterable[str] | None = None) -> None:
        keys = None if keys is None else list(dict.fromkeys(self.weights.get(k, k) for k in keys))
        self._inner().check(keys)

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        keys = list(keys)
        plain = [k for k in keys if k not in self.weights]
        out = self._cast(self._inner().read(plain))
        for weight in dict.fromkeys(self.weights[k] for k in keys if k in self.weights):
            values, scales = quantize_fp8(self._inner().read([weight])[weight], self.block)
            out |= {weight: values, weight + SCALE_SUFFIX: scales}
        return {k: out[k] for k in keys}

    def _cast(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.dtype is None:
            return data
        return {k: v.to(self.dtype) if v.dtype.is_floating_point and k not in self.keep else v for k, v in data.items()}

    def read_chunk(self, chunk: Chunk) -> torch.Tensor:
        weight = self.weights.get(chunk.key)
        if weight is None:
            return self._cast({chunk.key: self._inner().read_chunk(chunk)})[chunk.key]
        if chunk.dim != 0:  # only row ranges of whole blocks quantize on their own
            return chunk.of(self.read([chunk.key])[chunk.key]).contiguous()
        rows = self._inner().entries[weight].shape[0]
        br = self.block[0]
        scale_rows = chunk.key != weight
        # The rows of whole blocks holding the chunk (a scale chunk's rows are blocks).
        first = chunk.start * br if scale_rows else chunk.start // br * br
        stop = min(rows, (chunk.stop * br if scale_rows else math.ceil(chunk.stop / br) * br))
        inner = self._inner()
        piece = inner.read_chunk(_rows(inner.entries[weight], first, stop))
        values, scales = quantize_fp8(piece, self.block)
        if scale_rows:
            return scales
        return values[chunk.start - first : chunk.stop - first].contiguous()

    def split_alignment(self, key: str, dim: int) -> int:
        weight = self.weights.get(key)
        return self.block[dim] if weight == key and dim < 2 else 1

    def copied_bytes(self, key: str) -> int:
        weight = self.weights.get(key)
        if weight is None:
            entry = self._inner().entries.get(key)
            cast = entry.nbytes // entry.dtype.itemsize * self.dtype.itemsize if entry and self.dtype else 0
            return self._inner().copied_bytes(key) + cast
        entry = self._inner().entries[weight]
        # the weight read, its float32 temporaries, and both outputs
        elements = entry.nbytes // entry.dtype.itemsize
        return self._inner().copied_bytes(weight) + elements + self._work(entry.shape[0], entry.shape)

    def chunk_memory(self, chunk: Chunk) -> int:
        weight = self.weights.get(chunk.key)
        if weight is None:
            return self._inner().chunk_memory(chunk)
        if chunk.dim != 0:
            return self.copied_bytes(chunk.key) + chunk.nbytes(self.entries[chunk.key].dtype.itemsize)
        entry = self._inner().entries[weight]
        rows = chunk.stop - chunk.start + self.block[0]
        read = self._inner().chunk_memory(_rows(entry, 0, min(entry.shape[0], rows)))
        elements = read // entry.dtype.itemsize
        return read + elements + self._work(min(entry.shape[0], rows), entry.shape)

    def _work(self, rows: int, shape: tuple[int, ...]) -> int:
        """The arithmetic's temporaries for ``rows`` rows of a weight of ``shape``: what the
        heap was measured to keep, or the strip's own bound where large blocks make it larger."""
        elements = rows * math.prod(shape[1:])
        return max(min(16 * elements, _WORK_BYTES), quantize_work_bytes(rows, math.prod(shape[1:]), self.block))

    def release(self) -> None:
        self._inner().release()

    def fingerprint(self) -> dict[str, Any]:
        # What the output is made of includes the arithmetic: a resume must not mix blocks or dtypes.
        cast = str(self.dtype).removeprefix("torch.") if self.dtype is not None else None
        kept = {"keep": sorted(self.keep)} if self.keep else {}
        return self._inner().fingerprint() | {"quantize": {"block": list(self.block), "dtype": cast, **kept}}


def _rows(entry: Entry, start: int, stop: int) -> Chunk:
    from parallel_dcp.engine.chunks import Chunk

    return Chunk(entry.key, 0, start, stop, entry.shape)


def _whole_blocks_or_warn(
    source: Source, chosen: list[str], block: tuple[int, int], *, chosen_by_rule: bool
) -> list[str]:
    """``chosen`` without the weights that span more than one block and end in a partial one (a
    side longer than the block and not a multiple of it), where the default rule chose them; with a
    warning naming them either way. transformers 5 (``Fp8Dequantize``) takes the block from the
    shapes (rows // scale rows), not from ``weight_block_size``: a 192-row weight of 128-row blocks
    is dequantized in 96-row blocks with the wrong scales and no error, a 576-row one fails. (A
    side no longer than the block is one block either way.) Left unquantized, such a weight is
    listed in ``modules_to_not_convert`` and loads as it is."""
    partial = [k for k in chosen if any(n > b and n % b for n, b in zip(source.entries[k].shape, block, strict=True))]
    if not partial:
        return chosen
    named = ", ".join(f"{k} {list(source.entries[k].shape)}" for k in partial[:4])
    more = f" and {len(partial) - 4} more" if len(partial) > 4 else ""
    grid = f"{block[0]}x{block[1]}"
    if chosen_by_rule:
        warnings.warn(
            f"{len(partial)} weights span several {grid} blocks and end in a partial one ({named}{more}): "
            "left unquantized (and listed in "
            "modules_to_not_convert), as transformers 5 dequantizes a partial block with another block's scale; "
            "a block size that divides them quantizes them, and quantize_keys (--quantize-keys) quantizes them anyway",
            stacklevel=4,
        )
        return [k for k in chosen if k not in set(partial)]
    warnings.warn(
        f"{len(partial)} weights span several {grid} blocks and end in a partial one ({named}{more}): "
        "quantized with partial edge blocks "
        "(the DeepSeek layout), which transformers 5 dequantizes with another block's scale or refuses; "
        "a block size that divides them avoids it",
        stacklevel=4,
    )
    return chosen


def _warn_unplaced(source: Source, keys: Sequence[str], replaced: Callable[[str], bool | None], layers: str) -> None:
    """Say which weights the names would have quantized and the model cannot place (renamed by
    transformers onto no parameter, or to a name that cannot be known): left plain. Quantized,
    they would load as raw FP8 codes wherever transformers loads them into a plain module."""
    unplaced = [
        k for k in keys if k in source.entries and default_quantize_rule(source.entries[k]) and replaced(k) is None
    ]
    if unplaced:
        warnings.warn(
            f"{len(unplaced)} weights are left unquantized (and listed in modules_to_not_convert), as {layers} "
            f"has no weight transformers loads them into, under the names it renames them to on load, or those "
            f"names cannot be known ({describe_keys(unplaced)}); quantize_keys (--quantize-keys) quantizes them "
            "anyway, for a reader that dequantizes every pair",
            stacklevel=5,
        )


def quantizing_source(
    source: Source,
    keys: Sequence[str],
    block: tuple[int, int],
    quantize_keys: str | Sequence[str] | None = None,
    dtype: torch.dtype | None = None,
    keep: frozenset[str] = frozenset(),
    replaced: Callable[[str], bool | None] | None = None,
    layers: str = "",
    loaded_module: Callable[[str], str | None] | None = None,
) -> tuple[QuantizingSource, tuple[str, ...]]:
    """``source`` restricted to ``keys`` with the weights the rule selects quantized; the output
    keys in order (each weight followed by its scale). ``replaced`` narrows the default rule to
    the weights transformers' FP8 path loads into FP8 layers (``layers`` names them, for errors);
    a weight it cannot place is left plain, with a warning. ``loaded_module``: the module
    transformers loads a weight into, where it renames it on load (kept plain by that name too).

    Raises:
        QuantizationError: ``keys`` hold quantized tensors already (FP8 weights or scales, MXFP4
            blocks), the rule selects no weight, or a weight's scale name is taken.
    """
    refuse_quantized(source, keys)

    def rule(entry: Entry) -> bool:
        return default_quantize_rule(entry, replaced)

    if quantize_keys is not None:
        match = _matcher(quantize_keys)

        def rule(entry: Entry) -> bool:  # the user's patterns in place of the default
            return _quantizable(entry) and bool(match(entry.key))

    selected = [k for k in keys if k in source.entries and rule(source.entries[k])]
    if quantize_keys is None and replaced is not None:
        _warn_unplaced(source, keys, replaced, layers)
    chosen = _whole_blocks_or_warn(source, selected, block, chosen_by_rule=quantize_keys is None)
    outside = [k for k in chosen if replaced is not None and replaced(k) is False]
    if outside:  # the user's patterns chose them (the default rule never does)
        warnings.warn(
            f"quantize_keys selects {len(outside)} weights that {layers} does not load into transformers' FP8 "
            f"layers ({describe_keys(outside)}): transformers loads their FP8 codes as the weights where it does "
            "not dequantize (a GPU); only a reader that dequantizes every pair reads them right",
            stacklevel=4,
        )
    if not chosen:
        what = f"quantize_keys {quantize_keys!r}" if quantize_keys is not None else f"the default rule ({DEFAULT_RULE})"
        why = ""
        left = [k for k in keys if k in source.entries and default_quantize_rule(source.entries[k])]
        if quantize_keys is None and left and not selected:
            why = (
                f": {layers} loads none of its {len(left)} weights named as quantizable ({describe_keys(left)}) "
                "into transformers' FP8 layers (they replace nn.Linear modules only, and not those its "
                "_keep_in_fp32_modules names); quantize_keys (--quantize-keys) quantizes them anyway, for a reader "
                "that dequantizes every pair"
            )
        elif selected:
            why = (
                f": the {len(selected)} it selects end in partial {block[0]}x{block[1]} blocks "
                "(see the warning); give a block size that divides them"
            )
        raise QuantizationError(f"{what} selects no weight to quantize in {source.path}{why}")
    taken = [k + SCALE_SUFFIX for k in chosen if k + SCALE_SUFFIX in source.entries or k + SCALE_SUFFIX in keys]
    if taken:
        raise QuantizationError(f"{source.path} already holds the scales {taken[:5]}: is it quantized already?")
    view = QuantizingSource.around(source, block=block, dtype=dtype, keep=keep)
    chosen_set = set(chosen)
    if loaded_module is not None:
        plain = (k for k in keys if k in source.entries and k not in chosen_set and _quantizable(source.entries[k]))
        view.loaded_plain = tuple(sorted({m for m in map(loaded_module, plain) if m is not None}))
    out: list[str] = []
    for key in keys:
        path = source.mapping.get(key, (key,))
        entry = source.entries.get(key)
        if entry is None:
            view.values[key] = source.values[key]
            view.mapping[key] = path
            out.append(key)
            continue
        if key not in chosen_set:
            cast = dtype if dtype is not None and entry.dtype.is_floating_point and key not in keep else entry.dtype
            view.entries[key] = Entry(key, cast, entry.shape, entry.file)
            view.mapping[key] = path
            out.append(key)
            continue
        scale = key + SCALE_SUFFIX
        view.entries[key] = Entry(key, torch.float8_e4m3fn, entry.shape, entry.file)
        view.entries[scale] = Entry(scale, torch.float32, fp8_scale_shape(entry.shape, block), entry.file)
        view.weights[key] = view.weights[scale] = key
        view.mapping[key] = path
        view.mapping[scale] = (*path[:-1], f"{path[-1]}{SCALE_SUFFIX}")
        out += [key, scale]
    return view, tuple(out)
