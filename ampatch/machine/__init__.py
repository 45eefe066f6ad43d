"""What this machine can do, and the advice that follows from it.

- `hardware`: which half dtypes a device runs natively (`DeviceInfo`, `SessionDevice`, the
  `Machine` a policy was measured on), and the once-only warning at `initialize`;
- `device_text`: what ampatch says about a device (advice, the machine line, table notes);
- `tips`: advice mixed-precision guides give in prose, given where it applies.
"""
