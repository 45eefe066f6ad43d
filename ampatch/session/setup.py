"""A level on ordinary (unsharded) models, beside `fsdp.setup` for FSDP2-sharded ones.

`setup` casts the models and makes the optimizers' handles (with their FP32 masters) and
returns what it built, as `fsdp.setup` does; `undo` takes both kinds back. What either
path needs around it, written once: `keep_forwards` (the `keep_fp32` wrappers) and
`wrap_model_outputs` (outputs cast at the levels that leave the model as it is).
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn

from ..model.forwards import keep_in_fp32, wrap_outputs
from ..model.keep import Kept, kept_module_ids
from ..config.properties import Properties
from ..config.values import MasterMode
from ..optim.masters import check_one_master_each, master_ids
from ..model.cast import ModelHandle, params_to_cast
from ..optim.context import HandleContext
from ..optim.handle import OptimizerHandle

__all__ = ["setup", "undo", "keep_forwards", "wrap_model_outputs"]


def setup(props: Properties, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
          patcher: Any, context: HandleContext = HandleContext(), kept: Collection[int] = frozenset(),
          first_index: int = 0) -> tuple[list[ModelHandle], list[OptimizerHandle]]:
    """Masters made from the FP32 weights (O2/O5: FP32 copies; master_weights "stochastic" or
    "kahan": aliases of the bfloat16 weights, with the compensation made from the FP32 values
    for "kahan"), then the models cast (O2/O3/O5); returns
    the models' and the optimizers' handles (no model handles where the models are not
    cast). `kept`: the ids of the modules kept in FP32 and of those inside them;
    `first_index`: the first optimizer's index in its session. A failure
    half-way takes back what was built before it raises."""
    keep_bn = props.keep_batchnorm_fp32
    cast_ids = ({id(p) for m in models for p in params_to_cast(m, keep_bn, kept)} if props.casts_model
                else set())
    mode = props.master_mode
    fp32_masters = mode is MasterMode.FP32
    has_masters = fp32_masters or mode.low_memory
    ids = [master_ids(opt, cast_ids) if has_masters else None for opt in optimizers]
    if has_masters:
        check_one_master_each(optimizers, set().union(*ids) if ids else set())
    handles: list[OptimizerHandle] = []
    model_handles: list[ModelHandle] = []
    try:
        for i, opt in enumerate(optimizers):  # masters from the FP32 weights, before the cast
            handles.append(OptimizerHandle(opt, first_index + i, ids[i], context, mode))
        if props.casts_model:
            # the low-memory modes keep no FP32 values of the cast params (like O3): frozen ones included
            mastered = {pid for h in handles for pid in h.masters.master_of} if fp32_masters else None
            seen: dict[int, torch.dtype] = {}  # params cast so far, over all the models
            for m in models:
                handle = ModelHandle(m, props.cast_model_type, keep_bn, props.cast_model_outputs, patcher,
                                     mastered, seen, kept)
                handle.on_load(lambda incoming, params: _resync(handles, incoming, params))
                model_handles.append(handle)
            for h in handles:
                h.recast_state()
    except BaseException:
        undo(model_handles, handles)
        raise
    return model_handles, handles


def _resync(handles: Sequence[OptimizerHandle], incoming: dict[int, torch.Tensor],
            params: list[torch.Tensor]) -> None:
    """After a `load_state_dict` of a cast model: the masters re-read what was loaded."""
    for h in handles:
        h.resync_from_model(incoming, params)


def undo(models: Sequence[Any], optimizers: Sequence[OptimizerHandle]) -> None:
    """Masters back out of the optimizers, models (`ModelHandle` or `fsdp.ShardedModel`) to
    their dtypes (from the masters), optimizer state to the params' dtypes again."""
    masters: dict[int, torch.Tensor] = {}
    for h in optimizers:
        masters.update(h.unswap())
    for m in models:
        m.restore(masters)
    if models:
        for h in optimizers:
            h.recast_state()


def keep_forwards(kept: Sequence[Kept], props: Properties, patcher: Any) -> frozenset[int]:
    """Wrap the forward of every kept module (see `forwards.keep_in_fp32`); returns the ids of
    the modules that stay FP32 (kept ones and everything inside them). Levels that leave
    the model FP32 and torch unpatched (O0) have nothing to wrap."""
    if props.casts_model or props.patch_torch_functions:
        half = props.cast_model_type if props.casts_model else None
        for k in kept:  # a model kept whole hands out what its model wrapper would
            keep_in_fp32(k.module, patcher, props.cast_model_outputs if k.name == "" else half,
                         props.patch_torch_functions)
    return kept_module_ids(kept)


def wrap_model_outputs(models: Sequence[nn.Module], props: Properties, patcher: Any,
                       kept: Collection[int] = frozenset()) -> None:
    """Where the models are not cast (O0/O1/O4), only their outputs are, to
    `cast_model_outputs` when given (Apex); a model kept whole has its keep wrapper for that."""
    if props.casts_model or props.cast_model_outputs is None:
        return
    for m in models:
        if id(m) not in kept:
            wrap_outputs(m, props.cast_model_outputs, patcher)
