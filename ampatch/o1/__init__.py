"""The O1/O4 engine in one room: torch's functions patched to cast per op (O4 is O1 in bfloat16).

Policy beside mechanism, as Apex's `amp/` kept `lists/` beside `wrap.py`:

- `lists/`: which op casts to what, per namespace (data only), and the user's registrations;
- `plans`: a kind and an op become a `CastPlan`, the one place each cast rule is decided;
- `wrappers`: the eager wrapper of a plan (the hot path, casting through the cast cache);
- `twins`: the plain-Python twin of a plan that `torch.compile` traces;
- `proxies`: the wrapt objects holding both, and `wrap`, which builds them;
- `cache`: the per-iteration cast cache of parameters;
- `install`: finds what the lists name on this torch, builds each wrapper, applies it;
- `rnn`, `jit`, `dynamo`: what is not one wrapper per op (RNN modules, TorchScript, compile).

Every patch goes through `base.patcher.Patcher`, so `deinitialize` restores it exactly.
"""
