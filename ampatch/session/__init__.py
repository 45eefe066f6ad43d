"""One `initialize` call's session: set up, step, close.

- `session`: the `Session` object (its one job: set up, step, close) and `current()`, the
  live session of the process;
- `prepare`: what the environment and a policy ask of the call, read once, and the call
  checked as a whole before anything changes;
- `build`: the level built on plain or FSDP2-sharded models and optimizers, and the undo;
- `param_guard`: at run time, that the model still holds what each optimizer steps;
- `addons`: what the rooms above register (Apex's names, other libraries' checks);
- `observers`: what watches the session from outside (report at exit, diagnose, step limit);
- `telemetry` / `report`: counters while it runs, and `report()`;
- `user_casts`: the user's own cast rules (`amp.register_*_function`, the decorators,
  `amp.disable_casts`), remembered for later sessions and applied to the live one.
"""
