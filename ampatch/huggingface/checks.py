"""What `AmpatchTrainer` refuses: a second mixed-precision scheme, or a backend that owns the
optimizer step, switched on through `TrainingArguments` or through Accelerate's environment
(`accelerate launch --mixed_precision bf16`, `--use_deepspeed`, `--use_fsdp` set
``ACCELERATE_*`` variables that reach the Trainer's `Accelerator`). Each error names the fix.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ampatch.errors import ConfigError

__all__ = ["check_args", "check_environment", "check_accelerator", "ENV_SWITCHES"]

TRUE = ("1", "true", "yes", "y", "on")  # what Accelerate reads as true
FIX_PRECISION = ("choose the precision with opt_level instead (O4/O5 for bfloat16; O1/O2 with "
                 "initialize_kwargs={'half_dtype': torch.float16} for float16)")
FIX_BACKEND = "use the plain Trainer with that backend's own mixed-precision settings, or train without it"
# variable -> what it switches on, when it is "on"
ENV_SWITCHES = {
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed (its engine owns the optimizer step, loss scaling and master weights)",
    "ACCELERATE_USE_FSDP": "FSDP (it shards the parameters and owns their precision)",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM (it owns the optimizer step and its precision)",
}


def check_args(args: Any) -> None:
    """Refuse TrainingArguments that turn on the Trainer's own mixed precision or a backend
    whose optimizer step ampatch cannot see."""
    if args is None:
        return
    on = [name for name in ("fp16", "bf16", "fp16_full_eval", "bf16_full_eval") if getattr(args, name, False)]
    if on:
        raise ConfigError(f"AmpatchTrainer got TrainingArguments({'=True, '.join(on)}=True): that is the Trainer's "
                          "own mixed precision (autocast) on top of ampatch's, two AMPs at once. Leave them False "
                          f"and {FIX_PRECISION}.")
    mixed = getattr(args, "mixed_precision", "no") or "no"
    if mixed != "no":
        raise ConfigError(f"AmpatchTrainer got TrainingArguments with mixed_precision={mixed!r}, read from "
                          "ACCELERATE_MIXED_PRECISION when the arguments were made (accelerate launch "
                          "--mixed_precision, or the accelerate config): Accelerate's autocast on top of ampatch's, "
                          "two AMPs at once. Unset it (or launch with --mixed_precision no) and " + FIX_PRECISION + ".")
    if getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None) is not None \
            or getattr(args, "fsdp", None):
        raise ConfigError("AmpatchTrainer does not run with DeepSpeed or FSDP (they own the optimizer step and "
                          f"its precision); {FIX_BACKEND}.")


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Refuse Accelerate's environment switches for mixed precision, DeepSpeed, FSDP and
    Megatron-LM (`accelerate launch` sets them from its flags and config)."""
    environ = os.environ if environ is None else environ
    mixed = environ.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower() or "no"
    if mixed != "no":
        raise ConfigError(f"AmpatchTrainer: ACCELERATE_MIXED_PRECISION={mixed} (accelerate launch --mixed_precision "
                          "or the accelerate config) turns on Accelerate's autocast and grad scaler on top of "
                          "ampatch's, two AMPs at once. Unset it (or launch with --mixed_precision no) and "
                          f"{FIX_PRECISION}.")
    for name, what in ENV_SWITCHES.items():
        if environ.get(name, "").strip().lower() in TRUE:
            raise ConfigError(f"AmpatchTrainer: {name}={environ[name]} turns on {what}: ampatch cannot run beside "
                              f"it. Unset it (launch without that flag, or fix the accelerate config), or "
                              f"{FIX_BACKEND}.")


def check_accelerator(trainer: Any) -> None:
    """After the Trainer made its Accelerator: what it actually turned on, whatever switched
    it (arguments, environment, a config file)."""
    accelerator = getattr(trainer, "accelerator", None)
    mixed = str(getattr(accelerator, "mixed_precision", "no") or "no")
    if mixed != "no":
        raise ConfigError(f"AmpatchTrainer: the Trainer's Accelerator runs mixed_precision={mixed!r} (from the "
                          "arguments, ACCELERATE_MIXED_PRECISION or the accelerate config): two AMPs at once. Set it "
                          f"to 'no' and {FIX_PRECISION}.")
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        raise ConfigError("AmpatchTrainer: the Trainer's Accelerator runs DeepSpeed or FSDP (from the arguments, the "
                          f"environment or the accelerate config); {FIX_BACKEND}.")
