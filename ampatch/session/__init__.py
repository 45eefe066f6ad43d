"""One `initialize` call's session: set up, step, close.

- `session`: the `Session` object (its one job: set up, step, close);
- `current`: the one live session of the process;
- `setup` / `fsdp`: a level set up on ordinary and on FSDP2-sharded models, side by side;
- `param_guard`: the check that the model still holds what each optimizer steps;
- `observers`: what watches the session from outside (report at exit, diagnose, step limit);
- `telemetry` / `report` / `exit_json`: counters while it runs, `report()`, the JSON at exit.
"""
