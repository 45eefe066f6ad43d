"""Lightning's names that `ampatch.lightning` uses, imported once, and the few private ones
it cannot avoid, each isolated here with why.

Lightning is imported from `lightning` (its `pytorch` and `fabric` parts), else from the
standalone `pytorch_lightning` and `lightning_fabric` packages.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal

import torch

from ampatch.errors import ConfigError, MissingDependencyError

if TYPE_CHECKING:  # a type checker reads the `lightning` package's names (the fallback below is the same code)
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import HalfPrecision as FabricHalfPrecision
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.core import LightningModule
    from lightning.pytorch.plugins.precision import HalfPrecision as TrainerHalfPrecision
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.model_helpers import is_overridden
else:
    try:
        from lightning.fabric import Fabric
        from lightning.fabric.plugins.precision import HalfPrecision as FabricHalfPrecision
        from lightning.pytorch.callbacks import Callback
        from lightning.pytorch.core import LightningModule
        from lightning.pytorch.plugins.precision import HalfPrecision as TrainerHalfPrecision
        from lightning.pytorch.trainer.states import TrainerFn
        from lightning.pytorch.utilities.model_helpers import is_overridden
    except ImportError:  # the standalone package names
        try:
            from lightning_fabric import Fabric
            from lightning_fabric.plugins.precision import HalfPrecision as FabricHalfPrecision
            from pytorch_lightning.callbacks import Callback
            from pytorch_lightning.core import LightningModule
            from pytorch_lightning.plugins.precision import HalfPrecision as TrainerHalfPrecision
            from pytorch_lightning.trainer.states import TrainerFn
            from pytorch_lightning.utilities.model_helpers import is_overridden
        except ImportError as exc:
            raise MissingDependencyError("ampatch.lightning needs Lightning 2.x: pip install 'ampatch[integrations]' "
                                          "(or pip install lightning).") from exc

__all__ = ["Fabric", "FabricHalfPrecision", "TrainerHalfPrecision", "LightningModule", "TrainerFn", "Callback",
           "is_overridden", "set_compute_dtype", "set_precision", "PrecisionName", "refuse_strategy", "FabricSetup",
           "fabric_setup_call", "raw_optimizer"]

# Strategies that own the optimizer step, the sharding or the precision themselves: ampatch
# cannot sit beside them (why, in the error).
_OWN_PRECISION = ("they bring their own precision handling and own the optimizer step; use their precision "
                  "settings (precision='bf16-mixed'/'16-mixed'/'bf16-true') instead of AmpatchPrecision")
REFUSED = {
    "DeepSpeedStrategy": "DeepSpeed runs its own mixed precision, loss scaling and FP32 master weights inside its "
                         "engine's optimizer step; " + _OWN_PRECISION,
    "FSDPStrategy": "FSDP shards the parameters and owns their precision (MixedPrecision); " + _OWN_PRECISION,
    "XLAStrategy": "XLA compiles the step for TPUs; " + _OWN_PRECISION,
    "XLAFSDPStrategy": "XLA compiles the step for TPUs; " + _OWN_PRECISION,
    "SingleDeviceXLAStrategy": "XLA compiles the step for TPUs; " + _OWN_PRECISION,
}


def refuse_strategy(strategy: Any, who: str) -> None:
    """Raise for a strategy ampatch cannot run beside (see `REFUSED`), naming why and the fix."""
    for cls in type(strategy).__mro__:
        reason = REFUSED.get(cls.__name__)
        if reason is not None and cls.__module__.startswith(("lightning", "pytorch_lightning", "lightning_fabric")):
            raise ConfigError(f"{who} cannot run with {type(strategy).__name__}: {reason}. ampatch runs with the "
                              "single-device, DDP and DataParallel strategies.")


def set_compute_dtype(plugin: Any, dtype: torch.dtype) -> None:
    """Tell Lightning's ThroughputMonitor (and Fabric's throughput utilities) the dtype the
    plugin computes in: they read it from a `HalfPrecision`'s `_desired_input_dtype`, a
    private attribute (their only way to ask a precision plugin), which is why the plugins
    derive from `HalfPrecision`."""
    plugin._desired_input_dtype = dtype


# What `precision` says of the weights: half where the session casts the model, else FP32.
PrecisionName = Literal["bf16-true", "16-true", "32-true"]


def set_precision(plugin: Any, name: PrecisionName) -> None:
    """Set the plugin's `precision` (what ModelSummary sizes the weights by). A plugin is a
    `HalfPrecision` only for `set_compute_dtype`'s sake, whose annotation allows the two half
    names; the plugins say "32-true" too, before a session casts the model and at O0/O1/O4."""
    plugin.precision = name


def raw_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind a LightningOptimizer or a Fabric optimizer (their public
    `optimizer` property), or the optimizer itself."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


@dataclass(frozen=True)
class FabricSetup:
    """What the `Fabric.setup`/`setup_module` call that asked for `convert_module` was given."""

    fabric: Any
    optimizers: tuple[Any, ...]
    move_to_device: bool


def fabric_setup_call(max_depth: int = 6) -> FabricSetup | None:
    """The `Fabric.setup(module, *optimizers)` (or `setup_module(module)`) call running
    `convert_module`, or None.

    Fabric gives its precision plugin the module alone, but ampatch needs the optimizers with
    it: the FP32 master weights are made from the FP32 weights before the cast, and the loss
    scale needs the optimizers at the first backward. Fabric has no hook that names them, so
    they are read from the frame of `Fabric.setup` (its arguments `self`, `optimizers`,
    `move_to_device`, as in Lightning 2.x), recognized by its code object, never guessed."""
    codes = {Fabric.setup.__code__: True, Fabric.setup_module.__code__: False}
    frame: FrameType | None = sys._getframe(1).f_back  # from our caller's caller up
    for _ in range(max_depth):
        if frame is None:
            return None
        takes_optimizers = codes.get(frame.f_code)
        if takes_optimizers is not None:
            names = frame.f_locals
            return FabricSetup(names["self"], tuple(names["optimizers"]) if takes_optimizers else (),
                               bool(names.get("move_to_device", True)))
        frame = frame.f_back
    return None
