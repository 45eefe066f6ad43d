"""`fp8=`: torchao's float8 training (the `fp8` extra) on the layers `fp8_choice` picks,
converted in place and put back.

- `require()` imports torchao (quietly: it logs missing GPU kernels on import) and checks
  that it and torch fit; otherwise ImportError naming `pip install "ampatch[fp8]"`.
- `config_for(fp8, device)`: a recipe name or a `Float8LinearConfig` -> the config the layers
  run, emulated where the device has no FP8 tensor cores (`has_fp8_kernels`: CUDA 8.9+).
- `Fp8Layers`: each chosen layer converted *in place*: the module object, its parameters,
  hooks, train/eval mode and `state_dict()` keys stay; only its class becomes torchao's
  `Float8Linear` (Transformers' `Conv1D`: `Float8Conv1D`), as `fully_shard` re-classes
  modules. `restore()` puts each class back, so the trained weights stay where they were.
  On FSDP2-sharded models with torchao's float8 all-gather, the sharded weights' local
  tensors are wrapped as well (`model.sharded.Units.refresh_params` tells FSDP2), and
  `precompute()` (after each optimizer step) computes their scales in one all-reduce.

No FP8 kernels or scaling of ampatch's own: torchao does the arithmetic. docs/fp8.md.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import re
from collections.abc import Collection, Sequence
from typing import Any, SupportsIndex

import torch
from torch import nn

from ..config.values import is_fp8_config
from ..errors import ConfigError, MissingDependencyError
from . import cast, sharded
from .fp8_choice import LayerChoice, choose

logger = logging.getLogger("ampatch")

__all__ = ["EMULATED", "TORCHAO_VERSION", "MIN_TORCH", "require", "has_fp8_kernels", "config_for",
           "convert", "Fp8Layers", "float8_conv1d_class", "float8_layer", "linear_mm_config"]

EMULATED = "fp8 emulated: numerics only, not speed"  # every report, row and notice of an emulated run says it
TORCHAO_VERSION = "0.18"  # the torchao release ampatch is tested with (the `fp8` extra pins it)
MIN_TORCH = (2, 11)       # the oldest torch that torchao 0.18 supports
EXTRA = 'pip install "ampatch[fp8]"'


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


@functools.cache
def require() -> Any:
    """`torchao.float8`, imported once, or ImportError saying how to get a torchao that fits."""
    if _version(torch.__version__)[:2] < MIN_TORCH:
        raise MissingDependencyError(
            f"fp8= needs torch >= {'.'.join(map(str, MIN_TORCH))} (torchao {TORCHAO_VERSION}'s float8 training); this "
            f"is torch {torch.__version__}. Upgrade torch, or leave fp8 off.")
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:  # missing GPU kernels on a CPU machine, a deprecation inside torchao: not the user's news
        q.setLevel(logging.ERROR)
    try:
        torchao = importlib.import_module("torchao")
        float8 = importlib.import_module("torchao.float8")
    except ImportError as exc:
        raise MissingDependencyError(
            f"fp8= runs torchao's float8 training, and torchao is not installed ({exc}). Install the extra: {EXTRA} "
            f"(torchao {TORCHAO_VERSION}.x).") from exc
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    have = getattr(torchao, "__version__", "unknown")
    if not have.startswith(TORCHAO_VERSION + "."):
        raise MissingDependencyError(
            f"fp8= is tested with torchao {TORCHAO_VERSION}.x, and torchao {have} is installed: its float8 internals "
            f"differ between releases. Install the pinned one: {EXTRA}.")
    return float8


def has_fp8_kernels(device: torch.device | str | None) -> bool:
    """Whether `device` runs FP8 GEMMs on tensor cores (CUDA compute capability 8.9+: Ada,
    Hopper, Blackwell). ROCm's FP8 uses other formats, not supported here: emulated."""
    device = torch.device(device if device is not None else "cpu")
    if device.type != "cuda" or not torch.cuda.is_available() or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def config_for(fp8: Any, device: torch.device | str | None, sharded_model: bool = False) -> Any:
    """The `Float8LinearConfig` of `fp8` (a recipe name or a config) on `device`: emulated
    where `has_fp8_kernels` says no (a config's own `emulate=True` is kept everywhere). A
    tensorwise recipe named on an FSDP2-sharded model all-gathers the weights in FP8 (half
    the traffic); a config's own choice stands, but on a model that is not sharded the
    all-gather has nothing to do and is switched off."""
    float8 = require()
    if is_fp8_config(fp8):
        config = fp8
    else:
        config = float8.Float8LinearConfig.from_recipe_name(fp8)
        if fp8 == "tensorwise" and sharded_model:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    changes: dict[str, Any] = {}
    if not config.emulate and not has_fp8_kernels(device):
        changes["emulate"] = True
    if config.enable_fsdp_float8_all_gather and not sharded_model:
        changes["enable_fsdp_float8_all_gather"] = False
    return dataclasses.replace(config, **changes) if changes else config


def linear_mm_config(config: Any) -> Any:
    """torchao's per-GEMM settings for `config` (what each `Float8Linear` builds for itself)."""
    return _float8_attributes(config)["linear_mm_config"]


def _float8_attributes(config: Any) -> dict[str, Any]:
    """What `Float8Linear.__init__` adds to a Linear's instance attributes, for `config`: read
    off a throw-away one on the meta device, so torchao decides what they are."""
    from torchao.float8.float8_linear import Float8Linear
    with torch.device("meta"):
        probe = Float8Linear(16, 16, bias=False, config=config)
        plain = nn.Linear(16, 16, bias=False)
    return {k: v for k, v in vars(probe).items() if k not in vars(plain)}


@functools.cache
def float8_conv1d_class() -> type[nn.Module]:
    """`Float8Conv1D`: Transformers' Conv1D (y = x @ W + b, W of shape (in, out)) through
    torchao's float8 matmul. W is the `weight.t()` a Float8Linear hands torchao, so the
    Conv1D's own parameter goes in as it is: no copy, no transposed parameter."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from transformers.pytorch_utils import Conv1D

    class Float8Conv1D(Conv1D):
        ampatch_source_class = Conv1D
        __reduce_ex__ = _reduce_float8  # pickles as the float8 class of Conv1D, made again where loaded

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = matmul_with_hp_or_float8_args.apply(x, self.weight, self.linear_mm_config, self.config)
            return out + self.bias.to(out.dtype) if self.bias is not None else out

    return Float8Conv1D


@functools.cache
def _float8_class(cls: type) -> type[nn.Module]:
    """The float8 class a layer of class `cls` becomes: `Float8Linear` for `nn.Linear` (and
    `Float8Conv1D` for Conv1D); for a subclass without a forward of its own, one deriving from
    both, so its other methods and `isinstance` checks still hold."""
    if _is_conv1d_class(cls):
        base = float8_conv1d_class()
    else:
        from torchao.float8.float8_linear import Float8Linear
        base = Float8Linear
    if cls is base.__mro__[1]:  # nn.Linear: torchao's own class; Conv1D: our Float8Conv1D, made at run time
        return base
    made = type(f"Float8{cls.__name__}", (base, cls), {"__module__": __name__, "__reduce_ex__": _reduce_float8,
                                                       "ampatch_source_class": cls})
    assert issubclass(made, nn.Module)  # for the type checker: `base` is one
    return made


def _reduce_float8(self: nn.Module, protocol: SupportsIndex) -> tuple:
    """How a layer of a float8 class made at run time pickles (`torch.save(model)`, deepcopy):
    as the float8 class of its own, importable class, made again where it is loaded."""
    return (float8_layer, (vars(type(self))["ampatch_source_class"],), self.__dict__.copy())


def float8_layer(source: type) -> nn.Module:
    """An empty layer of `_float8_class(source)`, which unpickling fills with its state."""
    cls = _float8_class(source)
    return cls.__new__(cls)


def convert(models: Sequence[nn.Module], fp8: Any, fp8_modules: Any = None, kept: Collection[int] = frozenset(),
            device: torch.device | str | None = None) -> Fp8Layers:
    """The layers of `models` that `fp8_modules` (None: the default choice) picks, outside the
    modules kept in FP32 (`kept`: their ids), converted to run `fp8` (a recipe or a config) on
    `device`. When no layer can run in FP8, nothing is converted: a ValueError naming why
    each was skipped where `fp8_modules` asked for layers, else the layers' reasons stand in
    the report and training runs as without fp8 (`Fp8Layers.lines`; the session warns)."""
    choices = choose(models, fp8_modules, kept)
    if fp8_modules is not None and not any(c.convert for c in choices):
        raise ConfigError("fp8_modules selects no layer that can run in FP8: " + "; ".join(map(str, choices)) + ". "
                          "Select nn.Linear (or Transformers Conv1D) layers whose in/out features are multiples of 16.")
    return Fp8Layers(models, choices, config_for(fp8, device, cast.is_sharded(models)))


class Fp8Layers:
    """The layers one session runs in FP8: converted on creation, put back by `restore()`.

    `choices` (`fp8_choice.choose`) say which; `models` are where they live. A failure
    half-way restores the layers converted so far before it propagates."""

    def __init__(self, models: Sequence[nn.Module], choices: Sequence[LayerChoice], config: Any) -> None:
        self.models = list(models)
        self.choices = list(choices)
        self.config = config
        self.converted: list[tuple[nn.Module, type, dict[str, Any]]] = []  # (layer, its class, attributes it had)
        # (units, sharded weight) whose local shard carries torchao's FP8 all-gather
        self.wrapped: list[tuple[sharded.Units, nn.Parameter]] = []
        self._units: list[sharded.Units] = []
        attributes = _float8_attributes(config)
        self._names = (*attributes, "ampatch_fp8")  # what a conversion adds to a layer
        try:
            for choice in self.choices:
                if choice.convert:
                    self._convert(self.models[choice.model].get_submodule(choice.name), attributes)
            if config.enable_fsdp_float8_all_gather:
                self._wrap_sharded_weights()
        except BaseException:
            self.restore()
            raise

    @property
    def emulated(self) -> bool:
        return bool(self.config.emulate)

    @functools.cached_property
    def recipe(self) -> str:
        """The recipe's name as reports show it: torchao's name, or "custom" for a config
        given whole (torchao's configs carry no name)."""
        float8 = require()
        for name in (r.value for r in float8.Float8LinearRecipeName):
            named = float8.Float8LinearConfig.from_recipe_name(name)
            if dataclasses.replace(self.config, emulate=False, enable_fsdp_float8_all_gather=False) == \
                    dataclasses.replace(named, emulate=False, enable_fsdp_float8_all_gather=False):
                return name
        return "custom"

    def summary(self) -> str:
        """One line for the start-up notice and the report."""
        n = sum(c.convert for c in self.choices)
        where = EMULATED if self.emulated else "FP8 tensor cores"
        gather = ", weights all-gathered in FP8" if self.wrapped else ""
        return (f"fp8 {self.recipe} on {n} of {len(self.choices)} Linear layers ({where}{gather})" if n else
                f"fp8 {self.recipe}: no layer can run in FP8 here, so none was converted (see the reasons)")

    def _convert(self, layer: nn.Module, attributes: dict[str, Any]) -> None:
        had = {k: vars(layer)[k] for k in self._names if k in vars(layer)}
        cls: type = type(layer)
        layer.__class__ = _float8_class(cls)
        self.converted.append((layer, cls, had))
        for k, v in attributes.items():
            object.__setattr__(layer, k, v)
        object.__setattr__(layer, "ampatch_fp8", True)

    def _wrap_sharded_weights(self) -> None:
        """torchao's float8 all-gather on FSDP2: each converted Float8Linear's sharded weight
        keeps its identity (the optimizer's parameter), its local shard wrapped so FSDP2
        all-gathers it in FP8; FSDP2 re-reads its parameters (`Units.refresh_params`)."""
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
        self._units = [sharded.Units(m) for m in self.models if cast.is_sharded([m])]
        for u in self._units:
            u.check_all_gather_extensions()
        dtype = self.config.cast_config_weight.target_dtype
        units = {id(fp.sharded_param): u for u in self._units for fp in u.params}
        for layer, cls, _ in self.converted:
            w = layer.weight
            if not isinstance(w, nn.Parameter) or _is_conv1d_class(cls) or id(w) not in units:
                continue  # a Conv1D (weight transposed) or a layer outside the sharded units: gathered as is
            units[id(w)].replace_local(w, functools.partial(WeightWithDynamicFloat8CastTensor,
                                                            linear_mm_config=layer.linear_mm_config, dtype=dtype))
            self.wrapped.append((units[id(w)], w))
        for u in self._units:
            u.refresh_params()

    def precompute(self) -> None:
        """The FP8 scales of the all-gathered weights, for the next forward (one all-reduce);
        nothing to do without FP8 all-gather. Called after each optimizer step that ran."""
        if self.wrapped:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
            for m in self.models:
                precompute_float8_dynamic_scale_for_fsdp(m)

    def restore(self) -> None:
        """Every converted layer back to its own class (with the parameters it holds now: the
        trained ones), attributes as they were; sharded weights unwrapped. Idempotent."""
        while self.wrapped:
            units, w = self.wrapped.pop()
            units.replace_local(w, lambda t: t._tensor)
        for u in self._units:
            u.refresh_params()
        self._units = []
        while self.converted:
            layer, cls, had = self.converted.pop()
            layer.__class__ = cls
            for k in self._names:
                vars(layer).pop(k, None)
            vars(layer).update(had)

    def lines(self) -> list[str]:
        """What the start-up notice and `report()` list: one line per layer, with its reason."""
        return [str(c) for c in self.choices]


def _is_conv1d_class(cls: type) -> bool:
    return any(c.__name__ == "Conv1D" and c.__module__.startswith("transformers") for c in cls.__mro__)
