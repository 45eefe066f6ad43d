#!/usr/bin/env bash
# Set up .venv (if needed) and run the whole test suite. Extra arguments go to pytest.
# Two pytest-xdist workers, each test file on one worker (its module fixtures run once): the
# suite is mostly single-threaded and subprocess-bound, so on 2 cores it takes about half the
# serial time. AMPATCH_TEST_WORKERS=0 runs it serially (as does a venv without xdist).
EXTRAS="dev,plot,integrations,fp8"  # matplotlib, Lightning, Transformers, torchao too: their tests run instead of skipping
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
WORKERS="${AMPATCH_TEST_WORKERS:-2}"
PARALLEL=()
if [ "$WORKERS" != "0" ] && "$VPY" -c "import xdist" >/dev/null 2>&1; then
  PARALLEL=(-n "$WORKERS" --dist loadfile)
fi
exec "$VPY" -m pytest -q "${PARALLEL[@]}" "$@"
