"""The optimizer side: what happens to the user's `torch.optim.Optimizer`.

- `handle`: `OptimizerHandle`, the patched `step()` (skip on overflow, masters copied back);
- `calls`: the user's optimizer called as it declares itself (`zero_grad(self)`, Apex-era `step`);
- `context`: what a handle and its driver (a session, Apex's FP16_Optimizer) say to each other;
- `masters`: the master weights an optimizer steps in place of half params;
- `lowmem`: master_weights "stochastic"/"kahan", bfloat16 weights as the only copy, the
  optimizer stepped in FP32 a chunk at a time (`stepper`, shared with `lowmem_sharded` for
  FSDP2); `chunks`: how a step is cut up; `rounding`: their arithmetic;
- `states`: optimizer_states, the optimizer's state kept in bfloat16 or int8 (`quant`) on the
  same chunked step, in checkpoints (`state_checkpoint`; `states_sharded` on FSDP2, where
  `dtensors` is a DTensor as one rank sees it);
- `scaler`: loss scalers and the fused unscale + inf/NaN check.
"""
