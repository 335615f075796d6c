"""Quantized pairs kept whole by a conversion's selection, and named as readers pair them.

    select keys ── check_pairs_selected: no FP8 weight or MXFP4 blocks kept without its scales (or the reverse)
    rename ─────── check_pairs_named: every pair kept is still named as a reader pairs it

Readers pair a quantized tensor with its scale by name only. transformers, under the
``quantization_config`` a plain conversion keeps in ``config.json``, loads an FP8 weight whose
scale was left out as its raw codes (up to 448 where the weights were below 0.1), with no error
(review s17 F7); a DCP or single-file output of codes without their scales is as wrong for whoever
dequantizes it later. Both checks run before anything is written, with the pairing rule of
:func:`parallel_dcp.formats.quantized_pairs.named_pairs`. A dequantizing conversion has no pair
left to part (its keys name the dequantized weights); a quantizing one refuses a quantized
source and makes its own pairs whole, so only its rename is checked.
"""

from __future__ import annotations

from collections.abc import Sequence

from parallel_dcp.errors import QuantizationError, plural
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.quantized_pairs import Pair, named_pairs, scale_name
from parallel_dcp.formats.renamed_source import RenamedSource

__all__ = ["check_pairs_named", "check_pairs_selected"]

_SHOWN = 5  # problems an error names before '... and N more'
_RULE = "a reader pairs X.weight with X.weight_scale_inv and X_blocks with X_scales, by name only"
_VALUES = {"fp8": "FP8 weight", "fp8-channel": "per-channel FP8 weight", "mxfp4": "MXFP4 blocks"}
_SCALES = {"fp8": "its scale", "fp8-channel": "its per-channel scale", "mxfp4": "their scales"}


def check_pairs_selected(source: Source, selected: Sequence[str]) -> None:
    """Every quantized pair of ``source`` (:func:`~parallel_dcp.formats.quantized_pairs.named_pairs`)
    is in ``selected`` whole, or not at all: a selection of plain tensors only is fine.

    Raises:
        QuantizationError: the pairs the selection parts (the first 5 and the count; ``keys``: the
            halves kept), and what to do, before anything is written.
    """
    chosen = set(selected)
    parted = [pair for pair in named_pairs(source.entries) if (pair.values in chosen) != (pair.scale in chosen)]
    if not parted:
        return
    problems = [_parted(pair, pair.values in chosen) for pair in parted]
    dequantizable = any(pair.kind != "fp8-channel" for pair in parted)
    advice = (
        "add dequantize=True (--dequantize) to write plain weights, or select whole pairs"
        if dequantizable
        else "select whole pairs (dequantize does not read per-channel FP8: use compressed-tensors' own tools)"
    )
    raise QuantizationError(
        f"keys= (--keys) parts {plural(len(parted), 'quantized tensor')} of {source.path} from "
        f"{'its scale' if len(parted) == 1 else 'their scales'} ({_RULE}; an FP8 weight without its scale reads "
        f"as its raw codes, and transformers loads them so with no error): {_listed(problems)}; {advice} "
        "(nothing was written)",
        keys=[pair.values if pair.values in chosen else pair.scale for pair in parted],
    )


def check_pairs_named(source: Source, keys: Sequence[str]) -> None:
    """After the user's rename (``source`` the renamed view, ``keys`` its names): each quantized
    pair the view keeps is still named as a reader pairs it (``X.weight`` and
    ``X.weight_scale_inv``, ``X_blocks`` and ``X_scales``: :func:`scale_name`), and no two tensors
    that were not a pair are named as one. A pair left as it was is not judged.

    Raises:
        QuantizationError: the pairs the rename broke (the first 5 and the count), before anything is written.
    """
    if not isinstance(source, RenamedSource) or source.inner is None:
        return
    new_of = {old: new for new, old in source.old_names.items()}
    kept = set(keys)
    broken: list[str] = []
    offenders: list[str] = []
    mapped: set[tuple[str, str]] = set()  # the kept pairs, by their new names
    for pair in named_pairs(source.inner.entries):
        values, scale = new_of.get(pair.values), new_of.get(pair.scale)
        if values is None or scale is None or values not in kept or scale not in kept:
            continue
        mapped.add((values, scale))
        if (values, scale) == (pair.values, pair.scale):
            continue
        wanted, what = scale_name(pair.kind, values), _VALUES[pair.kind]
        if wanted is None:
            named = "X_blocks" if pair.kind == "mxfp4" else "X.weight"
            broken.append(f"{what} {pair.values!r} renamed {values!r}, not named {named}: no reader finds {scale!r}")
        elif wanted != scale:
            broken.append(
                f"{what} {values!r} with {_SCALES[pair.kind]} {scale!r} (was {pair.scale!r}): "
                f"a reader looks for {wanted!r}"
            )
        else:
            continue
        offenders.append(values)
    for pair in named_pairs(source.entries):
        if pair.values in kept and pair.scale in kept and (pair.values, pair.scale) not in mapped:
            old = (source.old_names[pair.values], source.old_names[pair.scale])
            broken.append(
                f"{pair.values!r} and {pair.scale!r} (renamed from {old[0]!r} and {old[1]!r}) now pair by name"
            )
            offenders.append(pair.values)
    if broken:
        raise QuantizationError(
            f"the rename parts quantized tensors from their scales ({plural(len(broken), 'problem')}; {_RULE}): "
            f"{_listed(broken)}; rename a weight and its scale alike (nothing was written)",
            keys=offenders,
        )


def _parted(pair: Pair, values_kept: bool) -> str:
    what, scales = _VALUES[pair.kind], _SCALES[pair.kind]
    if values_kept:
        return f"{what} {pair.values!r} without {scales} {pair.scale!r}"
    return f"{scales.removeprefix('its ').removeprefix('their ')} {pair.scale!r} without the {what} {pair.values!r}"


def _listed(problems: Sequence[str]) -> str:
    rest = len(problems) - _SHOWN
    return "; ".join(problems[:_SHOWN]) + (f"; ... and {rest} more" if rest > 0 else "")
