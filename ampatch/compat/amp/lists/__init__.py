"""`apex.amp.lists`: ampatch's O1 op lists (`ampatch.o1.lists`) in the shape of Apex's modules
`functional_overrides`, `torch_overrides` and `tensor_overrides`.

They are data derived from ampatch's policy, read-only in effect: changing them changes
nothing (Apex read its lists once, at `amp.init`/`initialize`; ampatch's policy is
`ampatch.o1.lists`). To cast a function of your own, use `amp.register_half_function(module,
name)`, `register_float_function` or `register_promote_function` before `amp.initialize`.
The half lists hold the same names for float16 and bfloat16: ampatch casts the same ops to
the session's half dtype (bfloat16 at O4).
"""
from __future__ import annotations

from . import functional_overrides, tensor_overrides, torch_overrides

__all__ = ["functional_overrides", "torch_overrides", "tensor_overrides"]
