"""Configuration: what a session is asked to be, checked before anything changes.

- `options`: `initialize`'s keywords as one frozen `Options`, parsed once; `resolve` checks
  them as a whole into the session's `Properties` (settings from outside beat the script
  by one rule);
- `levels`: the opt-level table O0-O5 (`Level`) and the rules about a level's half dtype;
- `values`: the one parser of each kind of value (dtypes, flags, loss scales, master modes,
  name lists), with the loss-scale range and defaults;
- `env`: every ``AMPATCH_*`` variable, read once per `initialize` into `Overrides`;
- `policy_file`: `ampatch tune`'s policy files, as data (applied by `session.prepare.outside`);
- `settings`: Apex's process-wide flags (`hard_override`, ...).

Data and checks only: nothing here changes a model, an optimizer or torch, and nothing here
imports a room above `base`.
"""
