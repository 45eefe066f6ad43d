#!/usr/bin/env bash
# Set up .venv (if needed) and compare all opt levels on the built-in workload.
# Extra arguments go to `ampatch compare`, e.g.:
#   scripts/demo.sh --levels O0,O4,O5 --steps 50 --plot out/curves.png
#   scripts/demo.sh -- python examples/basic.py --steps 50
EXTRAS="dev,plot"  # matplotlib, for --plot
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec "$VPY" -m ampatch compare "$@"
