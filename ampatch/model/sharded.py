"""FSDP2-sharded models (`fully_shard`) at O2/O3/O5, beside `cast.ModelHandle` for plain ones.

O2/O5 become FSDP2's own mixed precision on every unit (the sharded FP32 parameters are the
masters; half copies are all-gathered for forward and backward, gradients reduced in FP32);
O3 turns the sharded parameters themselves half, as do master_weights "stochastic"/"kahan"
(their gradients computed, reduced and kept in bfloat16). `ShardedModel.restore` puts back
each unit's own policy and dtypes. FSDP2 has no public API to change a unit's policy or
parameter dtype after `fully_shard`: the internals used for it are confined to `Units`
(torch 2.6+). The whole story, with the order of calls it supports: docs/fsdp.md.
"""
from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn

from ..base.dtypes import LOW
from ..config.options import Properties
from ..config.values import MasterMode
from ..errors import ConfigError, InternalError, OrderError, PlatformError
from .cast import LoadHook, dtensor_class, fsdp_units, is_batchnorm, modules_to_cast, params_to_cast
from .forwards import wrap_outputs

logger = logging.getLogger("ampatch")

ORDER = ("shard the model first (fully_shard on its blocks, then on the model), then build the optimizer "
         "from the sharded model's parameters, then call `model, optimizer = amp.initialize(model, optimizer, "
         "...)`")


class Units:
    """The FSDP2 states (one per `fully_shard` call) of a model, and every access to FSDP2
    internals that ampatch needs: parameter groups, per-parameter state, policies."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modules = fsdp_units(model)
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
            raise PlatformError(f"ampatch: the FSDP2 internals of this torch ({torch.__version__}) differ from those "
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

    def swap_dtype(self, params: Sequence[nn.Parameter], dtype_of: Any, values: Any = None) -> None:
        """Convert parameters in place, keeping each Parameter object (the optimizer holds
        them): `swap_tensors`, as `nn.Module._apply` does for DTensors; then FSDP2 re-reads
        its sharded data (what `FSDPModule._apply` does after `model.to(dtype)`). `values`:
        by param id, what a param takes instead of its own values converted (placed like it)."""
        values = values or {}
        with torch.no_grad():
            for p in params:
                p.grad = None
                value = values.get(id(p))
                new = value.to(dtype_of(p)) if value is not None else p.to(dtype_of(p))
                torch.utils.swap_tensors(p, nn.Parameter(new, requires_grad=p.requires_grad))
            for fp in self.params:
                fp.reset_sharded_param()

    def check_all_gather_extensions(self) -> None:
        """RuntimeError unless this torch's FSDP2 takes all-gather extensions on existing
        parameters (`fsdp_pre_all_gather` on a sharded local tensor: torchao's FP8 all-gather)."""
        needed = ("_init_extensions", "_sharded_param_data", "padded_sharded_param_size", "fsdp_placement")
        if not all(hasattr(fp, name) for fp in self.params for name in needed):
            raise PlatformError(f"ampatch: FP8 all-gather under FSDP2 needs FSDP2's all-gather extensions, which torch "
                                f"{torch.__version__} lacks: upgrade torch (2.11+), or pass a torchao "
                                "Float8LinearConfig(enable_fsdp_float8_all_gather=False) as fp8= to all-gather in "
                                "bfloat16 and compute in FP8.")

    def replace_local(self, param: nn.Parameter, make: Any) -> None:
        """Give a sharded parameter new local data, `make(padded shard)` (an all-gather
        extension's wrapper of it, or the plain tensor back), keeping the Parameter object
        (the optimizer's): FSDP2's flat shard and the parameter's local view both follow, as
        when `fully_shard` meets a wrapped parameter. `refresh_params` afterwards."""
        fp = next(fp for fp in self.params if fp.sharded_param is param)
        dim = fp.fsdp_placement.dim
        dtensor = dtensor_class()
        if dtensor is None or not isinstance(param, dtensor):
            raise InternalError("ampatch: internal error: replace_local takes a sharded (DTensor) parameter.")
        new = make(fp._sharded_param_data.view(fp.padded_sharded_param_size))
        length = param._local_tensor.size(dim)
        fp._sharded_param_data = new.view(-1)
        param._local_tensor = new.narrow(dim, 0, length)

    def refresh_params(self) -> None:
        """After `replace_local`: FSDP2 allocates its all-gather buffers anew and re-reads
        which parameters carry all-gather extensions, as its lazy init does."""
        self.refresh_dtypes()
        for fp in self.params:
            fp._init_extensions()


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

    def __init__(self, units: Units, props: Properties, patcher: Any, kept: Collection[int] = frozenset()) -> None:
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
        self._load_hooks: list[Any] = []
        self._on_load: list[Any] = []
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
                raise ConfigError(f"keep_fp32 cannot be honoured under FSDP2: {name!r} is kept in FP32 but shares a "
                                  "fully_shard unit with layers that run in half, and FSDP2 all-gathers one dtype per "
                                  "unit. Call fully_shard on the kept module before its parent (it then stays FP32).")
            elif any(fp32):
                bn = next(m for m, f in zip(modules, fp32) if f)
                raise ConfigError(
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
                raise ConfigError(f"{len(loose)} parameters of the sharded model ({', '.join(loose[:3])}...) belong "
                                  "to no fully_shard unit; O2/O5 under FSDP2 run through FSDP2's mixed precision, so "
                                  "every parameter needs one: call fully_shard(model) on the root module too, after "
                                  "its blocks.")
        return fp32_units

    def on_load(self, callback: Any) -> None:
        """Run `callback(incoming, params)` after a `load_state_dict` of the model or one of its
        modules, once per module with cast params: `params` its own cast params, `incoming`
        by param id the tensor torch loaded into it (a kahan compensation takes what the
        loaded values have beyond bfloat16)."""
        if not self._on_load:
            cast = {id(p) for p, _ in self._cast}
            for m in self.units.model.modules():
                own = [n for n, p in m._parameters.items() if p is not None and id(p) in cast]
                if own:
                    hook = LoadHook(_LoadReport(self._on_load, cast), own)
                    self._load_hooks += [m._register_load_state_dict_pre_hook(hook.pre, with_module=True),
                                         m.register_load_state_dict_post_hook(hook)]
        self._on_load.append(callback)



    def restore(self, masters: Any = None) -> None:
        """Back to the units' own policies and the original dtypes (O3: from the half values;
        `masters`, by param id, the FP32 values a param takes instead: kahan's weight +
        compensation)."""
        if self._hook is not None:
            self._hook.remove()
        for h in self._load_hooks:
            h.remove()
        units = self.units
        units.reshard()
        for state, policy in self._policies:
            units.set_policy(state, policy)
        if self._cast:
            dtypes = {id(p): dtype for p, dtype in self._cast}
            units.swap_dtype([p for p, _ in self._cast], lambda p: dtypes[id(p)], masters)
        units.refresh_dtypes()
        for m, name, dtype in self._buffers:
            b = m._buffers.get(name)
            if b is not None:
                m._buffers[name] = b.to(dtype)


class _LoadReport:
    """What a sharded module's `LoadHook` reports to: the callbacks, by param id. A copy of the
    model (deepcopy, pickle) has no session to report to: it gets an inert one."""

    def __init__(self, callbacks: list[Any], cast: set[int]) -> None:
        self.callbacks, self.cast = callbacks, cast

    def __call__(self, module: nn.Module, loaded: dict[str, torch.Tensor]) -> None:
        params = [p for p in module._parameters.values() if p is not None and id(p) in self.cast]
        incoming = {id(module._parameters[n]): src for n, src in loaded.items() if n in module._parameters}
        for cb in self.callbacks:
            cb(incoming, params)

    def __reduce__(self) -> tuple:
        return (_LoadReport, ([], set()))


def _fp32_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> dict:
    """Half tensors of a sharded O2/O3/O5 model's state dict to FP32 (DTensors stay DTensors).
    `state_dict(keep_vars=True)` asks for the live tensors: those are left as they are."""
    live = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
    for k, v in state_dict.items():
        if k.startswith(prefix) and isinstance(v, torch.Tensor) and v.dtype in LOW and id(v) not in live:
            state_dict[k] = v.detach().float()
    return state_dict


def check_order(models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """An optimizer built before fully_shard holds the replaced (unsharded) tensors."""
    dtensor = dtensor_class()
    if dtensor is None or not optimizers:
        return
    model_params = {id(p): name for m in models for name, p in m.named_parameters()}
    held = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    orphans = [p for opt in optimizers for g in opt.param_groups for p in g["params"]
               if id(p) not in model_params and not isinstance(p, dtensor)]
    unheld = [name for m in models for name, p in m.named_parameters()
              if isinstance(p, dtensor) and p.requires_grad and id(p) not in held]
    if orphans and unheld:
        raise OrderError(f"amp.initialize: the optimizer holds {len(orphans)} tensors that are not the sharded "
                         f"model's parameters, and the model's sharded parameters ({', '.join(unheld[:3])}...) are "
                         f"in no optimizer: it was built before fully_shard. The order under FSDP2: {ORDER}.")
