# Shared set-up for scripts/*.sh: create or reuse .venv, install torch (pinned to the CPU
# build on this disk when torch is missing) and ampatch with its extras (EXTRAS, default dev).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  # A bare 'torch' would pull a multi-GB CUDA build; the pinned CPU build is what we test on.
  "$VPY" -m pip install --quiet "torch==2.13.0"
fi
"$VPY" -m pip install --quiet -e ".[${EXTRAS:-dev}]"
