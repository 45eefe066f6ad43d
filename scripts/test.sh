#!/usr/bin/env bash
# Set up .venv (if needed) and run the whole test suite. Extra arguments go to pytest.
# Two pytest-xdist workers, each test file on one worker (its module fixtures run once): the
# suite is mostly single-threaded and subprocess-bound, so on 2 cores it takes about half the
# serial time; files are handed out in tests/conftest.py's order (those with slow tests first:
# xdist's own reorder, by test count, left the slowest files to the end).
# AMPATCH_TEST_WORKERS=0 runs it serially (as does a venv without xdist).
# A full run (no arguments) first runs scripts/lint.sh (ruff and mypy, about a minute) and stops
# if it finds something; AMPATCH_LINT=0 skips it, AMPATCH_LINT=1 runs it before a partial run too.
EXTRAS="dev,plot,integrations,fp8"  # matplotlib, Lightning, Transformers, torchao too: their tests run instead of skipping
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
if [ "${AMPATCH_LINT:-}" = "1" ] || { [ "${AMPATCH_LINT:-}" != "0" ] && [ "$#" -eq 0 ]; }; then
  bash "$ROOT/scripts/lint.sh"
fi
WORKERS="${AMPATCH_TEST_WORKERS:-2}"
PARALLEL=()
if [ "$WORKERS" != "0" ] && "$VPY" -c "import xdist" >/dev/null 2>&1; then
  PARALLEL=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
fi
exec "$VPY" -m pytest -q "${PARALLEL[@]}" "$@"
