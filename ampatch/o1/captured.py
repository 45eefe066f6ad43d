"""What torch's compiler stack binds from torch when it is first imported: under O1, torch's
own ops, never the session's O1 functions.

Some modules of `torch.compile` copy torch's functions into their own tables at import:

- Inductor's `torch._inductor.select_algorithm.extern_kernels`, which its kernel modules
  fill from `torch.mm`, `torch.addmm`, `torch.bmm`, `torch.baddbmm`, `torch.convolution`, ...:
  what Inductor's generated code calls for GEMMs and convolutions;
- Dynamo's `torch._dynamo.variables.tensor.all_tensor_attrs` (`torch.Tensor`'s attributes by
  name), which it traces a tensor subclass's `__torch_function__` with, and
  `torch._dynamo.variables.torch.ops_consuming_unbacked_scalars` (`torch.addmm`, ...).

Imported while a session patches torch (the first `torch.compile` under O1), they would hold
O1 functions: every GEMM of every compiled graph would pay an O1 call, and after
`deinitialize` an FP32 `extern_kernels.addmm` would still return half. The casts belong in
the graph Dynamo captured (`o1.dynamo`); what runs after them is torch's op. `keep_torch_ops`
puts torch's originals back into those tables whenever the compiler may have been imported
(Dynamo's hooks installed, each backend compile) and on `deinitialize`.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from ..base.patcher import Patcher

__all__ = ["CAPTURED", "keep_torch_ops", "restore_captured"]

logger = logging.getLogger("ampatch")

# (module, attribute): a namespace object, a dict or a frozenset holding torch's functions
CAPTURED: tuple[tuple[str, str], ...] = (
    ("torch._inductor.select_algorithm", "extern_kernels"),
    ("torch._dynamo.variables.tensor", "all_tensor_attrs"),
    ("torch._dynamo.variables.torch", "ops_consuming_unbacked_scalars"),
)


def restore_captured(original_of: Callable[[Any], Any]) -> int:
    """Replace each entry of the `CAPTURED` tables for which `original_of` names an original
    (an O1 function: the op it stands for; anything else: None) by that original. Returns
    how many were replaced; a table whose module was never imported is left alone."""
    replaced = 0
    for module_name, attr in CAPTURED:
        module = sys.modules.get(module_name)
        table = getattr(module, attr, None)
        if table is None:
            continue
        if isinstance(table, frozenset):
            found = {v: original_of(v) for v in table}
            found = {v: o for v, o in found.items() if o is not None}
            if found:
                setattr(module, attr, frozenset(found.get(v, v) for v in table))
                replaced += len(found)
            continue
        entries = table if isinstance(table, dict) else vars(table)
        for name, value in list(entries.items()):
            original = original_of(value)
            if original is not None:
                if isinstance(table, dict):
                    table[name] = original
                else:
                    setattr(table, name, original)
                replaced += 1
    if replaced:
        logger.debug("ampatch: %d entries of torch.compile's tables are torch's own ops again", replaced)
    return replaced


def keep_torch_ops(patcher: Patcher, original_of: Callable[[Any], Any]) -> Callable[[], None]:
    """Restore the `CAPTURED` tables on `deinitialize`; returns the restore, for the compile
    steps to call (`o1.dynamo`). `original_of` must answer after the patches are undone."""
    def restore() -> None:
        restore_captured(original_of)

    patcher.on_restore(restore)
    return restore
