"""Presets: named, versioned conversions for a client (``convert(..., preset="NAME")``).

    source keys ── select (--keys) ── preset: drop what the client does not hold (rotary buffers)
                                         ├ every other key must match one of its rules (else: error)
                                         ├ q/k rows permuted per head (PermutedSource, in the workers)
                                         └ renamed by its rules; the output holds every key the client's
                                           model holds (checked when no --keys narrows the selection)
                                      ── user rename rules (--rename), applied to the preset's names ──▶ job

A preset is rename rules, the tensor transforms the client needs, and the key coverage it
promises. The head counts of a permutation come from the model's ``config.json``
(``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``num_hidden_layers``): from
``model_config=`` (``--model-config``) when given, else the source's directory (or the directory
a single-file source lies in), else ``copy_files_from`` (a DCP checkpoint from training beside
its original Hugging Face folder). No config found: a clear error, before anything is written.

Each preset names the client and the version its layout was read from (``parallel-dcp
presets``); its names and shapes are pinned by tests against that client.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from parallel_dcp._json import loads_json
from parallel_dcp.errors import (
    CorruptCheckpointError,
    PresetError,
    UnsafeCheckpointError,
    describe_keys,
    plural,
    printable,
)
from parallel_dcp.formats.base import Source
from parallel_dcp.formats.permuted_source import RowPermutation, permuted_source
from parallel_dcp.formats.renamed_source import RenamedSource
from parallel_dcp.jobs.preset_defs import PRESETS, Permute, Preset, get_preset
from parallel_dcp.jobs.rename import rename_source
from parallel_dcp.storage.location import Remote
from parallel_dcp.storage.safe_files import source_tree
from parallel_dcp.storage.safe_reader import read_in_tree

__all__ = ["PRESETS", "Permute", "Preset", "PresetStep", "apply_preset", "find_config", "get_preset"]

_log = logging.getLogger("parallel_dcp")

CONFIG_MAX_BYTES = 16 * 2**20  # a model's config.json: the largest known are a few hundred KB


def find_config(
    source: Source, model_config: str | os.PathLike[str] | None, copy_files_from: str | os.PathLike[str] | None
) -> tuple[dict[str, Any], str] | None:
    """The model's ``config.json`` (parsed) and where it was found; None when there is none.

    Looked for in ``model_config`` (a file, or a directory holding config.json), else in the
    source's directory (or the one a single-file source lies in), else in ``copy_files_from``.
    Read by the one rule (:func:`~parallel_dcp.storage.safe_reader.read_in_tree`): a config.json
    found beside the source or in ``copy_files_from`` may link only within that folder's tree
    (its content becomes the output's config.json), a file the user names is read wherever it
    leads (the user chose it); either must be a regular file (a FIFO is refused, never blocked
    on) of at most :data:`CONFIG_MAX_BYTES`.

    Raises:
        PresetError: ``model_config`` names nothing, a config larger than the bound, not JSON,
            or not a JSON object.
        UnsafeCheckpointError: a config.json linking out of its folder, or not a regular file.
    """
    candidates: list[tuple[str, str]] = []  # (path, the tree it may link within)
    if model_config is not None:
        path = os.fspath(model_config)
        path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.lexists(path):
            raise PresetError(f"model config {printable(path)} does not exist")
        real = os.path.realpath(path)  # the user's own path: its links are followed, once, here
        candidates.append((real, os.path.dirname(real)))
    else:
        if not isinstance(source.location, Remote):
            folder = source.path if os.path.isdir(source.path) else os.path.dirname(os.path.abspath(source.path))
            candidates.append((os.path.join(folder, "config.json"), folder))
        if copy_files_from is not None and "://" not in os.fspath(copy_files_from):
            folder = os.fspath(copy_files_from)
            candidates.append((os.path.join(folder, "config.json"), folder))
    for path, folder in candidates:
        if not os.path.lexists(path) or (os.path.isdir(path) and not os.path.islink(path)):
            continue
        try:
            raw = read_in_tree(path, source_tree(folder), limit=CONFIG_MAX_BYTES)
        except UnsafeCheckpointError:
            raise
        except CorruptCheckpointError as exc:  # larger than the bound, or gone since listed
            raise PresetError(f"{printable(path)} is not a model config: {exc}") from exc
        try:
            config = loads_json(raw)
        except ValueError as exc:
            raise PresetError(f"{printable(path)} is not a readable JSON config: {exc}") from exc
        if not isinstance(config, dict):
            raise PresetError(f"{printable(path)} holds {type(config).__name__}, not a JSON object")
        return config, path
    return None


@dataclass(frozen=True, slots=True)
class PresetStep:
    """What a preset did to one source: the view to convert, its output names, and for the
    output, the config it read (a Hugging Face output gets it as its config.json)."""

    source: Source
    keys: tuple[str, ...]
    config: dict[str, Any]
    config_path: str
    note: str


def _positive(config: Mapping[str, Any], field: str, path: str, preset: Preset) -> int:
    value = config.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        found = "missing" if value is None else f"{value!r}"
        raise PresetError(f"preset {preset.name} needs a positive integer {field} in {path}, found {found}")
    return value


def _head_dim(config: Mapping[str, Any], path: str, preset: Preset) -> int:
    if config.get("head_dim") is not None:
        return _positive(config, "head_dim", path, preset)
    hidden = _positive(config, "hidden_size", path, preset)
    heads = _positive(config, "num_attention_heads", path, preset)
    if hidden % heads:
        raise PresetError(f"{path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    return hidden // heads


def apply_preset(
    source: Source,
    selected: Sequence[str],
    preset: Preset,
    *,
    narrowed: bool,
    model_config: str | os.PathLike[str] | None = None,
    copy_files_from: str | os.PathLike[str] | None = None,
) -> PresetStep:
    """``source`` restricted to ``selected`` as ``preset``'s client holds it.

    ``narrowed``: the user selected keys (``--keys``), so the output need not hold the whole model.

    Raises:
        PresetError: no config.json, or one without the head counts; selected keys no rule
            covers; an output that misses keys of the client's model (each list: the first 10
            and the count). All before anything is written.
    """
    found = find_config(source, model_config, copy_files_from)
    if found is None:
        where = [source.path] + ([os.fspath(copy_files_from)] if copy_files_from is not None else [])
        raise PresetError(
            f"preset {preset.name} reads the model's head counts from its config.json, and none was found in "
            f"{' or '.join(where)}: give model_config= (--model-config PATH), the Hugging Face config.json of the "
            "model (nothing was written)"
        )
    config, path = found
    tied = bool(config.get("tie_word_embeddings"))
    drops = [re.compile(d) for d in preset.drop + (preset.tied_drop if tied else ())]
    kept = [k for k in selected if not any(d.fullmatch(k) for d in drops)]
    dropped = len(selected) - len(kept)
    rules = [re.compile(regex) for regex, _ in preset.rules]
    uncovered = [k for k in kept if not any(r.fullmatch(k) for r in rules)]
    if uncovered:
        raise PresetError(
            f"preset {preset.name} ({preset.client} {preset.client_version}) has no rule for "
            f"{plural(len(uncovered), 'key')} of {source.path} (nothing was written): {describe_keys(uncovered)}; "
            f"select the keys it covers with keys= (--keys), or convert without the preset",
            keys=uncovered,
        )
    permutations = _permutations(source, kept, preset, config, path)
    view: Source = permuted_source(source, permutations) if permutations else source
    renamed, names = rename_source(view, kept, list(preset.rules), strict=True, report=False)
    if tied:
        names = _tied_copies(renamed, names, preset)
    if not narrowed:
        _check_complete(preset, names, config, path, tied)
    note = f"preset {preset.describe()}; config {path}"
    if permutations:
        some = next(iter(permutations.values()))
        note += f"; {plural(len(permutations), 'q/k weight')} rows permuted per head ({some.describe()}, ...)"
    if dropped:
        note += f"; {plural(dropped, 'key')} the client does not hold left out"
    _log.info("%s: %s", source.path, note)
    return PresetStep(renamed, names, config, path, note)


def _permutations(
    source: Source, keys: Sequence[str], preset: Preset, config: Mapping[str, Any], path: str
) -> dict[str, RowPermutation]:
    if not preset.permute:
        return {}
    head_dim = _head_dim(config, path, preset)
    out: dict[str, RowPermutation] = {}
    for rule in preset.permute:
        pattern = re.compile(rule.key)
        if rule.heads == "num_key_value_heads" and config.get("num_key_value_heads") is None:
            heads = _positive(config, "num_attention_heads", path, preset)  # no grouping: one kv head per head
        else:
            heads = _positive(config, rule.heads, path, preset)
        for key in keys:
            if key in source.entries and pattern.fullmatch(key):
                out[key] = RowPermutation(heads, head_dim, rule.to_interleaved)
    bad = [k for k, p in out.items() if source.entries[k].shape[:1] != (p.heads * p.head_dim,)]
    if bad:
        shapes = ", ".join(f"{k} {list(source.entries[k].shape)}" for k in bad[:10])
        raise PresetError(
            f"preset {preset.name}: {plural(len(bad), 'attention weight')} do not have the rows {path} gives "
            f"(heads x head_dim {head_dim}): {shapes}{' ...' if len(bad) > 10 else ''} ({len(bad)} in all); is "
            "the config this model's? (nothing was written)",
            keys=bad,
        )
    if head_dim % 2:
        raise PresetError(f"preset {preset.name}: head_dim {head_dim} in {path} is odd; rotary layouts need it even")
    return out


def _tied_copies(view: Source, names: tuple[str, ...], preset: Preset) -> tuple[str, ...]:
    """``names`` with each output name of ``preset.tied_copy`` the view lacks, read from its source key."""
    assert isinstance(view, RenamedSource)
    new_of = {old: new for new, old in view.old_names.items()}
    added = []
    for name, source_key in preset.tied_copy:
        copied = new_of.get(source_key)
        if name in view.old_names or copied is None or copied not in view.entries:
            continue
        view.old_names[name] = source_key
        view.entries[name] = dataclasses.replace(view.entries[copied], key=name)
        view.mapping[name] = (name,)
        added.append(name)
    return (*names, *added)


def _check_complete(preset: Preset, names: Sequence[str], config: Mapping[str, Any], path: str, tied: bool) -> None:
    """The output holds every key the client's model holds, and no layer beyond it."""
    if not preset.layer_keys and not preset.model_keys:
        return
    layers = _positive(config, "num_hidden_layers", path, preset)
    if preset.layer_keys and layers > len(names):
        # Each layer holds keys of its own, so the output misses whole layers; said without
        # listing the keys of that many layers (10^9 of them would take the machine's memory).
        raise PresetError(
            f"preset {preset.name}: {printable(path)} says num_hidden_layers={layers}, and the output's "
            f"{plural(len(names), 'key')} cannot hold that many layers; is the config this model's? (nothing was "
            "written; convert a part of a model with keys= / --keys)"
        )
    expected = preset.expected_keys(layers, tied)
    have = set(names)
    missing = [k for k in expected if k not in have]
    extra = sorted(set(names) - set(expected))
    problems = []
    if missing:
        problems.append(f"misses {plural(len(missing), 'key')} the model holds: {describe_keys(missing)}")
    if extra:
        problems.append(
            f"holds {plural(len(extra), 'key')} the model does not (num_hidden_layers={layers}, "
            f"tie_word_embeddings={tied}): {describe_keys(extra)}"
        )
    if problems:
        raise PresetError(
            f"preset {preset.name}: the output " + "; and ".join(problems) + f" (config {path}; nothing was written; "
            "convert a part of a model with keys= / --keys)",
            keys=missing + extra,
        )
