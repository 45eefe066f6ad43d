"""`ampatch diagnose`: where half precision hurts, and a verified fix.

- the recording itself (recorder, FP32 shadows, stats) runs inside the diagnosed process and
  lives below the session, in `ampatch.record`;
- `analysis`: the diagnosis: the first non-finite module, modules ranked, the recommendation.
"""
