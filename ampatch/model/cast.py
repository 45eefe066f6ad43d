"""Model casting for O2/O3/O5: convert the model to half (batch norms, and the modules
`keep_fp32` names, optionally kept in FP32), wrap `forward` (see forwards.py) so inputs arrive
in half and outputs leave in FP32, and give each converted tensor a record (`weights.Weight`)
that owns both its copies: `state_dict()` aliases the exact copy where one is kept (a
master, a frozen param's or buffer's FP32 value) and the half tensor where it is the only
one; `load_state_dict` hands every loaded tensor to its record.

Everything done to a model is recorded in a `ModelHandle`, so `restore()` can put the
model back to its original dtypes (from the exact copies where they exist).

Which of the two casts a model gets is decided here too: `is_sharded` (FSDP2's `fully_shard`
units, cast by `sharded.ShardedModel` instead), with `check_dtensors_sharded` refusing
DTensor parameters outside every unit. FSDP2 is never imported for it: a model can only be
sharded if torch.distributed's modules were.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import ConfigError, OrderError
from .forwards import HalfForward, install_forward
from .weight_table import DataWatch, Weights
from .weights import Keeps, Weight, keep_exact

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

logger = logging.getLogger("ampatch")

# What other libraries' models need once cast (other entry points, save hooks), registered from
# above (`ampatch.frameworks`): each runs as convention(model, patcher, cast_entry, original_dtype),
# `cast_entry(method)` casting a method's inputs like forward's.
Convention = Callable[[nn.Module, Any, Callable[[Callable[..., Any]], Any], torch.dtype | None], None]
CONVENTIONS: list[Convention] = []


def add_convention(convention: Convention) -> None:
    """Run `convention` on every model a `ModelHandle` casts (see `CONVENTIONS`)."""
    if convention not in CONVENTIONS:
        CONVENTIONS.append(convention)


def fsdp_module_class() -> type[FSDPModule] | None:
    """`FSDPModule`, if FSDP2 was imported (a model can only be sharded if it was): no import cost otherwise."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None)


def dtensor_class() -> type[DTensor] | None:
    tensor = sys.modules.get("torch.distributed.tensor")
    return getattr(tensor, "DTensor", None)


def fsdp_units(model: nn.Module) -> list[FSDPModule]:
    """The modules of `model` that `fully_shard` was applied to, as FSDP2 types them."""
    cls = fsdp_module_class()
    return [] if cls is None else [m for m in model.modules() if isinstance(m, cls)]


def sharded_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that `fully_shard` was applied to."""
    return [m for m in fsdp_units(model) if isinstance(m, nn.Module)]


def is_sharded(models: Iterable[nn.Module]) -> bool:
    """Whether any of `models` has FSDP2-sharded modules."""
    return any(sharded_modules(m) for m in models)


def check_dtensors_sharded(models: Sequence[nn.Module]) -> None:
    """DTensor parameters outside every `fully_shard` unit (tensor parallelism with
    `parallelize_module`, a DTensor made by hand) are refused: ampatch applies its levels to
    FSDP2's units, and a cast or master of such a parameter would be made blind to its
    placement."""
    dtensor = dtensor_class()
    if dtensor is None:
        return
    for model in models:
        covered = {id(sub) for unit in sharded_modules(model) for sub in unit.modules()}
        for name, module in model.named_modules():
            for pname, p in module._parameters.items():
                if isinstance(p, dtensor) and id(module) not in covered:
                    full = f"{name}.{pname}" if name else pname
                    raise ConfigError(f"amp.initialize: parameter {full!r} is a DTensor outside every fully_shard unit "
                                      "(tensor parallelism, e.g. parallelize_module): ampatch applies its levels to "
                                      "FSDP2's fully_shard units only. Shard with fully_shard alone (Lightning: "
                                      "ModelParallelStrategy(tensor_parallel_size=1)), or train without ampatch's "
                                      "casting on those layers.")


def is_batchnorm(module: nn.Module) -> bool:
    """A batch norm (SyncBatchNorm included): what keep_batchnorm_fp32 keeps in FP32."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def modules_to_cast(model: nn.Module, keep_batchnorm_fp32: bool | None,
                    kept: Collection[int] = frozenset()) -> list[nn.Module]:
    """The modules whose own parameters and buffers go to half: all but batch norms (with
    `keep_batchnorm_fp32`) and the modules `keep_fp32` keeps (`kept`: their ids and those of
    every module inside them, `keep.kept_module_ids`)."""
    return [m for m in model.modules() if not (keep_batchnorm_fp32 and is_batchnorm(m)) and id(m) not in kept]


def params_to_cast(model: nn.Module, keep_batchnorm_fp32: bool | None,
                   kept: Collection[int] = frozenset()) -> list[nn.Parameter]:
    """Floating parameters that `ModelHandle` will convert (known before converting, so
    masters can be made from the FP32 values)."""
    out = {id(p): p for m in modules_to_cast(model, keep_batchnorm_fp32, kept)
           for p in m.parameters(recurse=False) if p.is_floating_point()}
    return list(out.values())


# What a trained param keeps besides its half copy (None: it is not trained), asked by the cast
# of its module: the optimizers' masters answer (`Masters.keeps`)
Trained = Callable[[torch.Tensor], "tuple[Keeps, torch.Tensor | None, torch.Tensor | None] | None"]


def _untrained(p: torch.Tensor) -> None:
    return None


class ModelHandle:
    """One model under O2/O3/O5: its cast tensors' records (`weights.Weights`) and how to undo.

    Each param and buffer the cast converts gets a `weights.Weight`, per (module, name): torch
    replaces buffer objects, and may replace params. What it keeps beside the half tensor:
    `trained` says it for the params an optimizer steps (their FP32 masters, a kahan
    compensation, or nothing); frozen params keep their exact FP32 values where
    `keep_frozen` (FP32 masters: O2/O5), and buffers always. `seen` (shared by the session's
    model handles) maps the id of every param cast so far to its original dtype, so a param
    shared by two models, or tied within one, has one record, found under every name.
    `kept` (ids, see `modules_to_cast`) stay FP32; a model kept whole keeps the forward
    wrapper `keep_in_fp32` gave it. `watch` (if any) sees writes through `.data`."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool | None,
                 output_dtype: torch.dtype | None, patcher, trained: Trained | None = None,
                 keep_frozen: bool = False, seen: dict[int, torch.dtype] | None = None,
                 kept: Collection[int] = frozenset(), watch: DataWatch | None = None,
                 tied: dict[int, Weight] | None = None) -> None:
        self.model = model
        self.dtype = dtype
        self.weights = Weights()
        self._hooks: list[Any] = []
        trained = trained or _untrained
        seen = {} if seen is None else seen
        tied = {} if tied is None else tied  # id(param) -> its record, over the session's models
        names = {id(m): prefix for prefix, m in model.named_modules()}
        # what `model.dtype` says before the cast (transformers' convention: the first floating param)
        self.original_dtype = next((seen.get(id(p), p.dtype) for p in model.parameters() if p.is_floating_point()),
                                   None)
        cast: list[tuple[nn.Module, list[str]]] = []
        for m in modules_to_cast(model, keep_batchnorm_fp32, kept):
            prefix = names.get(id(m), "")
            own: list[str] = []
            made: list[Weight] = []
            for name, p in m._parameters.items():
                if p is None or not p.is_floating_point():
                    continue
                if id(p) in seen:  # tied, or shared with a model cast before: one record, two names
                    if id(p) in tied:
                        self.weights.tie(m, name, tied[id(p)])
                        own.append(name)
                elif p.dtype != dtype:
                    seen[id(p)] = p.dtype
                    keeps, exact, comp = trained(p) or (Keeps.VALUE if keep_frozen else Keeps.HALF_ONLY, None, None)
                    if keeps is Keeps.VALUE and exact is None:
                        exact = keep_exact(p, offload=True)
                    record = Weight(m, name, True, p.dtype, dtype, keeps, exact, _qualified(prefix, name))
                    record.comp = comp
                    made.append(record)
                    tied[id(p)] = record
                    own.append(name)
            for name, b in m._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != dtype:
                    made.append(Weight(m, name, False, b.dtype, dtype, Keeps.VALUE, keep_exact(b),
                                       _qualified(prefix, name)))
                    own.append(name)
            m._apply(lambda t: t.to(dtype) if t.is_floating_point() else t, recurse=False)
            for record in made:
                self.weights.add(record)
            if own:
                cast.append((m, own))
        if watch is not None:
            watch.watch(self.weights)
        if id(model) not in kept:
            self._wrap_forward(patcher, output_dtype)
        for m, own in cast:
            load_hook = LoadHook(self.weights.take, own)
            self._hooks.append(m._register_state_dict_hook(StateDictHook(self.weights, own)))
            self._hooks.append(m._register_load_state_dict_pre_hook(load_hook.pre, with_module=True))
            self._hooks.append(m.register_load_state_dict_post_hook(load_hook))

    def _wrap_forward(self, patcher, output_dtype: torch.dtype | None) -> None:
        model = self.model
        inner = model.forward  # bound method (or an instance attribute someone set)
        install_forward(model, HalfForward(inner, self.dtype, output_dtype, weights=self.weights), patcher)
        for convention in CONVENTIONS:  # what other libraries' models need (CONVENTIONS)
            convention(model, patcher, lambda method: HalfForward(method, self.dtype, output_dtype, nests=False,
                                                                  weights=self.weights), self.original_dtype)

    def restore(self) -> None:
        """Back to the original dtypes, each tensor from what its record keeps (`Weight.restore`),
        onto the device it is on now (a model moved after the cast, e.g. to the CPU before
        Lightning's teardown, stays there)."""
        for h in self._hooks:
            h.remove()
        for record in self.weights.records:
            record.restore()


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class LoadHook:
    """`load_state_dict` hooks of one cast module: the pre-hook notes the incoming tensor of
    each of its cast params and buffers (the exact values of a checkpoint, before torch rounds
    them into the half model); the post-hook hands them to `take` (`Weights.take`: each
    record's exact copy takes them as they are). A tensor torch refused (wrong shape: torch
    reports it after the hooks ran) changes nothing.

    `load_state_dict(assign=True)` would replace the half params (which the optimizer's
    masters follow): it is refused with the fix.
    """

    def __init__(self, take: Any, names: Collection[str]) -> None:
        self.take = take  # take(module, {name: incoming tensor})
        self.names = tuple(names)
        self.incoming: dict[str, torch.Tensor] = {}

    def pre(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *args: Any) -> None:
        self.incoming = {}
        if not self.names:
            return
        if local_metadata.get("assign_to_params_buffers"):
            raise OrderError("load_state_dict(..., assign=True) would replace the parameters amp.initialize "
                             "cast to half (and that the optimizer's FP32 masters follow); load with "
                             "assign=False, or load before amp.initialize.")
        for name in self.names:
            t = state_dict.get(prefix + name)
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.incoming[name] = t

    def __call__(self, module: nn.Module, incompatible: Any) -> None:
        incoming, self.incoming = self.incoming, {}
        loaded = {}
        for name, src in incoming.items():
            t = module._parameters.get(name, module._buffers.get(name))
            if t is not None and src.shape == t.shape:  # else torch refused it: "size mismatch"
                loaded[name] = src
        if loaded:
            self.take(module, loaded)


class StateDictHook:
    """State-dict hook of one cast module: each cast tensor is saved as its record's value
    (`Weight.value`, after `settle`): its exact FP32 copy, aliased, where one is kept, else
    the half tensor itself, as plain PyTorch aliases a module's tensors. `state_dict(
    keep_vars=True)` asks for the live parameters and buffers themselves: left as they are."""

    def __init__(self, weights: Weights, names: Collection[str]) -> None:
        self.weights = weights
        self.names = tuple(names)

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> dict:
        for name in self.names:
            key = prefix + name
            v = state_dict.get(key)
            if v is None or v is module._parameters.get(name) or v is module._buffers.get(name):
                continue
            record = self.weights.get(module, name)
            if record is not None:
                record = self.weights.settle_one(record)  # None: a copy made FP32 again let it go
            if record is not None:
                value = record.value()
                if value is not None:
                    state_dict[key] = value
        return state_dict
