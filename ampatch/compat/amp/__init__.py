"""Apex's `apex.amp` package, module by module: under the alias `apex.amp` itself is ampatch (its
public API), and each `apex.amp.X` is `ampatch.compat.amp.X` here:

- `_amp_state`: the `_amp_state` view of the live session (`AmpState`), `warn_or_err`, `maybe_print`;
- `handle` (the handle `amp.init()` returns), `opt` (`OptimWrapper`), `amp` (`init` and the
  user cast registrations), `frontend` (`initialize`, `Properties`, `opt_levels`), `scaler`
  (the class of `_amp_state.loss_scalers[i]`), `stash` (`optimizer._amp_stash`);
- `lists`: ampatch's O1 op lists in the shape of Apex's `*_overrides` modules (data);
- `utils`, `wrap`, `compat`, `rnn_compat`, `__version__`: Apex's helpers, those with an honest
  torch equivalent implemented, the patching internals raising at call time with ampatch's way.

Apex's private modules (`_initialize`, `_process_optimizer`) are not provided.
"""
