"""Hugging Face `transformers` conventions that a model cast to half (O2/O3/O5) must keep.

transformers is never imported: a model is recognized by the methods and attributes it
has, so other models pay nothing and a user's own model with the same shape (a
`generate` method, a `config` with a `dtype`) gets the same treatment.

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

(`ampatch.huggingface` is the Trainer integration; this module is core and needs nothing.)
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

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
