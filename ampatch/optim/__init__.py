"""The optimizer side: what happens to the user's `torch.optim.Optimizer`.

- `handle`: `OptimizerHandle`, the patched `step()` (skip on overflow, masters copied back);
- `context`: what a handle and its driver (a session, Apex's FP16_Optimizer) say to each other;
- `masters`: the master weights an optimizer steps in place of half params;
- `scaler`: loss scalers and the fused unscale + inf/NaN check;
- `scheduler_guard`: LR schedulers held on a skipped step (for the frameworks).
"""
