"""One `initialize` call's session: set up, step, close.

- `session`: the `Session` object (its one job: set up, step, close) and `current()`, the
  live session of the process;
- `build`: the build step (the call checked, the level built on plain or FSDP2-sharded
  models, the guard that the model still holds what each optimizer steps, the undo);
- `observers`: what watches the session from outside (report at exit, diagnose, step limit);
- `telemetry` / `report`: counters while it runs, and `report()`;
- `user_casts`: the user's own cast rules (`amp.register_*_function`, the decorators,
  `amp.disable_casts`), remembered for later sessions and applied to the live one.
"""
