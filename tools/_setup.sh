# Sourced by tools/demo and tools/test: create .venv if missing and install the package into it.
# torch is installed first, pinned, so pip never resolves a multi-GB CUDA build for it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
TORCH_SPEC="${PARALLEL_DCP_TORCH:-torch==2.13.0}"
EXTRAS="${1:-}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
stamp=".venv/.parallel_dcp-setup-$(cat pyproject.toml tools/_setup.sh | sha1sum | cut -c1-12)${EXTRAS:+-$EXTRAS}"
if [ ! -f "$stamp" ]; then
    if "$VPY" -c "import torch" 2>/dev/null; then
        echo "setting up .venv (the package${EXTRAS:+ with its $EXTRAS extras}; torch is already there) ..." >&2
    else
        echo "setting up .venv: the first run downloads CPU torch (about 1 GB) and the package; a few minutes ..." >&2
    fi
    log=".venv/setup.log"
    # torch first, pinned, and the package only once torch is there (&&, not set -e, which a
    # command list on the left of || ignores).
    {
        { "$VPY" -m pip install --upgrade pip || true; } &&
            { "$VPY" -c "import torch" 2>/dev/null || "$VPY" -m pip install "$TORCH_SPEC"; } &&
            "$VPY" -m pip install -e ".${EXTRAS:+[$EXTRAS]}"
    } >"$log" 2>&1 || { tail -n 40 "$log" >&2; echo "set-up failed; the whole log: $ROOT/$log" >&2; exit 1; }
    touch "$stamp"
fi
