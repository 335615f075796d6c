"""Fuzzing the checkpoint readers with hypothesis: real files (``.metadata``, the manifest, a DCP
shard's torch.save records, a safetensors header, a torch.save file), mutated byte by byte.

Every outcome must be a success or a ParallelDCPError; nothing may hang (a per-example deadline),
nothing may run (no process spawned, no code executed from a pickle) and nothing outside the
checkpoint may be opened (an audit hook records every ``open``). A success on a DCP checkpoint
must either give back the original data or be caught by the manifest's checksums, as ``verify``
checks them: a mutation never goes unnoticed.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import parallel_dcp
from parallel_dcp import ParallelDCPError
from parallel_dcp.formats import open_source
from parallel_dcp.jobs.inspect import inspect_checkpoint
from parallel_dcp.storage.manifest import file_digest, read_manifest

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
_ALLOWED_ROOTS = tuple(str(Path(p).resolve()) for p in {sys.prefix, sys.base_prefix, ROOT / "parallel_dcp"})
_SPAWN_EVENTS = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "os.fork")


class _Watch:
    """Records, while armed, every file opened outside ``inside`` and every process spawned."""

    def __init__(self) -> None:
        self.inside: str | None = None
        self.violations: list[str] = []

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if self.inside is None:
            return
        if event == "open" and args and isinstance(args[0], (str, bytes, Path)):
            path = str(Path(args[0].decode() if isinstance(args[0], bytes) else args[0]).resolve())
            if not path.startswith((self.inside, *_ALLOWED_ROOTS)):
                self.violations.append(f"opened {path}")
        elif event.startswith(_SPAWN_EVENTS):
            self.violations.append(f"{event} {args[:1]}")


_WATCH = _Watch()
sys.addaudithook(_WATCH)


MUTATIONS = st.lists(
    st.tuples(st.sampled_from(["flip", "set", "truncate", "insert", "delete"]), st.floats(0, 1), st.integers(0, 255)),
    min_size=1,
    max_size=4,
)


def _mutate(data: bytes, mutations: list[tuple[str, float, int]], limit: int | None = None) -> bytes:
    """Apply the mutations inside the first ``limit`` bytes (a header), or anywhere."""
    out = bytearray(data)
    for op, where, value in mutations:
        span = min(len(out), limit) if limit is not None else len(out)
        i = min(int(where * span), max(span - 1, 0))
        if op == "flip" and out:
            out[i] ^= 1 << (value % 8)
        elif op == "set" and out:
            out[i] = value
        elif op == "truncate":
            del out[i:]
        elif op == "insert":
            out[i:i] = bytes([value])
        elif op == "delete" and out:
            del out[i]
    return bytes(out)


@pytest.fixture(scope="module")
def pristine() -> Iterator[dict[str, Any]]:
    base = Path(tempfile.mkdtemp(prefix="pdcp-fuzz-"))
    state = {"w": torch.arange(24.0).reshape(4, 6), "b": torch.arange(5, dtype=torch.int16), "step": 7, "tag": "run"}
    parallel_dcp.save(state, base / "dcp", workers=1)
    save_file({"w": state["w"], "b": state["b"]}, str(base / "m.safetensors"))
    torch.save({"w": state["w"], "b": state["b"], "step": 7}, base / "m.pt")
    try:
        yield {"base": base, "state": state}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _copy(pristine: dict[str, Any]) -> Path:
    where = Path(tempfile.mkdtemp(prefix="pdcp-fuzz-ex-"))
    shutil.copytree(pristine["base"] / "dcp", where / "dcp")
    shutil.copy(pristine["base"] / "m.safetensors", where / "m.safetensors")
    shutil.copy(pristine["base"] / "m.pt", where / "m.pt")
    return where


def _read_all(path: Path) -> dict[str, Any]:
    """Everything the readers offer, in this process: list, check, values, every tensor, inspect."""
    source = open_source(path)
    try:
        source.check()
        source.load_values(list(source.values))
        out: dict[str, Any] = dict(source.read(list(source.entries)))
        out.update({k: source.values[k] for k in source.values if k not in source.entries})
        for key, tensor in list(out.items()):
            if isinstance(tensor, torch.Tensor):
                entry = source.entries[key]
                assert tensor.dtype == entry.dtype and tuple(tensor.shape) == entry.shape, key
    finally:
        source.close()
    inspect_checkpoint(path)
    return out


def _manifest_catches(directory: Path) -> bool:
    """True when the manifest (as verify reads it) reports a file that differs from its record."""
    try:
        recorded = read_manifest(directory, current_only=True)
    except ParallelDCPError:
        return True
    if recorded is None:
        return True
    for name, want in recorded.items():
        path = directory / name
        if not path.is_file():
            return True
        found = file_digest(path)
        if found.size != want.size or found.digest != want.digest:
            return True
    return False


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        other = b[key]
        if isinstance(value, torch.Tensor):
            if not (isinstance(other, torch.Tensor) and value.dtype == other.dtype and torch.equal(value, other)):
                return False
        elif value != other:
            return False
    return True


def _attempt(pristine: dict[str, Any], target: str, mutations: list[tuple[str, float, int]]) -> None:
    where = _copy(pristine)
    try:
        dcp_dir = where / "dcp"
        files = {
            "metadata": dcp_dir / ".metadata",
            "manifest": dcp_dir / ".parallel_dcp.json",
            "shard": next(dcp_dir.glob("*.distcp")),
            "safetensors": where / "m.safetensors",
            "torch": where / "m.pt",
        }
        file = files[target]
        data = file.read_bytes()
        limit = 8 + int.from_bytes(data[:8], "little") if target == "safetensors" else None
        file.write_bytes(_mutate(data, mutations, limit))
        read_path = {"safetensors": file, "torch": file}.get(target, dcp_dir)
        _WATCH.inside, _WATCH.violations = str(where.resolve()), []
        try:
            got = _read_all(read_path)
        except ParallelDCPError:
            got = None
        finally:
            _WATCH.inside = None
        assert not _WATCH.violations, _WATCH.violations
        if got is not None and read_path == dcp_dir:
            assert _same(got, pristine["state"]) or _manifest_catches(dcp_dir), "a mutation went unnoticed"
    finally:
        shutil.rmtree(where, ignore_errors=True)


FUZZ = settings(
    max_examples=60,
    deadline=timedelta(seconds=10),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


@pytest.mark.parametrize("target", ["metadata", "manifest", "shard", "safetensors", "torch"])
def test_mutated_files_give_the_data_or_a_parallel_dcp_error(target: str, pristine: dict[str, Any]) -> None:
    @FUZZ
    @given(mutations=MUTATIONS)
    def run(mutations: list[tuple[str, float, int]]) -> None:
        _attempt(pristine, target, mutations)

    run()
