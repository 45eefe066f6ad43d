"""`ampatch diagnose`: where half precision hurts, and a verified fix — the command half.

Diagnose is one feature in two halves. The other half, `ampatch.record`, runs inside the
diagnosed training process (below the session, as one of its observers) and writes a
`Recording`; this package is the command that starts that process, reads the recording and
turns it into a verified recommendation:

- `command`: the library entry point, `diagnose(Request(...)) -> Diagnosis`: the recorded
  run, O0's, and the reruns that verify the recommendation;
- `analysis`: recording -> diagnosis: the first non-finite module, modules ranked, the
  recommendation (modules to keep in FP32, a loss scale, FP32 masters);
- `stalls`: stalled updates (weights each optimizer step leaves unchanged) read from the recording;
- `fp8`: the layers run in FP8, each against bfloat16, and those FP8 hurts (`diagnose --fp8`);
- `result`: the typed diagnosis and its JSON; `render`: the text and the plot.
"""
