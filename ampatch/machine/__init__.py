"""What this machine can do, and the advice that follows from it.

- `hardware`: which half dtypes a device runs natively (`DeviceInfo`, `SessionDevice`, the
  `Machine` a policy was measured on), and the advice `initialize` gives (half not native
  here, layer sizes Tensor Cores dislike, an Adam eps float16 loses);
- `device_text`: what ampatch says about a device (advice, the machine line, table notes);
- `tips`: advice mixed-precision guides give in prose, given where a run meets the problem.
"""
