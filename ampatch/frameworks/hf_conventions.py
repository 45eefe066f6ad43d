"""Hugging Face conventions the core must keep: Transformers models cast to half (O2/O3/O5),
and what Accelerate's `prepare` made. Registered with the core on `import ampatch`
(`model.cast.CONVENTIONS`, `session.addons.add_check`), which names neither.

Neither transformers nor accelerate is ever imported: a model is recognized by the methods
and attributes it has, so other models pay nothing and a user's own model with the same
shape (a `generate` method, a `config` with a `dtype`) gets the same treatment.

- Entry points besides `forward` (`ENTRY_POINTS`): `generate` and the `get_*_features`
  methods of multimodal models call submodules directly (Whisper's `generate` runs
  `self.get_encoder()(input_features)`, CLIP's `get_image_features` its vision tower), so
  their floating inputs never pass the cast `forward` and meet half weights in FP32.
  `model.ModelHandle` casts the inputs of these methods like `forward`'s.
- `save_pretrained` (`SavePretrained`): transformers writes the model's dtype, taken from
  its first floating parameter (half after the cast), into `config.json`, while
  `state_dict()` gives the FP32 values. `from_pretrained` loads a checkpoint in the dtype
  its config names, so it would turn the FP32 checkpoint into a half model (which O1 would
  then train in pure half, and O2 would give masters rounded to half). The config records
  the dtype the model had before the cast instead, like the checkpoint of an FP32 run.
- Gradient checkpointing (`checkpoint_like_forward`): each module's `_gradient_checkpointing_func`
  (set by `gradient_checkpointing_enable`, before `initialize` or after it) recomputes in
  backward under the default dtype its forward ran under (`default_dtype.RecomputeAlike`).
- `check_not_accelerated`: what Accelerate prepared is refused, with the order that works.

(`ampatch.huggingface` is the Trainer integration, imported only when used.)
"""
from __future__ import annotations

import logging
import typing
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..model import cast
from ..model.default_dtype import RecomputeAlike
from ..session import addons

logger = logging.getLogger("ampatch")

# Methods that run a model without (only) going through its forward; cast like forward
# where the model's class defines them. generate's own calls of forward cast as usual.
ENTRY_POINTS: tuple[str, ...] = (
    "generate",
    "get_text_features",
    "get_image_features",
    "get_audio_features",
    "get_video_features",
)


def entry_points(model: torch.nn.Module) -> list[str]:
    """The `ENTRY_POINTS` that `model`'s class defines (class attributes only: never a
    submodule or buffer that happens to have one of these names)."""
    return [name for name in ENTRY_POINTS if callable(getattr(type(model), name, None))]


def saves_config_dtype(model: torch.nn.Module) -> bool:
    """Whether `model` looks like a transformers `PreTrainedModel`: a `save_pretrained`
    method and a `config` that has a `dtype` and its own `save_pretrained`."""
    config = getattr(model, "config", None)
    return (callable(getattr(type(model), "save_pretrained", None)) and config is not None
            and hasattr(config, "dtype") and callable(getattr(config, "save_pretrained", None)))


class SavePretrained:
    """`model.save_pretrained` of a cast model: after transformers saved the (FP32) weights
    and a config naming the half dtype, the config names the model's dtype before the cast
    and `config.json` is written again (only that file; by the main process only, as
    transformers does). The live config names it too, so it stays right after
    `deinitialize`.

    A plain object like `forwards.HalfForward`, so the model stays copyable: `copy.deepcopy`
    rebinds `__wrapped__`, a bound method, to the copy.
    """

    def __init__(self, inner: Callable[..., Any], dtype: torch.dtype) -> None:
        self.__wrapped__ = inner
        self.dtype_name = str(dtype).removeprefix("torch.")

    def __call__(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        out = self.__wrapped__(save_directory, *args, **kwargs)
        model = getattr(self.__wrapped__, "__self__", None)
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "dtype"):
            return out
        config.dtype = self.dtype_name
        if kwargs.get("is_main_process", args[0] if args else True):
            config.save_pretrained(save_directory)
        if kwargs.get("push_to_hub"):
            logger.warning("ampatch: save_pretrained(push_to_hub=True) of a model cast to half uploaded a "
                           "config.json that names the half dtype; the local copy names %s. Push that folder "
                           "again, or push after amp.deinitialize().", self.dtype_name)
        return out


def cast_entry_points(model: nn.Module, patcher: Any, cast_entry: Callable[[Callable[..., Any]], Any],
                      original_dtype: torch.dtype | None) -> None:
    """The model convention `model.cast.ModelHandle` runs on each model it casts: the entry
    points cast like forward (`cast_entry`), `save_pretrained` naming the dtype before the
    cast, gradient checkpointing recomputing as the forward ran."""
    for name in entry_points(model):
        patcher.patch(model, name, cast_entry(getattr(model, name)))
    if original_dtype is not None and saves_config_dtype(model):
        patcher.patch(model, "save_pretrained", SavePretrained(typing.cast(Callable[..., Any], model.save_pretrained),
                                                                original_dtype))
    checkpoint_like_forward(model, patcher)


class SetCheckpointing:
    """`model._set_gradient_checkpointing` of a cast model: the checkpoint function it is given
    is wrapped (`RecomputeAlike`) before transformers hands it to the modules. What it set
    stays after `deinitialize` (outside a cast model the wrapper changes nothing)."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.__wrapped__ = inner  # inspect.signature follows it: transformers reads the parameters

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        func = kwargs.get("gradient_checkpointing_func")
        if func is not None and not isinstance(func, RecomputeAlike):
            kwargs["gradient_checkpointing_func"] = RecomputeAlike(func)
        return self.__wrapped__(*args, **kwargs)


def checkpoint_like_forward(model: nn.Module, patcher: Any) -> None:
    """Gradient checkpointing that recomputes as the forward ran: the checkpoint functions the
    modules hold now, and those `_set_gradient_checkpointing` sets later (by keyword, as
    transformers' `gradient_checkpointing_enable` passes it)."""
    for module in model.modules():
        func = vars(module).get("_gradient_checkpointing_func")
        if callable(func) and not isinstance(func, RecomputeAlike):
            patcher.patch(module, "_gradient_checkpointing_func", RecomputeAlike(func))
    cls = type(model)
    enables = callable(getattr(cls, "gradient_checkpointing_enable", None))
    if enables and callable(getattr(cls, "_set_gradient_checkpointing", None)):
        set_checkpointing = typing.cast(Callable[..., Any], model._set_gradient_checkpointing)
        patcher.patch(model, "_set_gradient_checkpointing", SetCheckpointing(set_checkpointing))


def check_not_accelerated(models: Sequence[nn.Module], optimizers: Sequence[Any]) -> None:
    """Refuse what Hugging Face Accelerate's `prepare` made, where it would fight ampatch:
    a model whose forward Accelerate wrapped in autocast (`Accelerator(mixed_precision=
    "fp16"/"bf16")`: two AMPs at once), or an `AcceleratedOptimizer` (its step and
    zero_grad belong to Accelerate's wrapper, and under DDP the model inside was wrapped
    with its FP32 params). Recognized by what Accelerate leaves behind, without importing it.
    """
    for model in models:
        if "_original_forward" in vars(model):
            raise ConfigError(
                f"amp.initialize got a {type(model).__name__} whose forward Hugging Face Accelerate wrapped in "
                "autocast (Accelerator(mixed_precision='fp16'/'bf16')): two mixed-precision schemes at once. "
                "Use Accelerator(mixed_precision='no') and call amp.initialize on the model and optimizer "
                "before accelerator.prepare(...).")
    for optimizer in optimizers:
        if type(optimizer).__name__ == "AcceleratedOptimizer" and type(optimizer).__module__.startswith("accelerate"):
            raise ConfigError(
                "amp.initialize got an AcceleratedOptimizer (the result of accelerator.prepare): call "
                "amp.initialize on the bare model and optimizer first, then accelerator.prepare(...) on what it "
                "returns, with Accelerator(mixed_precision='no'); pass the initialized optimizer to scale_loss.")


cast.add_convention(cast_entry_points)
addons.add_check(check_not_accelerated)
