"""The session's build step: the user's models and optimizers checked (`prepare`), then the
level built on them, plain or FSDP2-sharded, by one verb (`build`), watched (`ParamGuard`)
and taken back (`undo`).

`prepare` changes nothing: a call it rejects leaves the previous session, the models and
the "ampatch" logger as they were. `build` makes the optimizers' handles (their masters from
the FP32 weights, before any cast), then casts the models; a failure half-way takes back
what was built before it raises.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..base.notices import warn
from ..base.patcher import Patcher
from ..config import env, levels, policy_file
from ..config.env import Overrides
from ..config.options import Options, Properties, resolve, warn_or_err
from ..config.settings import SETTINGS
from ..config.values import DEFAULT_MAX_LOSS_SCALE, DYNAMIC, INITIAL_LOSS_SCALE, MasterMode, StatePrecision
from ..machine import hardware
from ..model import fp8, sharded
from ..model.cast import ModelHandle, params_to_cast
from ..model.forwards import keep_in_fp32, wrap_outputs
from ..model.keep import Kept, kept_module_ids
from ..model.weight_table import DataWatch
from ..model.weights import Weight
from ..optim.context import HandleContext
from ..optim.handle import OptimizerHandle
from ..optim.masters import check_one_master_each, master_ids
from ..optim.sharded import ShardedOptimizerHandle
from ..optim.states import check_keepable

logger = logging.getLogger("ampatch")

__all__ = ["Prepared", "prepare", "build", "undo", "keep_forwards", "wrap_model_outputs", "as_list", "check_incoming_dtypes",
           "takes_policy", "outside", "ParamGuard", "check_not_accelerated", "check_fp8"]


def takes_policy(initialize: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate `initialize` so that `policy=` (a policy file `ampatch tune` wrote, or its
    dict) sets the keywords the call does not give; a keyword given explicitly beats the
    policy's field, with a warning when they disagree (`policy_file.apply_in_code`)."""
    signature = inspect.signature(initialize)

    @functools.wraps(initialize)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("policy") is None:
            return initialize(*args, **kwargs)
        given = dict(signature.bind(*args, **kwargs).arguments)
        policy = policy_file.load(given.pop("policy"))
        _warn_measured_elsewhere(policy, given.get("verbosity", 1))
        return initialize(**policy_file.apply_in_code(given, policy, set(given) - {"models", "optimizers"}))
    return wrapper


def outside(verbosity: int = 1) -> Overrides:
    """What the environment asks of this `initialize`, read once, with the policy file
    ``AMPATCH_POLICY`` names merged in (`policy_file.from_outside`)."""
    overrides = env.read()
    if overrides.policy is None:
        return overrides
    _warn_measured_elsewhere(policy_file.load(overrides.policy), verbosity)
    return policy_file.from_outside(overrides)


def _warn_measured_elsewhere(policy: policy_file.Policy, verbosity: int) -> None:
    why = hardware.policy_warning(policy.measured, levels.half_name(policy.opt_level, policy.half_dtype))
    if why:
        warn(f"ampatch: {why}", verbosity if isinstance(verbosity, int) else 1)


@dataclass(frozen=True)
class Prepared:
    """A checked `initialize` call: what the session is made from, and how to hand back."""

    options: Options
    properties: Properties
    overrides: Overrides
    models: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    single_model: bool
    single_optimizer: bool
    no_optimizers: bool
    notes: list[str] = field(default_factory=list)

    def announce(self) -> None:
        """Log what the checks found (forced overrides, unused loss-scale bounds); called once
        the logger follows the new session's verbosity."""
        for note in self.notes:
            logger.warning(note)
        o, scale = self.options, self.properties.loss_scale
        if scale != DYNAMIC:
            if o.min_loss_scale is not None or o.max_loss_scale != DEFAULT_MAX_LOSS_SCALE:
                logger.info("ampatch: min_loss_scale/max_loss_scale bound a dynamic loss scale; this session's is "
                            "static (%g), so they do not apply.", scale)
        elif o.min_loss_scale is not None and o.min_loss_scale > INITIAL_LOSS_SCALE:
            warn(f"ampatch: min_loss_scale={o.min_loss_scale:g} is above the initial dynamic loss scale "
                 f"{INITIAL_LOSS_SCALE:g}: the scale starts at min_loss_scale.", o.verbosity)

    def returned(self) -> Any:
        """The models and optimizers in the shape `initialize` got them (only the models when
        it got no optimizers)."""
        models = self.models[0] if self.single_model else self.models
        if self.no_optimizers:
            return models
        return models, (self.optimizers[0] if self.single_optimizer else self.optimizers)


def prepare(options: Options, models: Any, optimizers: Any, overrides: Overrides) -> Prepared:
    """Everything about an `initialize` call that can be checked before it changes anything:
    the models and optimizers (each once, none wrapped or accelerated yet) and the options
    as a whole."""
    model_list, single_model = as_list(models, "models", nn.Module)
    opt_list, single_opt = ([], True) if optimizers is None else as_list(optimizers, "optimizers",
                                                                          torch.optim.Optimizer)
    check_not_accelerated(model_list, opt_list)
    sharded.check_dtensors_sharded(model_list)
    props, notes = resolve(options, hardware.model_device(model_list), overrides)
    if props.fp8 is not None:
        check_fp8(props, opt_list)
    for o in opt_list:
        check_keepable(o, props.optimizer_states)
    if props.optimizer_states.stored and sharded.is_sharded(model_list):
        why = (f"optimizer_states={props.optimizer_states.value!r} is not supported on FSDP2-sharded models yet (the "
               "kept state would have to be sharded like each parameter)")
        if overrides.optimizer_states is None:
            raise ValueError(f"{why}; use optimizer_states='float32' with fully_shard, or master_weights='stochastic' "
                             "for memory.")
        notes.append(f"ampatch: dropping {overrides.quote('optimizer_states')}: {why}; the optimizer keeps its FP32 "
                     "state.")  # from outside (a variable, a policy: tune's candidates), as a level it cannot apply to
        props = dataclasses.replace(props, optimizer_states=StatePrecision.FLOAT32)
    return Prepared(options, props, overrides, model_list, opt_list, single_model, single_opt, optimizers is None,
                    notes)


def check_fp8(props: Properties, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """What `fp8=` needs before anything changes: torchao that fits (ImportError naming the
    extra), and an optimizer that tolerates it."""
    fp8.require()
    for o in optimizers:
        if isinstance(o, torch.optim.LBFGS):
            raise ValueError("fp8 with torch.optim.LBFGS: its line search and curvature pairs compare the losses and "
                             "gradients of re-evaluated closures, which FP8's dynamic scaling perturbs by a few "
                             "percent each time. Use a first-order optimizer (SGD, AdamW, ...) with fp8, or leave "
                             "fp8 off with LBFGS.")


def as_list(x: Any, what: str, kind: type) -> tuple[list, bool]:
    """`x` (one object or a list/tuple of them) as a list, and whether it was one object;
    each item checked to be a `kind`, given once, and (models) not wrapped yet."""
    items, single = (list(x), False) if isinstance(x, (list, tuple)) else ([x], True)
    for i, item in enumerate(items):
        first = next(j for j, other in enumerate(items) if other is item)
        if first != i:
            raise ValueError(f"amp.initialize got the same {what[:-1]} twice: {what}[{i}] is {what}[{first}] "
                             f"({type(item).__name__}); pass each of the {what} once.")
        if what == "models" and isinstance(item, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            raise RuntimeError(f"amp.initialize got a model already wrapped in {type(item).__name__}; call "
                               "amp.initialize on the bare model first, then wrap the model it returns.")
        if not isinstance(item, kind):
            raise TypeError(f"amp.initialize expects {what} to be {kind.__name__} objects (or a list of them), "
                            f"got {type(item).__name__}.")
    return items, single


def check_not_accelerated(models: Sequence[nn.Module], optimizers: Sequence[Any]) -> None:
    """Refuse what Hugging Face Accelerate's `prepare` made, where it would fight ampatch:
    a model whose forward Accelerate wrapped in autocast (`Accelerator(mixed_precision=
    "fp16"/"bf16")`: two AMPs at once), or an `AcceleratedOptimizer` (its step and
    zero_grad belong to Accelerate's wrapper, and under DDP the model inside was wrapped
    with its FP32 params). Recognized by what Accelerate leaves behind, without importing it.
    """
    for model in models:
        if "_original_forward" in vars(model):
            raise ValueError(
                f"amp.initialize got a {type(model).__name__} whose forward Hugging Face Accelerate wrapped in "
                "autocast (Accelerator(mixed_precision='fp16'/'bf16')): two mixed-precision schemes at once. "
                "Use Accelerator(mixed_precision='no') and call amp.initialize on the model and optimizer "
                "before accelerator.prepare(...).")
    for optimizer in optimizers:
        if type(optimizer).__name__ == "AcceleratedOptimizer" and type(optimizer).__module__.startswith("accelerate"):
            raise ValueError(
                "amp.initialize got an AcceleratedOptimizer (the result of accelerator.prepare): call "
                "amp.initialize on the bare model and optimizer first, then accelerator.prepare(...) on what it "
                "returns, with Accelerator(mixed_precision='no'); pass the initialized optimizer to scale_loss.")


def check_incoming_dtypes(models: Sequence[nn.Module]) -> None:
    """Apex's refusal of float16 models (`warn_or_err` at the first float16 tensor):
    `initialize` takes the FP32 model and does the casting itself. Checked once the previous
    session let go of the models (it may have cast them); Apex's
    `_amp_state.allow_incoming_model_not_fp32 = True` lets them in."""
    if SETTINGS.allow_incoming_model_not_fp32:
        return
    for model in models:
        tensors = [("param", n, t) for n, t in model.named_parameters()]
        tensors += [("buffer", n, t) for n, t in model.named_buffers()]
        for kind, name, t in tensors:
            if t.dtype == torch.float16:
                warn_or_err(f"Found {kind} {name} of dtype {t.dtype}; amp.initialize expects an FP32 model and "
                            "does any casting itself: do not call .half() on the model before passing it. To "
                            "pass float16 parameters on purpose, set amp._amp_state.allow_incoming_model_not_fp32 "
                            "= True before amp.initialize.", SETTINGS.hard_override)
                return


def build(props: Properties, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
          patcher: Patcher, context: HandleContext = HandleContext(), kept: Collection[int] = frozenset(),
          first_index: int = 0) -> tuple[list[Any], list[OptimizerHandle]]:
    """The level on `models` and `optimizers`: returns the models' handles (`ModelHandle`, or
    `sharded.ShardedModel` for FSDP2-sharded models; none where the models are not cast) and
    the optimizers' handles. `kept`: the ids of the modules kept in FP32 and of those inside
    them; `first_index`: the first optimizer's index in its session."""
    if sharded.is_sharded(models):
        return _build_sharded(props, models, optimizers, patcher, context, kept)
    keep_bn = props.keep_batchnorm_fp32
    cast_ids = {id(p) for m in models for p in params_to_cast(m, keep_bn, kept)} if props.casts_model else set()
    mode = props.master_mode
    has_masters = mode is MasterMode.FP32 or mode.low_memory
    ids = [master_ids(opt, cast_ids) if has_masters else None for opt in optimizers]
    if has_masters:
        check_one_master_each(optimizers, set().union(*ids) if ids else set())
    handles: list[OptimizerHandle] = []
    model_handles: list[ModelHandle] = []
    try:
        for i, opt in enumerate(optimizers):  # masters from the FP32 weights, before the cast
            handles.append(OptimizerHandle(opt, first_index + i, ids[i], context, mode, props.optimizer_states))
        if props.casts_model:
            def trained(p: torch.Tensor) -> Any:
                return next((k for h in handles if (k := h.masters.keeps(p)) is not None), None)
            watch = DataWatch()
            watch.install(patcher)
            seen: dict[int, torch.dtype] = {}  # params cast so far, over all the models
            tied: dict[int, Weight] = {}  # their records
            for m in models:
                # the low-memory modes keep no FP32 values of the cast params (like O3): frozen ones included
                model_handles.append(ModelHandle(m, props.cast_model_type, keep_bn, props.cast_model_outputs, patcher,
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
        raise ValueError(f"{props.opt_level} with several models needs all of them sharded with fully_shard or none "
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
            handles.append(ShardedOptimizerHandle(opt, i, masters, syncs_off, context, mode, cast_ids))
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
            for m in models_built:
                m.on_load(lambda incoming, params: [h.resync_from_model(incoming, params) for h in handles])
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


class ParamGuard:
    """Watches the model-side parameters the optimizers step; `check(handle)`, at each
    `handle.step()`, raises when one that this optimizer steps left the model after `initialize`.

    Fast path: one identity comparison per registration of the optimizer's parameters (a
    module's `_parameters` slot; for an FSDP2-sharded parameter, FSDP2's record of it, so
    FSDP's switching between sharded and unsharded parameters in forward and backward is no
    change). When one changed, the models are searched again: a parameter that only moved (a
    parametrization registered after initialize) is watched where it is now; one that is gone
    was replaced, and this and every later check of its optimizer raise.
    """

    def __init__(self, models: Sequence[nn.Module], handles: Sequence[OptimizerHandle]) -> None:
        self.models = list(models)
        # FSDP2's parameter records of the models that were sharded at initialize
        self._units = {id(m): sharded.Units(m) for m in self.models if sharded.is_sharded([m])}
        self._held = {id(h): h.model_params() for h in handles}
        where = self._registrations()
        self._watch = {hid: self._watched(hid, where) for hid in self._held}

    def check(self, handle: OptimizerHandle) -> None:
        # .get: an optimizer brought in after initialize (amp.init's wrap_optimizer) is not watched
        for slots, key, p, _ in self._watch.get(id(handle), ()):
            if slots.get(key) is not p:
                return self._search(id(handle))
        return None

    def _registrations(self) -> dict[int, list[tuple[dict, str, torch.Tensor, str]]]:
        """id(held tensor) -> where the models hold it: (dict, key, tensor, qualified name),
        `dict[key] is tensor` while it is there."""
        held = {id(t) for ts in self._held.values() for t in ts}
        where: dict[int, list[tuple[dict, str, torch.Tensor, str]]] = {}
        for model in self.models:
            named = list(model.named_modules())
            units = self._units.get(id(model))
            managed = units.managed_slots() if units else set()
            if units:
                prefixes = {id(m): prefix for prefix, m in named}
                for fp in units.params:
                    p = fp.sharded_param
                    if id(p) in held:
                        m, n = units.slots(fp)[0]
                        where.setdefault(id(p), []).append(
                            (vars(fp), "sharded_param", p, _qualified(prefixes.get(id(m), "?"), n)))
            for prefix, m in named:
                for n, p in m._parameters.items():
                    if p is not None and id(p) in held and (id(m), n) not in managed:
                        where.setdefault(id(p), []).append((m._parameters, n, p, _qualified(prefix, n)))
        return where

    def _watched(self, hid: int, where: dict[int, list]) -> list[tuple[dict, str, torch.Tensor, str]]:
        return [r for t in self._held[hid] for r in where.get(id(t), ())]

    def _search(self, hid: int) -> None:
        where = self._registrations()
        gone = [name for *_, p, name in self._watch[hid] if id(p) not in where]
        if gone:  # the watch stays as it was: the next check finds the change again
            raise RuntimeError(
                f"ampatch: the model's parameter {gone[0]!r} was replaced after amp.initialize (by fully_shard, "
                "FSDP, load_state_dict(assign=True) or another wrapper that swaps parameters), so the optimizer "
                f"steps a tensor the model no longer uses and training would silently do nothing. Under FSDP2: "
                f"{sharded.ORDER}. Otherwise call amp.initialize after the wrapper, or wrap with one that keeps the "
                "parameters (DistributedDataParallel) after initialize.")
        self._watch[hid] = self._watched(hid, where)


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
