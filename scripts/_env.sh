# Shared set-up for scripts/*.sh: create or reuse .venv, install torch (pinned to the CPU
# build on this disk when torch is missing) and ampatch with its extras (EXTRAS, default dev).
# The editable install is redone only when pyproject.toml or the extras changed, or when the
# venv's ampatch is not this checkout (a stamp in .venv records what was installed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
if ! "$VPY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)" >/dev/null 2>&1; then
  # A bare 'torch' would pull a multi-GB CUDA build; the pinned CPU build is what we test on.
  "$VPY" -m pip install --quiet "torch==2.13.0"
fi
STAMP=".venv/.ampatch-install"
WANT="$(cat pyproject.toml; echo "extras=${EXTRAS:-dev} root=$ROOT")"
HAVE="$(cat "$STAMP" 2>/dev/null || true)"
# find_spec locates the package without importing it (importing ampatch imports torch: seconds)
WHERE="$(cd / && "$VPY" -c 'import importlib.util as u, os; s = u.find_spec("ampatch"); print(os.path.dirname(os.path.dirname(s.origin)) if s else "")' 2>/dev/null || true)"
if [ "$WANT" != "$HAVE" ] || [ "$WHERE" != "$ROOT" ]; then
  "$VPY" -m pip install --quiet -e ".[${EXTRAS:-dev}]"
  printf '%s' "$WANT" > "$STAMP"
fi
