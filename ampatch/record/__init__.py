"""The in-process half of `ampatch diagnose`: what a diagnosed run records about itself.

Diagnose is one feature in two halves: this package runs inside the training process being
diagnosed and writes what it measured; `ampatch.diagnose` is the command that starts that
process, reads the recording and makes a verified recommendation of it.

- `recorder`: per-module statistics of a session's first optimizer steps (hooks; numbers only);
- `shadow`: each module's FP32 shadow, the reference its local error is measured against;
- `stats`: the numbers (magnitudes, inf/NaN counts, relative error, underflow);
- `stalls`: per parameter tensor and step, the share of elements the optimizer step left unchanged;
- `records`: the records and the `Recording` document (JSON) they travel in;
- `fp8_error`: each FP8 layer's error against bfloat16 on the same inputs (`diagnose --fp8`);
- `fp8_probe`: the hooks that measure the run's own FP8 layers that way, call by call;
- `child`: the session's side: `attach` starts a recorder and writes its recording when done.

Below the session (it is one of the session's observers) and above the core it measures:
nothing here imports `session` internals beyond what attaching needs, nor the `diagnose`
command, which reads what this writes.
"""
