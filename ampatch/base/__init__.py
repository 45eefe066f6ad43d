"""The bottom layer: what every other part of ampatch uses and nothing in ampatch is below.

- `dtypes`: the floating dtypes mixed precision deals in, and their names;
- `tree`: the one walk over nested arguments (lists, tuples, dicts, batch objects);
- `notices`: warnings that point at the user's line, and the "ampatch" logger's guard;
- `counters`: thread-safe call counters (the hot path's only bookkeeping);
- `hardware`: which half dtypes the device runs natively (`DeviceInfo`, `SessionDevice`);
- `device_text`: what ampatch says about a device (advice, the machine line, table notes);
- `tips`: advice mixed-precision guides give in prose, given where it applies.
"""
