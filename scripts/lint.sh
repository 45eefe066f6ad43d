#!/usr/bin/env bash
# Set up .venv (if needed) and check the code: ruff (the rules in pyproject.toml) over the
# package, the tests and the scripts, then mypy over the package. scripts/test.sh runs this
# before a full suite; exit status non-zero when either finds something.
EXTRAS="${EXTRAS:-dev,plot,integrations,fp8}"
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
echo "lint: ruff check ampatch tests scripts" >&2
"$VPY" -m ruff check -q ampatch tests scripts
echo "lint: mypy (package ampatch)" >&2
"$VPY" -m mypy --no-error-summary
echo "lint: clean" >&2
