#!/usr/bin/env bash
# Set up .venv (if needed) and run the whole test suite. Extra arguments go to pytest.
EXTRAS="dev,plot"  # matplotlib too, so the --plot test runs instead of skipping
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec "$VPY" -m pytest -q "$@"
