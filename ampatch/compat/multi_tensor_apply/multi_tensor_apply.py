"""`apex.multi_tensor_apply.multi_tensor_apply`: Apex's applier, driving the `amp_C` kernels
that ampatch computes with torch's foreach ops (`ampatch.compat.extensions.amp_C`)."""
from __future__ import annotations

from typing import Any

__all__ = ["MultiTensorApply", "multi_tensor_applier"]


class MultiTensorApply:
    """`applier(op, noop_flag_buffer, tensor_lists, *args)` calls
    `op(chunk_size, noop_flag_buffer, tensor_lists, *args)`, as Apex's did. `available` is
    True: the kernels exist (they do not need CUDA here)."""

    available = True
    warned = False

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        """Apex raised here without its extension; the kernels are always available here."""

    def __call__(self, op: Any, noop_flag_buffer: Any, tensor_lists: Any, *args: Any) -> Any:
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)
