"""``parallel_dcp.convert``: its contract, and its keywords in two groups for the job
(:mod:`parallel_dcp.jobs.convert`): how the job runs (:class:`Options`, as every job) and what it
makes of each source (format, dtype, keys, shards, renames, copied files, quantization).

Longer than 300 lines because ``convert``'s full contract (31 keywords, typed overloads for
``dry_run``) lives here; the logic is in jobs/.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, TypedDict, overload

from parallel_dcp.api import _check_torch, _given_or
from parallel_dcp.errors import QuantizationError
from parallel_dcp.options import DEFAULT_SHARD_SIZE, Options

if TYPE_CHECKING:
    import torch

    from parallel_dcp.jobs.dryrun import DryRunPlan
    from parallel_dcp.jobs.pipeline import SaveResult
    from parallel_dcp.jobs.preset_defs import Preset
    from parallel_dcp.jobs.quantization import Quantization
    from parallel_dcp.jobs.rename import RenameRules

__all__ = ["EachSource", "convert", "presets"]


class EachSource(TypedDict):
    """``convert``'s keywords that say what to make of each source (the others, how the job runs,
    are its :class:`Options`): passed as they are to :func:`parallel_dcp.jobs.convert.convert_one`."""

    to: str | None
    dtype: torch.dtype | None
    keys: str | Sequence[str] | None
    shard_size: int
    trust_pickle: bool
    rename: RenameRules | None
    dry_run: bool
    copy_files: bool
    copy_files_from: str | os.PathLike[str] | None
    quantization: Quantization | None
    preset: Preset | None
    model_config: str | os.PathLike[str] | None
    rename_strict: bool


@overload
def convert(
    src: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    dst: str | os.PathLike[str],
    *,
    to: str | None = None,
    workers: int | None = None,
    memory_limit: int | str | None = None,
    dtype: str | torch.dtype | None = None,
    keys: str | Sequence[str] | None = None,
    overwrite: bool = False,
    progress: bool = False,
    shard_size: int | str = DEFAULT_SHARD_SIZE,
    trust_pickle: bool = False,
    sync_files: bool = True,
    retries: int = 0,
    task_timeout: float | None = None,
    checksums: bool = True,
    chunk_size: int | str | None = None,
    distributed: bool = False,
    dist_timeout: float = 1800.0,
    storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    rename: RenameRules | None = None,
    compress: str | None = None,
    dry_run: Literal[False] = False,
    resume: bool = False,
    copy_files: bool = True,
    copy_files_from: str | os.PathLike[str] | None = None,
    dequantize: bool = False,
    quantize: str | None = None,
    quantize_keys: str | Sequence[str] | None = None,
    block_size: int | None = None,
    io: str = "auto",
    preset: str | Preset | None = None,
    model_config: str | os.PathLike[str] | None = None,
    rename_strict: bool = False,
    check_source: bool = True,
) -> SaveResult | list[SaveResult]: ...


@overload
def convert(
    src: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    dst: str | os.PathLike[str],
    *,
    to: str | None = None,
    workers: int | None = None,
    memory_limit: int | str | None = None,
    dtype: str | torch.dtype | None = None,
    keys: str | Sequence[str] | None = None,
    overwrite: bool = False,
    progress: bool = False,
    shard_size: int | str = DEFAULT_SHARD_SIZE,
    trust_pickle: bool = False,
    sync_files: bool = True,
    retries: int = 0,
    task_timeout: float | None = None,
    checksums: bool = True,
    chunk_size: int | str | None = None,
    distributed: bool = False,
    dist_timeout: float = 1800.0,
    storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    rename: RenameRules | None = None,
    compress: str | None = None,
    dry_run: Literal[True],
    resume: bool = False,
    copy_files: bool = True,
    copy_files_from: str | os.PathLike[str] | None = None,
    dequantize: bool = False,
    quantize: str | None = None,
    quantize_keys: str | Sequence[str] | None = None,
    block_size: int | None = None,
    io: str = "auto",
    preset: str | Preset | None = None,
    model_config: str | os.PathLike[str] | None = None,
    rename_strict: bool = False,
    check_source: bool = True,
) -> DryRunPlan | list[DryRunPlan]: ...


def convert(
    src: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    dst: str | os.PathLike[str],
    *,
    to: str | None = None,
    workers: int | None = None,
    memory_limit: int | str | None = None,
    dtype: str | torch.dtype | None = None,
    keys: str | Sequence[str] | None = None,
    overwrite: bool = False,
    progress: bool = False,
    shard_size: int | str = DEFAULT_SHARD_SIZE,
    trust_pickle: bool = False,
    sync_files: bool = True,
    retries: int = 0,
    task_timeout: float | None = None,
    checksums: bool = True,
    chunk_size: int | str | None = None,
    distributed: bool = False,
    dist_timeout: float = 1800.0,
    storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    rename: RenameRules | None = None,
    compress: str | None = None,
    dry_run: bool = False,
    resume: bool = False,
    copy_files: bool = True,
    copy_files_from: str | os.PathLike[str] | None = None,
    dequantize: bool = False,
    quantize: str | None = None,
    quantize_keys: str | Sequence[str] | None = None,
    block_size: int | None = None,
    io: str = "auto",
    preset: str | Preset | None = None,
    model_config: str | os.PathLike[str] | None = None,
    rename_strict: bool = False,
    check_source: bool = True,
) -> SaveResult | list[SaveResult] | DryRunPlan | list[DryRunPlan]:
    """Convert between DCP, safetensors and torch.save, with a pool of processes, under a memory limit.

    The source format is detected: a DCP directory (``.metadata``), a ``.safetensors`` file or a
    Hugging Face directory of them, a torch.save file (``.pt``/``.pth``/``.bin``) or a directory
    with ``pytorch_model.bin.index.json``. Sources are read lazily (mmap, partial reads): the
    memory used is about the tasks in flight, not the model.

    Args:
        src: one source, or several (each converts into ``dst/<source name>``).
        dst: the output. ``to=None`` goes by its name: ``*.safetensors`` one safetensors file,
            ``*.pt``/``*.pth``/``*.bin`` one torch.save file, anything else a DCP directory.
        to: ``"dcp"``, ``"safetensors"`` or ``"torch"``; with the last two and a ``dst`` without
            those suffixes, a sharded Hugging Face directory (shards plus index JSON).
        workers, memory_limit, overwrite, progress, sync_files, retries, task_timeout, checksums,
            chunk_size, distributed, dist_timeout, storage_options: as for :func:`save`. Sources and
            destinations may be URLs (``s3://...``): safetensors and DCP sources are read by byte
            ranges, torch.save sources through a local temporary copy.
        compress: for a DCP output, as for :func:`save` (any other output refuses it).
        io: as for :func:`save`, for the shards written (DCP outputs) and the DCP shards read.
        dtype: cast floating tensors to this dtype on the way (``"bfloat16"``, ``torch.float16``).
        keys: select keys: globs on flattened names (``"model.layers.*"``), or ``"re:<regex>"``
            matched against the whole name; several patterns select the union.
        shard_size: the largest shard of a sharded output (bytes or "2GB"; default 5 GB); shards
            are also kept under what each worker may use under ``memory_limit``.
        trust_pickle: allow torch.save files that need ``weights_only=False`` (runs their pickle
            code: only for files you trust).
        rename: rename keys after ``keys`` selects them: ``[(regex, template), ...]`` (Python
            ``re``; each regex must match the whole flattened name; ``\\1`` / ``\\g<name>`` in
            the template; the first matching rule wins; unmatched names are kept), or a callable
            ``name -> new name or None``. The output's nesting follows the new names (see
            :mod:`parallel_dcp.jobs.rename`). Renaming never changes tensor data.
        dry_run: plan the conversion as a real one would (output files with their keys and
            bytes, tasks per worker, chunks, workers the limit allows, predicted peak memory next
            to the limit, space needed next to space free) and return it; nothing is written.
        resume: continue a conversion to ``dst`` that died (SIGKILL, power loss, out of space,
            interrupted) and was started with the same arguments: every task whose files are
            complete and hash as its durable record says is kept, the rest is redone, and the
            output is committed as usual (``bytes_kept`` / ``bytes_rewritten`` in the result).
            Workers and memory limit may differ. With nothing to resume, a fresh run. Local
            destinations only. Without ``resume``, a dead conversion's files are removed (with a
            warning) and the conversion starts over. See :mod:`parallel_dcp.jobs.resume`.
        copy_files: a Hugging Face directory converted to a sharded safetensors or torch
            directory gets the source's other files too (``config.json``,
            ``generation_config.json``, tokenizer files, ...: plain files at its top level that
            are neither weights, nor indexes, nor hidden; and the non-weight files of its
            folders, such as sentence-transformers' ``1_Pooling/``), so ``from_pretrained`` and
            ``SentenceTransformer`` load the output. They are committed with the shards
            (written new under this save's temporary names, renamed into place with the index,
            in the manifest, removed if the save fails). False copies nothing. See :mod:`parallel_dcp.jobs.copy_files`.
        copy_files_from: copy the files of this directory instead (any source, such as a DCP
            checkpoint from training beside the model's original folder); needs a sharded
            directory output.
        dequantize: dequantize FP8 block-scaled pairs (``X.weight`` float8_e4m3fn +
            ``X.weight_scale_inv``) and MXFP4 pairs (``X_blocks`` + ``X_scales``, output ``X``) to
            ``dtype`` (default: the dtype the source's ``config.json`` names, what transformers'
            own dequantizing load gives, else bfloat16; bfloat16, float16 and float32 allowed);
            scales are dropped, other tensors kept (cast only when ``dtype`` is given). Values equal stock
            ``QuantizedHuggingFaceStorageReader``'s bit for bit. ``keys`` then names output tensors.
        quantize: ``"fp8-block"`` or ``"fp8-block:BLOCK"``: write the weights ``quantize_keys``
            selects (same patterns as ``keys``; default: 2-D floating ``*.weight`` tensors except
            embeddings, norms, the output head and MoE routers) as float8_e4m3fn plus a float32
            ``X.weight_scale_inv`` per block (DeepSeek layout); a Hugging Face output always gets
            its index and the ``quantization_config`` in the copied ``config.json``.
        block_size: the FP8 block of ``dequantize`` (default: ``config.json``'s
            ``weight_block_size``, else 128) or of ``quantize="fp8-block"``.
        preset: a named conversion for a client (see :func:`parallel_dcp.presets`), such as
            ``"hf-llama3-to-torchtitan"`` (torchtitan 0.3.0): its rename rules, the tensor
            transforms the client needs (q/k rows permuted per head, in the workers, under the
            memory limit) and the keys it promises. Every selected source key must match one of
            its rules, and without ``keys`` the output must hold every key the client's model
            holds; otherwise :class:`PresetError` before anything is written. ``rename`` rules
            apply after the preset's, to its names. See :mod:`parallel_dcp.jobs.presets`.
        model_config: the model's ``config.json`` (or a directory holding it) that a preset reads
            head counts from; default: the source's directory, else ``copy_files_from``.
        rename_strict: every selected key must match a ``rename`` rule (else
            :class:`RenameError`, nothing written); without it the keys no rule matched are
            named in a :class:`RenameWarning`.
        check_source: where the source carries parallel_dcp's checksums (a DCP or sharded
            directory's ``.parallel_dcp.json``, a torch.save file's ``NAME.manifest.json``, a
            safetensors file's own header), check the bytes read against them: each file a task
            reads whole is hashed as that task reads it, and a mismatch is a
            :class:`SourceChecksumError` naming the file, with nothing written (no task kept for
            ``resume``); the side files copied beside the weights that their folder's record
            lists are checked too (a changed documentation file, ``README.md``, is copied with a
            :class:`SourceNotCheckedWarning`). Which files are covered: docs/guarantees.md. False
            skips the check.

    Returns:
        A :class:`SaveResult` (a list of them for several sources) with ``format``, ``keys``,
        bytes, files, seconds, GiB/s and the measured peak memory; with ``dry_run``, a
        :class:`DryRunPlan` (or a list of them).

    Raises:
        ValueError: a bad ``to``, ``dtype`` or ``keys``, or non-tensor values bound for safetensors.
        RenameError: bad rename rules, several keys renamed to one name, an empty name, or
            clashing nesting (all listed; nothing is written).
        UnsafeCheckpointError: a torch.save file that needs ``trust_pickle``.
        SourceChecksumError: a source file is not the bytes its recorded checksum was taken of.
        QuantizationError: ``dequantize`` of a source with a weight without its scale (or the
            reverse), a scale not shaped as the weight's blocks, a non-FP8 weight beside a
            ``weight_scale_inv``, an E8M0 exponent 255; a bad ``quantize`` spec or a rule that
            selects nothing (all before anything is written; ``.keys`` names the tensors).
        ResumeError: ``resume`` found a dead conversion to ``dst`` made with other arguments
            (sources, keys, rename, dtype, format, shard or chunk size) or from a source that
            changed since; its files are left as they were. Also for object storage and
            ``distributed``.
        Otherwise as :func:`save`; on failure each destination is as it was before the call,
            except that a failed conversion leaves its finished tasks (and their records) for
            ``resume``.
    """
    from parallel_dcp.engine.memory import parse_size
    from parallel_dcp.jobs import convert as _convert
    from parallel_dcp.jobs import presets as _presets
    from parallel_dcp.jobs import rename as _rename
    from parallel_dcp.jobs import several_sources as _several
    from parallel_dcp.jobs.dryrun import DryRunPlan
    from parallel_dcp.jobs.pipeline import SaveResult
    from parallel_dcp.storage.location import is_url

    _check_torch()
    options = _given_or(
        options,
        Options(
            workers=workers,
            overwrite=overwrite,
            progress=progress,
            sync_files=sync_files,
            memory_limit=memory_limit,
            retries=retries,
            task_timeout=task_timeout,
            checksums=checksums,
            chunk_size=chunk_size,
            distributed=distributed,
            dist_timeout=dist_timeout,
            storage_options=storage_options,
            resume=resume,
            compress=compress,
            io=io,
            check_source=check_source,
        ),
    )
    cast = _convert.parse_dtype(dtype)
    quantization = _quantization(cast, dequantize, quantize, quantize_keys, block_size)
    each: EachSource = {  # the second group: what the job makes of every source
        "to": to,
        "dtype": cast,
        "keys": keys,
        "shard_size": parse_size(shard_size, "shard_size"),
        "trust_pickle": trust_pickle,
        "rename": rename,
        "dry_run": dry_run,
        "copy_files": copy_files,
        "copy_files_from": copy_files_from,
        "quantization": quantization,
        "preset": _presets.get_preset(preset) if preset is not None else None,  # an unknown name fails here
        "model_config": model_config,
        "rename_strict": rename_strict,
    }
    sources = [src] if isinstance(src, (str, os.PathLike)) else list(src)
    if not sources:
        raise ValueError("convert needs at least one source")
    outputs = _convert.destinations(sources, dst)
    if len(sources) > 1 and not is_url(dst) and not dry_run:
        os.makedirs(dst, exist_ok=True)
    if rename is not None:
        _rename.compile_rules(rename)  # bad rules fail before any source is opened
    results = _several.convert_all(sources, outputs, options, **each)
    if isinstance(src, (str, os.PathLike)):
        return results[0]
    if dry_run:
        return [r for r in results if isinstance(r, DryRunPlan)]
    return [r for r in results if isinstance(r, SaveResult)]


def presets() -> list[Preset]:
    """Every preset ``convert(..., preset=NAME)`` knows, by name: each names the client and the
    version its layout follows (``p.client``, ``p.client_version``; ``p.describe()`` in one line).
    ``PRESETS`` maps the names to them."""
    from parallel_dcp.jobs.preset_defs import PRESETS

    return [PRESETS[name] for name in sorted(PRESETS)]


def _quantization(
    cast: torch.dtype | None,
    dequantize: bool,
    quantize: str | None,
    quantize_keys: str | Sequence[str] | None,
    block_size: int | None,
) -> Quantization | None:
    """The conversion's :class:`~parallel_dcp.jobs.quantization.Quantization` (None: none asked for)."""
    if not dequantize and quantize is None and quantize_keys is None and block_size is None:
        return None
    import torch

    from parallel_dcp.jobs.quantization import Quantization

    if dequantize and cast not in (None, torch.bfloat16, torch.float16, torch.float32):
        raise QuantizationError(f"dequantize writes bfloat16, float16 or float32, not {cast}")
    return Quantization(
        dequantize=dequantize,
        dequantize_dtype=cast,  # None: the source config's dtype (dequantized_dtype_of)
        quantize=quantize,
        quantize_keys=quantize_keys,
        block_size=block_size,
    )
