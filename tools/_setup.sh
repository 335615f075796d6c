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
    "$VPY" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
    "$VPY" -c "import torch" 2>/dev/null || "$VPY" -m pip install --quiet "$TORCH_SPEC"
    "$VPY" -m pip install --quiet -e ".${EXTRAS:+[$EXTRAS]}"
    touch "$stamp"
fi
