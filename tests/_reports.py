"""Hand-made run reports for the tests of compare, tune and the runner: the fields every
`Report` must have, and `report(fields)`, read as a child's report is (`Report.from_dict`)."""
from __future__ import annotations

from ampatch.session.report import Report

REQUIRED = {"opt_level": "O0", "half_dtype": None, "enabled": True, "casts": {}, "cache": {"hits": 0, "misses": 0},
            "steps": 0, "skipped_steps": [], "loss_scale": {}, "loss_scale_history": {},
            "time_s": {"wrappers": None, "scale_loss": None}}


def report(fields: dict) -> Report:
    """A hand-made report with ``fields`` over the required defaults."""
    return Report.from_dict({**REQUIRED, **fields})
