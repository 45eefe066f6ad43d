"""The O1/O4 engine in one room: torch's functions patched to cast per op (O4 is O1 in bfloat16).

Policy beside mechanism, as Apex's `amp/` kept `lists/` beside `wrap.py`:

- `lists/`: which op casts to what, per namespace (data only), and the user's registrations;
- `plans`: a kind and an op become a `OpPlan`, the one place each cast rule is decided;
- `signatures`: how an op takes its arguments (which of them can hold a tensor);
- `generate`: writes an op's O1 function from its plan and layout (the hot path: one pass,
  parameters' casts served from the cast cache inline);
- `wrappers`: gathers what that function needs, and its general path for other call forms;
- `twins`: the plain-Python twin of a plan that `torch.compile` traces;
- `proxies`: `wrap`, which makes the function and attaches its twin (behind a wrapt proxy);
- `cache`: the per-iteration cast cache of parameters;
- `install`: finds what the lists name on this torch, builds each function, applies it;
- `rnn`, `jit`, `dynamo`, `captured`: what is not one function per op (RNN modules,
  TorchScript, torch.compile, what the compiler binds from torch at import).

Every patch goes through `base.patcher.Patcher`, so `deinitialize` restores it exactly.
"""
