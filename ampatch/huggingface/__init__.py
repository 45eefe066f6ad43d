"""Transformers 5.x: ampatch's opt levels for the Hugging Face `Trainer` and its subclasses.

    trainer = AmpatchTrainer(model=model, args=args, train_dataset=ds, opt_level="O2")
    class MySeq2SeqTrainer(AmpatchTrainerMixin, Seq2SeqTrainer): ...

Transformers dropped Apex (`half_precision_backend="apex"`); its `fp16`/`bf16` switches are
autocast, with no FP32 masters. `AmpatchTrainer` is a drop-in `transformers.Trainer`, and
`AmpatchTrainerMixin` brings the same to any Trainer subclass (`Seq2SeqTrainer`, TRL's
trainers): `amp.initialize`/`amp.scale_loss` inside the Trainer's own loop (see `trainer`).
With `policy=` and no `opt_level`, the policy's level runs; with neither, O2.

- `trainer`: the mixin and `AmpatchTrainer`;
- `checks`: what is refused, each with the fix: the Trainer's own `fp16`/`bf16`, and mixed
  precision, DeepSpeed, FSDP or Megatron-LM switched on through `TrainingArguments` or
  Accelerate's environment (`accelerate launch --mixed_precision bf16` ...): two AMPs at
  once, or a backend that owns the optimizer step.

Imported only by who uses it (never by `import ampatch`).
"""
from __future__ import annotations

from .checks import check_accelerator, check_args, check_environment
from .trainer import SCALER_FILE, AmpatchTrainer, AmpatchTrainerMixin

__all__ = ["AmpatchTrainer", "AmpatchTrainerMixin", "SCALER_FILE", "check_args", "check_environment",
           "check_accelerator"]
