"""The in-process half of `ampatch diagnose`: what a diagnosed run records about itself.

- `recorder`: per-module statistics of a session's first optimizer steps (hooks; numbers only);
- `shadow`: each module's FP32 shadow, the reference its local error is measured against;
- `stats`: the numbers (magnitudes, inf/NaN counts, relative error, underflow);
- `child`: the session's side: `attach` starts a recorder and writes its JSON when done.

Below the session (it is one of the session's observers) and above the core it measures:
nothing here imports `session` or the `diagnose` command, which reads what this writes.
"""
