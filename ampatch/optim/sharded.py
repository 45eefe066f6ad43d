"""An optimizer over FSDP2-sharded parameters (`ShardedOptimizerHandle`), beside the plain handle.

At O2/O5 its parameters, the sharded FP32 ones, are the masters: nothing to copy after a
step, no extra entry in `state_dict()`. Under master_weights "stochastic"/"kahan" its
parameters are the sharded bfloat16 ones, stepped by `lowmem_sharded.ShardedLowMem`. With
optimizer_states "bfloat16"/"int8" its state is kept over each rank's local shards and
checkpointed as FP32 state sharded like the params (`states_sharded`). It changes the plain
handle only through its public hooks: a backward under `set_requires_gradient_sync(False)`
leaves its gradients inside FSDP, unreduced and scaled, so their unscale waits for the
backward that syncs (`unscale_waits`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..config.values import MasterMode, StatePrecision
from . import states_sharded
from .context import ON_ITS_OWN, HandleContext
from .handle import OptimizerHandle
from .lowmem_sharded import ShardedLowMem, local_footprint
from .masters import LOWMEM_KEY, MASTERS_KEY, Masters

logger = logging.getLogger("ampatch")

__all__ = ["ShardedOptimizerHandle"]


class ShardedMasters(Masters):
    """No masters of their own (the sharded params are what the optimizer steps); the
    footprint is this rank's: its local shards."""

    def footprint(self) -> tuple[int, int]:
        return local_footprint(self.params())


class ShardedOptimizerHandle(OptimizerHandle):
    """`syncs_off()`: whether a sharded unit of the models has gradient sync off now.
    `masters`: the sharded params are FP32 masters (O2/O5: every unscale is checked, even at
    a static scale of 1.0). `mode` "stochastic"/"kahan": the sharded params are bfloat16, the
    only copy (`ShardedLowMem`; `lowmem_ids`: the params the model cast turns bfloat16).
    `states`: the precision its state is kept in, over each rank's local shards."""

    def __init__(self, optimizer: torch.optim.Optimizer, index: int, masters: bool, syncs_off: Callable[[], bool],
                 context: HandleContext = ON_ITS_OWN, mode: MasterMode = MasterMode.FP32,
                 lowmem_ids: set[int] | None = None, states: StatePrecision = StatePrecision.FLOAT32) -> None:
        states_sharded.check_shardable(optimizer, states)  # before anything changes
        super().__init__(optimizer, index, None, context)  # its store keeps nothing: the sharded one below does
        self.masters = (ShardedLowMem(optimizer, lowmem_ids or set(), mode) if mode.low_memory
                        else ShardedMasters(optimizer, None))
        self.use_masters = masters or mode.low_memory
        self.syncs_off = syncs_off
        self.process_group = context.process_group
        try:
            self.states = states_sharded.kept_store(optimizer, states, self.process_group)
        except BaseException:
            self.masters.unswap()
            raise

    def unscale_waits(self) -> bool:
        return self.syncs_off()

    def name_params(self, names: dict[int, str]) -> None:
        """The params' names in the model (id(param) -> name), for messages about them."""
        if isinstance(self.masters, ShardedLowMem):
            self.masters.names = names

    def resync_from_model(self, incoming: dict[int, torch.Tensor] | None = None,
                          params: list[torch.Tensor] | None = None) -> None:
        """After the sharded model's `load_state_dict`: a kahan compensation takes what the loaded
        values have beyond bfloat16 (`ShardedLowMem.resync_from_model`)."""
        if isinstance(self.masters, ShardedLowMem):
            self.masters.resync_from_model(incoming, params)

    def still_scaled_message(self) -> str:
        if not self.syncs_off():
            return super().still_scaled_message()
        return ("optimizer.step() after a backward with FSDP2 gradient sync off: the gradients are still inside "
                "FSDP, unreduced. Call model.set_requires_gradient_sync(True) before the last micro-batch's "
                "backward.")

    def checkpoint_entries(self) -> dict[str, Any]:
        return {}  # the masters are the sharded params: in the model's state dict already (low-memory: a state hook)

    def add_state_entries(self, state_dict: dict) -> None:
        """The kept state, as FP32 state sharded like the params (`states_sharded`); a sharded
        compensation joins the state through its own hook (`ShardedLowMem`)."""
        states_sharded.add_entries(self.states, list(self.params()), state_dict)

    def load_entries(self, state_dict: dict, inner: Callable) -> None:
        if state_dict.pop(MASTERS_KEY, None) is not None:
            logger.info("ampatch: the optimizer checkpoint carries FP32 masters from an unsharded run; under FSDP2 "
                        "the masters are the sharded params, loaded with the model's state dict.")
        if state_dict.pop(LOWMEM_KEY, None) is not None:
            logger.info("ampatch: the optimizer checkpoint carries the low-memory entry of an unsharded run; under "
                        "FSDP2 its compensations and rounding state travel as state and param group entries: not "
                        "loaded.")
        keep = states_sharded.take(self.states, state_dict, list(self.params()), self.process_group)
        if isinstance(self.masters, ShardedLowMem):
            self.masters.load(state_dict, inner, self.process_group)
        else:
            inner(state_dict)
        keep()
