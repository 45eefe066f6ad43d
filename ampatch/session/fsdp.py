"""FSDP2 (`torch.distributed.fsdp.fully_shard`): every opt level on sharded models.

One supported order: shard, then build the optimizer, then initialize.

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")

What a level means for a sharded model:

- O0, O1, O4: the model is left alone (O1/O4 patch torch functions as they do without
  FSDP); the optimizer steps the sharded FP32 parameters.
- O2, O5 (master weights): the level becomes FSDP2's own mixed precision on every sharded
  unit. The sharded FP32 parameters are the masters that the optimizer steps; each unit
  all-gathers half copies of them for forward and backward (`param_dtype` = half) and
  reduces gradients in FP32 (`reduce_dtype` = float32). There is no second copy of the
  weights. FSDP2 all-gathers one dtype per unit, so `keep_batchnorm_fp32` holds only for a
  batch norm that is a `fully_shard` unit of its own, and `keep_fp32` only for modules made
  units of their own (or of units inside them); one that shares a unit with layers in half
  raises `ValueError`.
- O3 (no master weights): the sharded parameters themselves become half; the optimizer
  steps half parameters and gradients are reduced in half.
- master_weights "stochastic" / "kahan" are refused at `initialize` (ValueError naming the
  alternatives): they step an optimizer over the model's own bfloat16 tensors a chunk at a
  time, and under FSDP2 those are DTensor shards that FSDP2 itself re-registers; FSDP2's
  O5 (sharded FP32 masters) already divides the masters' memory by the number of ranks.

At O2/O3/O5 floating buffers (batch norms excepted with `keep_batchnorm_fp32`) go to half,
forward inputs to half and outputs to FP32 (or `cast_model_outputs`), and
`model.state_dict()` holds FP32 tensors, as without FSDP. `deinitialize` puts back the
units' own mixed-precision policies and dtypes.

Loss scaling is unchanged: the gradients are FSDP's sharded gradients after its
reduce-scatter; each rank unscales and checks its own shard and the overflow flag is
all-reduced, so every rank skips the same steps. A backward under
`set_requires_gradient_sync(False)` leaves its gradients inside FSDP, unreduced and
scaled: their unscale and overflow verdict wait for the backward that syncs, as with
`scale_loss(..., delay_unscale=True)`.

`ParamGuard` (every session, sharded or not) catches the other orders: a parameter an
optimizer steps that the model no longer holds (`fully_shard` or another wrapper that
swaps parameters after `initialize`, `load_state_dict(assign=True)`) raises at that
optimizer's next `step()`, instead of training orphans while the model never changes.

FSDP2 has no public API to change a unit's mixed-precision policy or parameter dtype after
`fully_shard`; the internals used for it are confined to `_Units` below (torch 2.6+).
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..base.dtypes import LOW
from ..config.properties import Properties
from ..config.values import MasterMode
from ..optim.masters import MASTERS_KEY
from ..model.forwards import wrap_outputs
from ..model.cast import is_batchnorm, modules_to_cast, params_to_cast
from ..optim.context import HandleContext, OptState
from ..optim.handle import OptimizerHandle

logger = logging.getLogger("ampatch")

ORDER = ("shard the model first (fully_shard on its blocks, then on the model), then build the optimizer "
         "from the sharded model's parameters, then call `model, optimizer = amp.initialize(model, optimizer, "
         "...)`")


def _fsdp_module_class() -> type | None:
    """`FSDPModule`, if FSDP2 was imported (a model can only be sharded if it was): no import cost otherwise."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None)


def _dtensor_class() -> type | None:
    tensor = sys.modules.get("torch.distributed.tensor")
    return getattr(tensor, "DTensor", None)


def sharded_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that `fully_shard` was applied to."""
    cls = _fsdp_module_class()
    if cls is None:
        return []
    return [m for m in model.modules() if isinstance(m, cls)]


def is_sharded(models: Iterable[nn.Module]) -> bool:
    """Whether any of `models` has FSDP2-sharded modules."""
    return any(sharded_modules(m) for m in models)


class _Units:
    """The FSDP2 states (one per `fully_shard` call) of a model, and every access to FSDP2
    internals that ampatch needs: parameter groups, per-parameter state, policies."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modules = sharded_modules(model)
        try:
            states, seen = [], set()
            for m in self.modules:
                state = m._get_fsdp_state()
                if id(state) not in seen:  # fully_shard([a, b]) gives a and b one state
                    seen.add(id(state))
                    states.append(state)
            self.states = states
            self.groups = [g for s in states for g in _param_groups(s)]
            self.params = [fp for g in self.groups for fp in g.fsdp_params]
            _probe(states, self.groups, self.params)  # fail here, before anything changed
        except AttributeError as exc:
            raise RuntimeError(f"ampatch: the FSDP2 internals of this torch ({torch.__version__}) differ from those "
                               f"ampatch uses to apply opt levels to fully_shard models ({exc}); ampatch supports "
                               "FSDP2 as in torch 2.6 to 2.13.") from exc

    @staticmethod
    def slots(fp: Any) -> list[tuple[nn.Module, str]]:
        """Where an FSDP parameter is registered: (module, name), shared registrations included."""
        info = fp._module_info
        return [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]

    def managed_slots(self) -> set[tuple[int, str]]:
        return {(id(m), n) for fp in self.params for m, n in self.slots(fp)}

    def group_modules(self, group: Any) -> list[nn.Module]:
        return [fp._module_info.module for fp in group.fsdp_params]

    def syncs_off(self) -> bool:
        """A unit has gradient sync off (`set_requires_gradient_sync(False)`)."""
        return any(not g.reduce_grads for g in self.groups)

    def reshard(self) -> None:
        """Sharded parameters registered on every module (a no-op when they are already)."""
        for m in self.modules:
            m.reshard()

    def policies(self) -> list[tuple[Any, Any]]:
        """(state, its MixedPrecisionPolicy) for every unit."""
        return [(s, s._mp_policy) for s in self.states]

    def set_policy(self, state: Any, policy: Any) -> None:
        state._mp_policy = policy
        for g in _param_groups(state):
            g.mp_policy = policy
            for fp in g.fsdp_params:
                fp.mp_policy = policy

    def refresh_dtypes(self) -> None:
        """After a policy or parameter dtype changed: drop the unsharded buffers of the old
        dtype (FSDP2 allocates them once, at the first all-gather) and recompute each group's
        dtypes, as FSDP2's lazy init does."""
        self.reshard()
        for fp in self.params:
            fp.all_gather_outputs = []
            fp.__dict__.pop("_unsharded_param", None)
            fp.unsharded_accumulated_grad = None
        for g in self.groups:
            g._init_mp_dtypes()

    def swap_dtype(self, params: Sequence[nn.Parameter], dtype_of: Any) -> None:
        """Convert parameters in place, keeping each Parameter object (the optimizer holds
        them): `swap_tensors`, as `nn.Module._apply` does for DTensors; then FSDP2 re-reads
        its sharded data (what `FSDPModule._apply` does after `model.to(dtype)`)."""
        with torch.no_grad():
            for p in params:
                p.grad = None
                torch.utils.swap_tensors(p, nn.Parameter(p.to(dtype_of(p)), requires_grad=p.requires_grad))
            for fp in self.params:
                fp.reset_sharded_param()


def _param_groups(state: Any) -> list[Any]:
    if hasattr(state, "_fsdp_param_groups"):  # newer torch: one group per mesh; older: one
        return list(state._fsdp_param_groups)
    group = state._fsdp_param_group
    return [group] if group is not None else []


# what ampatch reads or sets on FSDP2's state, parameter group and parameter objects
_INTERNALS = {"state": ("_mp_policy",),
              "group": ("mp_policy", "reduce_grads", "_init_mp_dtypes", "fsdp_params"),
              "param": ("sharded_param", "all_gather_outputs", "reset_sharded_param", "_module_info")}


def _probe(states: Sequence[Any], groups: Sequence[Any], params: Sequence[Any]) -> None:
    """AttributeError now if one of `_INTERNALS` is missing, before anything was changed."""
    for kind, objects in (("state", states), ("group", groups), ("param", params)):
        for obj in objects:
            for name in _INTERNALS[kind]:
                getattr(obj, name)
    for fp in params:
        info = fp._module_info
        _ = info.module, info.param_name, info.shared_modules, info.shared_param_names
        if "sharded_param" not in vars(fp):  # ParamGuard watches it in the instance dict
            raise AttributeError("FSDPParam.sharded_param is no longer an instance attribute")


class ShardedModel:
    """One FSDP2-sharded model at O2/O3/O5: the level set on its units, undone by `restore`."""

    def __init__(self, units: _Units, props: Properties, patcher: Any, kept: Collection[int] = frozenset()) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy  # imported already: the model is sharded
        self.units = units
        model = units.model
        half, keep_bn = props.cast_model_type, props.keep_batchnorm_fp32
        masters = props.casts_model and props.master_mode is MasterMode.FP32
        fp32_units = self._check(keep_bn, masters, kept)  # everything checked before anything changes
        self._policies = units.policies()
        self._cast: list[tuple[nn.Parameter, torch.dtype]] = []
        self._buffers: list[tuple[nn.Module, str, torch.dtype]] = []
        self._hook: Any = None
        custom = [p for _, p in self._policies if p != MixedPrecisionPolicy()]
        if custom:
            logger.warning("ampatch: %s sets FSDP2's mixed precision of the sharded model; the policy given to "
                           "fully_shard (%s) is replaced until amp.deinitialize().", props.opt_level, custom[0])
        try:
            units.reshard()
            for state, _ in self._policies:
                units.set_policy(state, MixedPrecisionPolicy(
                    param_dtype=None if id(state) in fp32_units else half,
                    reduce_dtype=torch.float32 if masters else None, output_dtype=None, cast_forward_inputs=True))
            if not masters:  # O3: the sharded parameters themselves go to half
                self._cast = [(p, p.dtype) for p in params_to_cast(model, keep_bn, kept) if p.dtype != half]
                units.swap_dtype([p for p, _ in self._cast], lambda p: half)
            units.refresh_dtypes()
            for m in modules_to_cast(model, keep_bn, kept):
                for name, b in m._buffers.items():
                    if b is not None and b.is_floating_point() and b.dtype != half:
                        self._buffers.append((m, name, b.dtype))
                        m._buffers[name] = b.to(half)
            self._hook = model._register_state_dict_hook(_fp32_state_dict)
        except BaseException:
            self.restore()
            raise
        if id(model) not in kept:  # a model kept whole: its keep_fp32 wrapper stands in
            wrap_outputs(model, props.cast_model_outputs, patcher, input_dtype=half)

    def _check(self, keep_bn: bool | None, masters: bool, kept: Collection[int]) -> set[int]:
        """Raise what cannot be honoured; returns the ids of units that stay FP32 (batch norms
        with `keep_bn`, modules `keep_fp32` keeps: `kept`)."""
        units, fp32_units = self.units, set()
        for state in units.states:
            modules = [m for g in _param_groups(state) for m in units.group_modules(g)]
            fp32 = [id(m) in kept or bool(keep_bn and is_batchnorm(m)) for m in modules]
            if modules and all(fp32):
                fp32_units.add(id(state))
            elif any(id(m) in kept for m in modules):
                name = next(n for n, m in units.model.named_modules() if id(m) in kept and m in modules)
                raise ValueError(f"keep_fp32 cannot be honoured under FSDP2: {name!r} is kept in FP32 but shares a "
                                 "fully_shard unit with layers that run in half, and FSDP2 all-gathers one dtype per "
                                 "unit. Call fully_shard on the kept module before its parent (it then stays FP32).")
            elif any(fp32):
                bn = next(m for m, f in zip(modules, fp32) if f)
                raise ValueError(
                    f"keep_batchnorm_fp32=True cannot be honoured under FSDP2: the batch norm {type(bn).__name__} "
                    "shares a fully_shard unit with other layers, and FSDP2 all-gathers one dtype per unit. Call "
                    "fully_shard on each batch norm before its parent (it then stays FP32), or pass "
                    "keep_batchnorm_fp32=False.")
        if masters:
            managed = units.managed_slots()
            loose = [f"{prefix}{'.' if prefix else ''}{n}" for prefix, m in units.model.named_modules()
                     for n, p in m._parameters.items()
                     if p is not None and p.is_floating_point() and (id(m), n) not in managed]
            if loose:
                raise ValueError(f"{len(loose)} parameters of the sharded model ({', '.join(loose[:3])}...) belong "
                                 "to no fully_shard unit; O2/O5 under FSDP2 run through FSDP2's mixed precision, so "
                                 "every parameter needs one: call fully_shard(model) on the root module too, after "
                                 "its blocks.")
        return fp32_units

    def restore(self, masters: dict[int, torch.Tensor] | None = None) -> None:
        """Back to the units' own policies and the original dtypes (O3: from the half values)."""
        if self._hook is not None:
            self._hook.remove()
        units = self.units
        units.reshard()
        for state, policy in self._policies:
            units.set_policy(state, policy)
        if self._cast:
            dtypes = {id(p): dtype for p, dtype in self._cast}
            units.swap_dtype([p for p, _ in self._cast], lambda p: dtypes[id(p)])
        units.refresh_dtypes()
        for m, name, dtype in self._buffers:
            b = m._buffers.get(name)
            if b is not None:
                m._buffers[name] = b.to(dtype)


def _fp32_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> dict:
    """Half tensors of a sharded O2/O3/O5 model's state dict to FP32 (DTensors stay DTensors).
    `state_dict(keep_vars=True)` asks for the live tensors: those are left as they are."""
    live = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
    for k, v in state_dict.items():
        if k.startswith(prefix) and isinstance(v, torch.Tensor) and v.dtype in LOW and id(v) not in live:
            state_dict[k] = v.detach().float()
    return state_dict


class ShardedOptimizerHandle(OptimizerHandle):
    """An optimizer over FSDP2-sharded parameters.

    At O2/O5 its parameters, the sharded FP32 ones, are the masters (`use_masters`: every
    unscale is checked, even at a static scale of 1.0), and no separate copies exist:
    nothing to copy after a step, no extra entry in `state_dict()`. A backward under
    `set_requires_gradient_sync(False)` keeps its grads scaled (see the module docstring).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, index: int, masters: bool, units: Sequence[_Units],
                 context: HandleContext = HandleContext()) -> None:
        super().__init__(optimizer, index, None, context)
        self.use_masters = masters
        self.units = list(units)

    def syncs_off(self) -> bool:
        return any(u.syncs_off() for u in self.units)

    def after_backward(self, scale: float, found_inf: torch.Tensor | None, delay_unscale: bool) -> torch.Tensor | None:
        return super().after_backward(scale, found_inf, delay_unscale or self.syncs_off())

    def _step(self, inner: Any, closure: Any = None, *args: Any, **kwargs: Any) -> Any:
        if self.stage is OptState.SCALED and self.syncs_off():
            raise RuntimeError("optimizer.step() after a backward with FSDP2 gradient sync off: the gradients are "
                               "still inside FSDP, unreduced. Call model.set_requires_gradient_sync(True) before the "
                               "last micro-batch's backward.")
        return super()._step(inner, closure, *args, **kwargs)

    def _state_dict(self, inner: Any) -> dict:
        return inner()  # the masters are the sharded params: in the model's state dict already

    def _load_state_dict(self, inner: Any, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        if state_dict.pop(MASTERS_KEY, None) is not None:
            logger.info("ampatch: the optimizer checkpoint carries FP32 masters from an unsharded run; under FSDP2 "
                        "the masters are the sharded params, loaded with the model's state dict.")
        inner(state_dict)


def _check_order(models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """An optimizer built before fully_shard holds the replaced (unsharded) tensors."""
    dtensor = _dtensor_class()
    if dtensor is None or not optimizers:
        return
    model_params = {id(p): name for m in models for name, p in m.named_parameters()}
    held = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    orphans = [p for opt in optimizers for g in opt.param_groups for p in g["params"]
               if id(p) not in model_params and not isinstance(p, dtensor)]
    unheld = [name for m in models for name, p in m.named_parameters()
              if isinstance(p, dtensor) and p.requires_grad and id(p) not in held]
    if orphans and unheld:
        raise RuntimeError(f"amp.initialize: the optimizer holds {len(orphans)} tensors that are not the sharded "
                           f"model's parameters, and the model's sharded parameters ({', '.join(unheld[:3])}...) are "
                           f"in no optimizer: it was built before fully_shard. The order under FSDP2: {ORDER}.")


def setup(props: Properties, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
          patcher: Any, context: HandleContext = HandleContext(), kept: Collection[int] = frozenset(),
          ) -> tuple[list[ShardedModel], list[ShardedOptimizerHandle]]:
    """The level on FSDP2-sharded models (see the module docstring), beside `plain.setup` for
    unsharded ones: returns the models' and the optimizers' handles (no model handles at
    O0/O1/O4, where the models are left alone; their outputs are `plain.wrap_model_outputs`'
    job). `kept`: the ids of the modules `keep_fp32` keeps and of those inside them."""
    if props.master_mode.low_memory:
        raise ValueError(f"master_weights={props.master_mode.value!r} is not supported on FSDP2-sharded models "
                         "(fully_shard): use master_weights=True (O5: FSDP2 keeps sharded FP32 masters, their memory "
                         "divided by the number of ranks), or replicate with DistributedDataParallel instead of "
                         "fully_shard to keep the low-memory mode.")
    units = [_Units(m) for m in models]  # FSDP2's internals read (and probed) once per model
    if props.casts_model and not all(u.modules for u in units):
        raise ValueError(f"{props.opt_level} with several models needs all of them sharded with fully_shard or none "
                         "of them.")
    _check_order(models, optimizers)
    masters = props.master_mode is MasterMode.FP32
    handles = [ShardedOptimizerHandle(opt, i, masters, units, context) for i, opt in enumerate(optimizers)]
    sharded: list[ShardedModel] = []
    if props.casts_model:
        try:
            for u in units:
                sharded.append(ShardedModel(u, props, patcher, kept))
        except BaseException:  # the units set up so far go back (a failing one restored itself)
            for m in sharded:
                m.restore()
            raise
        for h in handles:
            h.recast_state()
    return sharded, handles
