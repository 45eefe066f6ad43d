"""The O1/O4 engine: torch's functions patched to cast per op (O4 is O1 in bfloat16).

- `lists/`: the cast lists per namespace (data: which ops run in half, in FP32, promoted,
  banned) and the user's registrations;
- `install`: finds what the lists name on this torch, builds each wrapper, applies it;
- `rnn`, `jit`, `dynamo`: what is not one wrapper per op (RNN modules, TorchScript,
  torch.compile).

The wrappers themselves (the mechanism) are `ampatch.patching`.
"""
