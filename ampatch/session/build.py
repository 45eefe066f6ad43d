"""The level built on the checked models and optimizers, plain or FSDP2-sharded, by one verb
(`build`), and taken back (`undo`); the forwards of kept and output-cast models beside it.

`build` makes the optimizers' handles (their masters from the FP32 weights, before any
cast), then casts the models; a failure half-way takes back what was built before it raises.
"""
from __future__ import annotations

import collections
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn

from ..base.patcher import Patcher
from ..config.options import Properties
from ..config.values import MasterMode
from ..errors import ConfigError
from ..model import cast, sharded
from ..model.cast import ModelHandle, params_to_cast
from ..model.forwards import keep_in_fp32, wrap_outputs
from ..model.keep import Kept, kept_module_ids
from ..model.weight_table import DataWatch
from ..model.weights import Weight
from ..optim.context import ON_ITS_OWN, HandleContext
from ..optim.handle import OptimizerHandle
from ..optim.masters import check_one_master_each, master_ids
from ..optim.sharded import ShardedOptimizerHandle

__all__ = ["build", "undo", "keep_forwards", "wrap_model_outputs"]


def build(props: Properties, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
          patcher: Patcher, context: HandleContext = ON_ITS_OWN, kept: Collection[int] = frozenset(),
          first_index: int = 0) -> tuple[list[Any], list[OptimizerHandle]]:
    """The level on `models` and `optimizers`: returns the models' handles (`ModelHandle`, or
    `sharded.ShardedModel` for FSDP2-sharded models; none where the models are not cast) and
    the optimizers' handles. `kept`: the ids of the modules kept in FP32 and of those inside
    them; `first_index`: the first optimizer's index in its session."""
    if cast.is_sharded(models):
        return _build_sharded(props, models, optimizers, patcher, context, kept)
    keep_bn = props.keep_batchnorm_fp32
    cast_ids = {id(p) for m in models for p in params_to_cast(m, keep_bn, kept)} if props.casts_model else set()
    mode = props.master_mode
    has_masters = mode is MasterMode.FP32 or mode.low_memory
    ids = [master_ids(opt, cast_ids) if has_masters else None for opt in optimizers]
    if has_masters:
        check_one_master_each(optimizers, set().union(*(s for s in ids if s is not None)))
    handles: list[OptimizerHandle] = []
    model_handles: list[ModelHandle] = []
    try:
        for i, opt in enumerate(optimizers):  # masters from the FP32 weights, before the cast
            handles.append(OptimizerHandle(opt, first_index + i, ids[i], context, mode, props.optimizer_states))
        half = props.cast_model_type
        if props.casts_model and half is not None:  # (casts_model: half is a half dtype)
            def trained(p: torch.Tensor) -> Any:
                return next((k for h in handles if (k := h.masters.keeps(p)) is not None), None)
            watch = DataWatch()
            watch.install(patcher)
            seen: dict[int, torch.dtype] = {}  # params cast so far, over all the models
            tied: dict[int, Weight] = {}  # their records
            for m in models:
                # the low-memory modes keep no FP32 values of the cast params (like O3): frozen ones included
                model_handles.append(ModelHandle(m, half, keep_bn, props.cast_model_outputs, patcher,
                                                 trained, mode is MasterMode.FP32, seen, kept, watch, tied))
            for h in handles:
                h.masters.attach(lambda p: tied.get(id(p)))
                h.recast_state()
    except BaseException:
        undo(model_handles, handles)
        raise
    return model_handles, handles


def _build_sharded(props: Properties, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                   patcher: Patcher, context: HandleContext, kept: Collection[int]) -> tuple[list[Any], list[Any]]:
    """`build` on FSDP2-sharded models (docs/fsdp.md): O2/O5 as FSDP2's own mixed precision,
    the sharded FP32 params the masters; O3 with the sharded params half, and so
    master_weights "stochastic"/"kahan" (the sharded bfloat16 params the only copy)."""
    units = [sharded.Units(m) for m in models]  # FSDP2's internals read (and probed) once per model
    if props.casts_model and not all(u.modules for u in units):
        raise ConfigError(f"{props.opt_level} with several models needs all of them sharded with fully_shard or none "
                          "of them.")
    sharded.check_order(models, optimizers)
    masters = props.master_mode is MasterMode.FP32
    mode = props.master_mode if props.casts_model else MasterMode.FP32
    syncs_off = lambda: any(u.syncs_off() for u in units)  # noqa: E731
    cast_ids = ({id(p) for m in models for p in params_to_cast(m, props.keep_batchnorm_fp32, kept)}
                if mode.low_memory else set())
    # low-memory: the compensations are made here, from the FP32 shards, before the cast
    handles: list[ShardedOptimizerHandle] = []
    try:
        for i, opt in enumerate(optimizers):
            handles.append(ShardedOptimizerHandle(opt, i, masters, syncs_off, context, mode, cast_ids,
                                                  props.optimizer_states))
    except BaseException:  # e.g. an optimizer the low-memory modes cannot step shard by shard
        for h in handles:
            h.unswap()
        raise
    names = {id(p): n for m in models for n, p in m.named_parameters()}
    for h in handles:
        h.name_params(names)
    models_built: list[sharded.ShardedModel] = []
    if props.casts_model:
        try:
            for u in units:
                models_built.append(sharded.ShardedModel(u, props, patcher, kept))
        except BaseException:  # the units set up so far go back (a failing one restored itself)
            for m in models_built:
                m.restore()
            for h in handles:
                h.unswap()
            raise
        for h in handles:
            h.recast_state()
        if mode.low_memory:
            def resync(incoming: Any, params: Any) -> None:
                for h in handles:
                    h.resync_from_model(incoming, params)
            for m in models_built:
                m.on_load(resync)
    return models_built, handles


def undo(models: Sequence[Any], optimizers: Sequence[OptimizerHandle]) -> None:
    """Masters back out of the optimizers, models (`ModelHandle` or `ShardedModel`) to their
    dtypes (from what each record keeps; a sharded model from the values the masters give),
    optimizer state to the params' dtypes again."""
    # a view over each optimizer's values, not a merged copy: a sharded kahan optimizer's are made one at a time
    # (read only: typeshed's ChainMap asks for MutableMappings, which a lazy Mapping is not)
    masters = collections.ChainMap[int, torch.Tensor](*[h.unswap() for h in optimizers])  # type: ignore[arg-type]
    for m in models:
        if isinstance(m, ModelHandle):
            m.restore()
        else:
            m.restore(masters)
    if models:
        for h in optimizers:
            h.recast_state()


def keep_forwards(kept: Sequence[Kept], props: Properties, patcher: Patcher) -> frozenset[int]:
    """Wrap the forward of every kept module (see `forwards.keep_in_fp32`); returns the ids of
    the modules that stay FP32 (kept ones and everything inside them). Levels that leave
    the model FP32 and torch unpatched (O0) have nothing to wrap."""
    if props.casts_model or props.patch_torch_functions:
        half = props.cast_model_type if props.casts_model else None
        for k in kept:  # a model kept whole hands out what its model wrapper would
            keep_in_fp32(k.module, patcher, props.cast_model_outputs if k.name == "" else half,
                         props.patch_torch_functions)
    return kept_module_ids(kept)


def wrap_model_outputs(models: Sequence[nn.Module], props: Properties, patcher: Patcher,
                       kept: Collection[int] = frozenset()) -> None:
    """Where the models are not cast (O0/O1/O4), only their outputs are, to
    `cast_model_outputs` when given (Apex); a model kept whole has its keep wrapper for that."""
    if props.casts_model or props.cast_model_outputs is None:
        return
    for m in models:
        if id(m) not in kept:
            wrap_outputs(m, props.cast_model_outputs, patcher)
