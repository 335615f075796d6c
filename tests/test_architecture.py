"""The layout's promises that a test can hold: what the core imports, and what it does not."""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from parallel_dcp import benchmark
from parallel_dcp.benchmark.config import BenchConfig

ROOT = Path(__file__).resolve().parent.parent


def test_the_core_imports_neither_the_benchmark_nor_a_plotting_library() -> None:
    """matplotlib is an optional extra ([bench]): save, load and convert must not need it."""
    code = (
        "import sys, parallel_dcp, parallel_dcp.cli; "
        "print(sorted(m for m in sys.modules if m.startswith(('matplotlib', 'parallel_dcp.benchmark'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the extra looks like
    parser = argparse.ArgumentParser()
    benchmark.add_arguments(parser)
    args = parser.parse_args(["--gib", "0.001", "--targets", str(tmp_path), "--plot", str(tmp_path / "p.png")])
    with pytest.raises(ValueError, match=r"pip install '\.\[bench\]'"):
        benchmark.run(args)
    assert list(tmp_path.iterdir()) == [], "nothing was measured or written first"
    assert BenchConfig.from_args(args).plot_path is not None


def _private_names_of_torch_and_fsspec() -> set[str]:
    """Private names defined by the torch and fsspec modules and classes parallel_dcp builds on."""
    import fsspec.spec
    import torch.distributed.checkpoint.default_planner as default_planner
    import torch.distributed.checkpoint.filesystem as filesystem
    import torch.distributed.checkpoint.metadata as metadata
    import torch.distributed.checkpoint.planner as planner
    import torch.serialization as serialization

    owners: list[object] = [default_planner, filesystem, metadata, planner, serialization]
    owners += [filesystem.FileSystemWriter, filesystem.FileSystemReader, default_planner.DefaultLoadPlanner]
    owners += [default_planner.DefaultSavePlanner, fsspec.spec.AbstractFileSystem]
    return {n for owner in owners for n in dir(owner) if n.startswith("_") and not n.startswith("__")}


def _uses_outside_compat() -> list[str]:
    private = _private_names_of_torch_and_fsspec()
    found = []
    for path in sorted((ROOT / "parallel_dcp").rglob("*.py")):
        relative = path.relative_to(ROOT)
        if path.name == "_compat.py" or relative.parts[1] == "benchmark":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "fsspec"):
                if any(part.startswith("_") for part in node.module.split(".")) or any(
                    alias.name.startswith("_") for alias in node.names
                ):
                    found.append(f"{relative}:{node.lineno}: from {node.module} import ...")
            elif isinstance(node, ast.Import):
                found += [
                    f"{relative}:{node.lineno}: import {a.name}"
                    for a in node.names
                    if a.name.split(".")[0] in ("torch", "fsspec") and any(p.startswith("_") for p in a.name.split("."))
                ]
            elif isinstance(node, ast.Attribute) and node.attr in private:
                found.append(f"{relative}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.ClassDef):  # a method overriding a private one of a torch class
                found += [
                    f"{relative}:{item.lineno}: overrides {item.name}"
                    for item in node.body
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in private
                ]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in private:
                found.append(f"{relative}:{node.lineno}: names {node.value!r}")
    return found


def test_only_compat_touches_private_torch_and_fsspec_names() -> None:
    """A torch or fsspec upgrade that moves one of them then fails in one place, at import, by name
    (the benchmark, outside the core, may call stock's private paths it compares against)."""
    assert _uses_outside_compat() == []


def test_compat_checks_every_private_name_at_import() -> None:
    from parallel_dcp import _compat

    source = (ROOT / "parallel_dcp" / "_compat.py").read_text()
    used = set(re.findall(r'_private\("[\w.]+", "(\w+)"\)', source))
    checked = inspect.getsource(_compat.check_torch)
    assert used and all(f'"{name}")' in checked for name in used), used
    # Checked on first use (torch is imported lazily so that `parallel-dcp --help` is quick): by
    # every public function and by the lazily served names, before any job module runs. The
    # facade (__init__.py) serves the names; the functions live in api/, one module per job.
    api = ROOT / "parallel_dcp" / "api"
    api_init = (api / "__init__.py").read_text()
    assert re.search(r"^    _compat\.check_torch\(\)", api_init, re.MULTILINE), "checked on first use"
    checking = set()
    for path in [ROOT / "parallel_dcp" / "__init__.py", *sorted(api.glob("*.py"))]:
        source = path.read_text()
        checking |= {
            node.name
            for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef)
            and not any(isinstance(d, ast.Name) and d.id == "overload" for d in node.decorator_list)
            and "_check_torch()" in (ast.get_source_segment(source, node) or "")
        }
    assert {"save", "load", "convert", "verify", "inspect", "diff", "__getattr__"} <= checking
    import parallel_dcp

    for name in ("save", "load", "convert", "verify", "inspect", "diff"):  # the functions served are those
        assert getattr(parallel_dcp, name).__module__.startswith("parallel_dcp.api."), name


def test_dist_timeout_can_be_set_from_the_api_and_the_cli(tmp_path: Path) -> None:
    """Every collective of a distributed job waits at most this long (issue: it could not be set)."""
    import torch

    import parallel_dcp
    from parallel_dcp import cli

    with pytest.raises(ValueError, match="dist_timeout must be > 0"):
        parallel_dcp.save({"w": torch.ones(2)}, tmp_path / "a", dist_timeout=0)
    with pytest.raises(ValueError, match="dist_timeout must be > 0"):
        parallel_dcp.convert(tmp_path / "a", tmp_path / "b", dist_timeout=-1.0)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["convert", str(tmp_path / "a"), str(tmp_path / "b"), "--dist-timeout", "0"])
    assert exit_info.value.code == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing written"
    args = cli.build_parser().parse_args(["convert", "a", "b", "--distributed", "--dist-timeout", "90"])
    assert args.dist_timeout == 90.0


def test_no_import_cycles() -> None:
    """Each module imports only what sits below it (the pipeline once imported distributed mode,
    which imports the pipeline: the choice between them now lives in jobs/runner.py)."""
    import grimp

    graph = grimp.build_graph("parallel_dcp")
    cycles = sorted(
        {
            tuple(sorted((a, b)))
            for a in graph.modules
            for b in graph.find_modules_directly_imported_by(a)
            if b.startswith("parallel_dcp") and graph.find_shortest_chain(importer=b, imported=a)
        }
    )
    assert cycles == []


def test_modules_over_300_lines_say_why() -> None:
    long = []
    for path in sorted((ROOT / "parallel_dcp").rglob("*.py")):
        text = path.read_text()
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if text.count("\n") > 300 and "Longer than 300 lines because" not in docstring:
            long.append(str(path.relative_to(ROOT)))
    assert long == []


def test_options_is_accepted_by_the_public_functions(tmp_path: Path) -> None:
    """``Options`` is exported, so the functions take it: one validated object, or keywords."""
    import torch

    import parallel_dcp
    from parallel_dcp import Options

    options = Options(workers=1, checksums=False)
    result = parallel_dcp.save({"w": torch.ones(3)}, tmp_path / "a", options=options)
    assert result.workers == 1
    assert torch.equal(parallel_dcp.load(tmp_path / "a", options=options)["w"], torch.ones(3))
    assert parallel_dcp.verify(tmp_path / "a", options=options).ok
    converted = parallel_dcp.convert(tmp_path / "a", tmp_path / "b.safetensors", options=options)
    assert isinstance(converted, parallel_dcp.SaveResult) and converted.workers == 1
    assert parallel_dcp.diff(tmp_path / "a", tmp_path / "b.safetensors", options=options).same
    with pytest.raises(TypeError, match="not both"):
        parallel_dcp.save({"w": torch.ones(3)}, tmp_path / "c", options=options, workers=2)
    assert not (tmp_path / "c").exists()


def test_the_write_pipeline_reaches_resume_at_one_seam() -> None:
    """Resume stands at one place (issue 31, item 8): the pipeline stages a job once through
    jobs/staged.py, whose staged job knows what a resume kept; planning, the worker's writes and
    the commit (pipeline.py, targets.py) never consult jobs/resume.py themselves."""
    import grimp

    graph = grimp.build_graph("parallel_dcp")
    importers = graph.find_modules_that_directly_import("parallel_dcp.jobs.resume")
    assert "parallel_dcp.jobs.pipeline" not in importers
    assert "parallel_dcp.jobs.targets" not in importers
    assert "parallel_dcp.jobs.staged" in importers
    pipeline = (ROOT / "parallel_dcp" / "jobs" / "pipeline.py").read_text()
    calls = [
        node
        for node in ast.walk(ast.parse(pipeline))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "stage_job"
    ]
    assert len(calls) == 1, "one seam"
