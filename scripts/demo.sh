#!/usr/bin/env bash
# Set up .venv (if needed) and compare all opt levels on the built-in workload, within
# `ampatch compare`'s default 120-second budget, with live progress per level; Ctrl-C prints
# the levels that finished. A few seconds of calibration first pick the largest workload size
# at which every level runs at least 30 steps here (the table's title says which; --size sets
# it). Extra arguments go to `ampatch compare`, e.g.:
#   scripts/demo.sh --levels O0,O4,O5 --budget 60s --plot curves.png
#   scripts/demo.sh --size small           # this size, whatever the machine
#   scripts/demo.sh --steps 150            # exactly 150 steps per level, no budget
#   scripts/demo.sh -- python examples/basic.py --steps 50
EXTRAS="dev,plot"  # matplotlib, for --plot
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec "$VPY" -m ampatch compare "$@"
