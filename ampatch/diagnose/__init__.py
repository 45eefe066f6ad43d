"""`ampatch diagnose`: where half precision hurts, and a verified fix.

- `recorder`: per-module statistics of a session's first optimizer steps (hooks; numbers only);
- `shadow`: each module's FP32 shadow, the reference its local error is measured against;
- `stats`: the numbers (magnitudes, inf/NaN counts, relative error, underflow);
- `analysis`: the diagnosis: the first non-finite module, modules ranked, the recommendation.
"""
