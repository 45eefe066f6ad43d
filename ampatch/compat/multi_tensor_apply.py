"""`apex.multi_tensor_apply` under the alias: importable (scripts import it far more often
than they call it); calling it fails, since it drives Apex's compiled `amp_C` kernels."""
from __future__ import annotations

from typing import Any

__all__ = ["MultiTensorApply", "multi_tensor_applier"]

_HINT = ("apex.multi_tensor_apply drives Apex's compiled amp_C kernels, which ampatch does not provide: use "
         "torch._foreach_* ops (torch._foreach_mul_, torch._foreach_add_, torch._foreach_norm, ...) or "
         "torch.optim's foreach=True / fused=True")


class MultiTensorApply:
    """Apex's applier object. `available` is False, so code that checks it takes its
    non-fused path; calling it raises with the PyTorch replacement."""

    available = False
    warned = False
    import_err = ImportError(_HINT)

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        raise RuntimeError(_HINT + ".")

    def __call__(self, op: Any, noop_flag_buffer: Any, tensor_lists: Any, *args: Any) -> Any:
        raise NotImplementedError(_HINT + ".")


multi_tensor_applier = MultiTensorApply(2048 * 32)
