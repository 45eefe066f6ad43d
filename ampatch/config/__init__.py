"""Configuration: what a session is asked to be, checked before anything changes.

- `values`: the one parser of each kind of value (dtypes, flags, loss scales, master modes,
  name lists), with the loss-scale range and defaults;
- `levels`: the opt-level table O0-O5 (`Level`) and the rules about a level's half dtype;
- `properties`: a level plus overrides -> `Properties` (`resolve`), where settings from
  outside beat the script by one rule;
- `env`: every ``AMPATCH_*`` variable, read once per `initialize` into `Overrides`;
- `policy_file`: `ampatch tune`'s policy files, applied in code or from outside;
- `options`: `initialize`'s keywords as one frozen `Options`, and `prepare`;
- `settings`: Apex's process-wide flags (`hard_override`, ...).

Data and checks only: nothing here changes a model, an optimizer or torch.
"""
