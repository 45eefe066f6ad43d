"""An optimizer over FSDP2-sharded parameters (`ShardedOptimizerHandle`), beside the plain handle.

At O2/O5 its parameters, the sharded FP32 ones, are the masters: nothing to copy after a
step, no extra entry in `state_dict()`. It changes the plain handle only through its public
hooks: a backward under `set_requires_gradient_sync(False)` leaves its gradients inside FSDP,
unreduced and scaled, so their unscale waits for the backward that syncs (`unscale_waits`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from .context import HandleContext
from .handle import OptimizerHandle
from .masters import MASTERS_KEY

logger = logging.getLogger("ampatch")

__all__ = ["ShardedOptimizerHandle"]


class ShardedOptimizerHandle(OptimizerHandle):
    """`syncs_off()`: whether a sharded unit of the models has gradient sync off now.
    `masters`: the sharded params are FP32 masters (O2/O5: every unscale is checked, even at
    a static scale of 1.0)."""

    def __init__(self, optimizer: torch.optim.Optimizer, index: int, masters: bool, syncs_off: Callable[[], bool],
                 context: HandleContext = HandleContext()) -> None:
        super().__init__(optimizer, index, None, context)
        self.use_masters = masters
        self.syncs_off = syncs_off

    def unscale_waits(self) -> bool:
        return self.syncs_off()

    def still_scaled_message(self) -> str:
        if not self.syncs_off():
            return super().still_scaled_message()
        return ("optimizer.step() after a backward with FSDP2 gradient sync off: the gradients are still inside "
                "FSDP, unreduced. Call model.set_requires_gradient_sync(True) before the last micro-batch's "
                "backward.")

    def checkpoint_entries(self) -> dict[str, Any]:
        return {}  # the masters are the sharded params: in the model's state dict already

    def load_entries(self, state_dict: dict, inner: Callable) -> None:
        if state_dict.pop(MASTERS_KEY, None) is not None:
            logger.info("ampatch: the optimizer checkpoint carries FP32 masters from an unsharded run; under FSDP2 "
                        "the masters are the sharded params, loaded with the model's state dict.")
        inner(state_dict)
