"""Transformers 5.x: ampatch's opt levels for the Hugging Face `Trainer`.

    trainer = AmpatchTrainer(model=model, args=args, train_dataset=ds, opt_level="O2")

Transformers dropped Apex (`half_precision_backend="apex"`); its `fp16`/`bf16` switches are
autocast, with no FP32 masters. `AmpatchTrainer` is a drop-in `transformers.Trainer` that
runs `amp.initialize`/`amp.scale_loss` inside the Trainer's own loop:

- the optimizer the Trainer creates (or the one passed in) and the model are initialized
  in `create_optimizer`, before Accelerate prepares (and, distributed, wraps) them;
- the loss is scaled around the Trainer's backward (`accelerator.backward`);
- clipping (`max_grad_norm`) and the logged grad norm use the FP32 masters; gradient
  accumulation goes through `scale_loss` micro-batch by micro-batch, as in a hand loop;
- a skipped step (overflow) does not advance the LR scheduler (`lr_guard`);
- checkpoints hold the FP32 model, the optimizer with its masters, and the loss scaler
  (`ampatch.pt`), so `train(resume_from_checkpoint=...)` continues where it stopped;
- when `train()` returns, the session is undone: the model is FP32 (the masters' values).

`TrainingArguments(fp16=True)` or `bf16=True` is refused: two mixed-precision schemes at
once. Imported only by who uses it (never by `import ampatch`).
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch

import ampatch as amp

from .optim import scheduler_guard as lr_guard
from .patching import Patcher

try:
    import transformers
except ImportError as exc:
    raise ImportError("ampatch.huggingface needs transformers 5.x: pip install 'ampatch[integrations]' "
                      "(or pip install transformers accelerate).") from exc

logger = logging.getLogger("ampatch")

SCALER_FILE = "ampatch.pt"  # the loss scaler's state, beside the Trainer's optimizer.pt


def check_args(args: Any) -> None:
    """Refuse TrainingArguments that turn on the Trainer's own mixed precision or a backend
    whose optimizer step ampatch cannot see."""
    if args is None:
        return
    on = [name for name in ("fp16", "bf16", "fp16_full_eval", "bf16_full_eval") if getattr(args, name, False)]
    if on:
        raise ValueError(f"AmpatchTrainer got TrainingArguments({'=True, '.join(on)}=True): that is the Trainer's "
                         "own mixed precision (autocast) on top of ampatch's, two AMPs at once. Leave them False "
                         "and choose the precision with opt_level (O4/O5 for bfloat16).")
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        raise ValueError("AmpatchTrainer does not run with DeepSpeed or FSDP (they own the optimizer step and "
                         "its precision); use the plain Trainer with their mixed-precision settings.")


def _bare(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind Accelerate's AcceleratedOptimizer."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


class AmpatchTrainer(transformers.Trainer):
    """`transformers.Trainer` at an ampatch `opt_level` (O0-O5).

    `policy` (the file `ampatch tune` writes) and `initialize_kwargs` (any other
    `amp.initialize` keyword: `half_dtype`, `loss_scale`, `keep_fp32`, ...) go to
    `amp.initialize`; every other argument is the Trainer's.
    """

    def __init__(self, *args: Any, opt_level: str = "O2", policy: Any = None,
                 initialize_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not isinstance(opt_level, str):
            raise TypeError(f"AmpatchTrainer(opt_level) takes a level name such as 'O2', got {opt_level!r}.")
        check_args(kwargs.get("args", args[1] if len(args) > 1 else None))
        self.opt_level = opt_level
        self.initialize_kwargs = dict(initialize_kwargs or {})
        for name in ("models", "optimizers", "opt_level"):
            if name in self.initialize_kwargs:
                raise TypeError(f"AmpatchTrainer: initialize_kwargs may not hold {name!r} (the Trainer gives the "
                                "model and optimizer; opt_level is its own argument).")
        if policy is not None:
            self.initialize_kwargs["policy"] = policy
        self._amp_optimizer: torch.optim.Optimizer | None = None
        self._patches = Patcher()  # the accelerator's backward, the scheduler's hold
        super().__init__(*args, **kwargs)
        check_args(self.args)

    # ------------------------------------------------------------------ set-up
    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer, then `amp.initialize` on it and the bare model."""
        optimizer = super().create_optimizer(model)
        if self._amp_optimizer is not None:
            return optimizer
        bare = _bare(optimizer)
        initialized, bare = amp.initialize(self.model, bare, opt_level=self.opt_level, **self.initialize_kwargs)
        if initialized is not self.model:
            raise RuntimeError("amp.initialize returned another model object; AmpatchTrainer needs it in place.")
        self._amp_optimizer = bare
        accelerator = self.accelerator
        own_backward = accelerator.backward

        def backward(loss: torch.Tensor, **kwargs: Any) -> None:
            with amp.scale_loss(loss, bare) as scaled:
                own_backward(scaled, **kwargs)

        self._patches.patch(accelerator, "backward", backward)
        return optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The Trainer's scheduler, held still after a skipped step."""
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if self._amp_optimizer is not None:
            opt = self._amp_optimizer
            lr_guard.hold_on_skip(scheduler, lambda: amp.last_step_skipped(opt), self._patches)
        return scheduler

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's train(); afterwards the session is undone (the model is FP32 again)."""
        try:
            return super().train(*args, **kwargs)
        finally:
            self.end_ampatch()

    def end_ampatch(self) -> None:
        """Undo the session and the Trainer's patches (train() does this when it returns)."""
        self._patches.restore_all()
        if self._amp_optimizer is not None:
            amp.deinitialize()
            self._amp_optimizer = None

    # ------------------------------------------------------------------ clipping on the masters
    def _clip_grad_norm(self, model: Any) -> Any:
        if self._amp_optimizer is None:
            return super()._clip_grad_norm(model)
        return torch.nn.utils.clip_grad_norm_(list(amp.master_params(self._amp_optimizer)),
                                              self.args.max_grad_norm)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        if grad_norm is None and self._amp_optimizer is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(list(amp.master_params(self._amp_optimizer)), float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # ------------------------------------------------------------------ checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self._amp_optimizer is not None and self.args.should_save:
            torch.save(amp.state_dict(), os.path.join(output_dir, SCALER_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or self._amp_optimizer is None:
            return
        path = os.path.join(checkpoint, SCALER_FILE)
        if os.path.isfile(path):
            amp.load_state_dict(torch.load(path, weights_only=True))
        else:
            logger.warning("ampatch: %s has no %s (not written by AmpatchTrainer): the loss scale starts afresh.",
                           checkpoint, SCALER_FILE)
