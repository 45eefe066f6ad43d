"""The O1 op policy: which function gets which cast, as data (no mechanism here).

One module per patched namespace. Each defines tuples of attribute names:

- ``HALF``: floating tensor arguments are cast to the session's half dtype (float16 or
  bfloat16): GEMMs, convolutions, attention, RNN cells.
- ``FLOAT``: float16/bfloat16 tensor arguments are cast to float32: softmax, norms, losses,
  exp/log/pow, reductions, decompositions without half kernels.
- ``PROMOTE``: every floating tensor argument is cast to the widest floating dtype among
  them; an in-place op (``name_``) casts the others to ``self``'s dtype instead. Only ops that
  fail or mis-type with mixed float dtypes on current torch are listed (tests prove each).
- ``SEQUENCE_PROMOTE``: the same for an op whose first argument is a list of tensors.
- ``CPU_FLOAT``: FLOAT when the op's input is on the CPU, where it has no half kernel;
  left alone on other devices (optional in a namespace module).
- ``BANNED``: name -> message naming the safe alternative; with ``allow_banned=True`` the
  op runs in FP32 instead.

and, as documentation checked by the tests, ``NATIVELY_PROMOTING``: candidates measured to
promote mixed float dtypes natively, so they get no wrapper.

The lists assume what the mechanism does and what ``torch.autocast`` does: float64 and
non-floating tensors are never cast, and in-place ops never get a HALF or FLOAT wrapper
(a cast in-place op would write into a temporary copy).

``NAMESPACES`` pairs the dotted path of each owner object (resolved with importlib, then
getattr) with the module holding its lists.
"""
from __future__ import annotations

from types import ModuleType

from . import functional, linalg, tensor, torch_ops, vf

NAMESPACES: tuple[tuple[str, ModuleType], ...] = (
    ("torch", torch_ops),
    ("torch.nn.functional", functional),
    ("torch.Tensor", tensor),
    ("torch.linalg", linalg),
    ("torch._VF", vf),
)
