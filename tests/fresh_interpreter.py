"""Run a test's job in a fresh interpreter, as the CLI or a user's script runs it.

A pytest process after hundreds of tests is an unusual parent for forked workers: threads of
earlier tests have come and gone and left glibc malloc arenas behind, which the workers inherit;
each worker thread that attaches to one copies some of its pages (docs/guarantees.md, "The memory
ceiling"). Tests that compare a job's memory with its plan run it here instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_fresh(module: str, function: str, *args: str, timeout: float = 300) -> Any:
    """``module.function(*args)`` in a new interpreter; its JSON result (what it returned)."""
    code = (
        "import json, sys, importlib; "
        f"print(json.dumps(getattr(importlib.import_module({module!r}), {function!r})(*sys.argv[1:])))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
