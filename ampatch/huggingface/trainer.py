"""`AmpatchTrainerMixin` (ampatch inside any `transformers.Trainer` class) and
`AmpatchTrainer` (the mixin on `Trainer` itself).

The hooks are the Trainer's own methods, as in Transformers 5.23:

- `create_optimizer`: the Trainer's optimizer (or the one passed in), then `amp.initialize`
  on it and the bare model, before Accelerate prepares (and, distributed, wraps) them; the
  accelerator's `backward` runs inside `amp.scale_loss`;
- `create_scheduler`: the scheduler holds still after a skipped step (held once, however
  often the Trainer asks: `auto_find_batch_size` retries, a scheduler passed in);
- `_clip_grad_norm`/`_get_grad_norm`: on the FP32 masters;
- `_save/_load_optimizer_and_scheduler`: the loss scaler beside the optimizer (`ampatch.pt`);
- `_load_best_model` (`load_best_model_at_end=True`): the best checkpoint's weights are its
  exact FP32 masters; its optimizer state (the masters too) is loaded with them;
- `train`: afterwards the session is undone (the model FP32, the masters' values); its
  `report()` stays in `trainer.ampatch_report`.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

import ampatch as amp

from ..base.patcher import Patcher
from ..config.values import MasterMode
from ..errors import ConfigTypeError, InvalidCallError, MissingDependencyError
from ..frameworks import scheduler_guard
from ..frameworks.level import LevelChoice, end_session
from ..session.session import current
from .checks import check_accelerator, check_args, check_environment

try:
    import transformers
    from transformers.trainer import OPTIMIZER_NAME
except ImportError as exc:
    raise MissingDependencyError("ampatch.huggingface needs transformers 5.x: pip install 'ampatch[integrations]' "
                                 "(or pip install transformers accelerate).") from exc

logger = logging.getLogger("ampatch")

__all__ = ["AmpatchTrainerMixin", "AmpatchTrainer", "SCALER_FILE"]

SCALER_FILE = "ampatch.pt"  # the loss scaler's state, beside the Trainer's optimizer.pt


def _bare(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind Accelerate's AcceleratedOptimizer."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


if TYPE_CHECKING:  # to a type checker the mixin is the Trainer it goes before: its attributes, super()'s methods
    _TrainerBase = transformers.Trainer
else:  # at run time a plain mixin, placed before any Trainer class
    _TrainerBase = object


class AmpatchTrainerMixin(_TrainerBase):
    """ampatch inside a `transformers.Trainer` class, placed before it in the bases.

    `amp.initialize` runs on the model and the Trainer's optimizer when the Trainer makes it,
    the accelerator's backward inside `amp.scale_loss`; `train()` undoes the session when it
    returns (the module's docstring lists each hook). The Trainer's own arguments go through.

    Args:
        opt_level: "O0" to "O5", as `amp.initialize`'s. Default: None (the policy's level
            when `policy` is given, else "O2").
        policy: a policy file `ampatch tune` wrote (its path, or its dict). Default: None.
        initialize_kwargs: a dict of `amp.initialize`'s other keywords (`half_dtype`,
            `loss_scale`, `keep_fp32`, ...). Default: None.

    Raises:
        TypeError: the mixin placed after the Trainer class, or mixed into a class that is
            no Trainer; `opt_level` not a string.
        ValueError: the Trainer's own `fp16`/`bf16`, or mixed precision, DeepSpeed or FSDP
            switched on through Accelerate (two AMPs at once; `checks`).

    Example::

        >>> class AmpatchSeq2SeqTrainer(AmpatchTrainerMixin, Seq2SeqTrainer): ...
        >>> trainer = AmpatchSeq2SeqTrainer(model=model, args=args, train_dataset=ds, opt_level="O5")
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Placed after a Trainer in the bases, the Trainer's methods would win and the mixin
        would do nothing: refused when the class is made."""
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if transformers.Trainer in mro and mro.index(transformers.Trainer) < mro.index(AmpatchTrainerMixin):
            raise ConfigTypeError(f"{cls.__name__}: AmpatchTrainerMixin goes first, before the transformers.Trainer "
                                  "class, or the Trainer's methods hide it: class MyTrainer(AmpatchTrainerMixin, "
                                  "Seq2SeqTrainer).")

    def __init__(self, *args: Any, opt_level: str | None = None, policy: Any = None,
                 initialize_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not isinstance(self, transformers.Trainer):
            raise ConfigTypeError(f"{type(self).__name__}: AmpatchTrainerMixin mixes into a transformers.Trainer "
                                  "class: class MyTrainer(AmpatchTrainerMixin, Seq2SeqTrainer).")
        self.choice = LevelChoice(type(self).__name__, opt_level, policy, dict(initialize_kwargs or {}))
        self.ampatch_report: Any = None  # the session's report(), kept when train() ends the session
        self.opt_level = opt_level
        check_environment()
        check_args(kwargs.get("args", args[1] if len(args) > 1 else None))
        self._amp_optimizer: torch.optim.Optimizer | None = None
        self._patches = Patcher()  # the accelerator's backward, the schedulers' holds
        super().__init__(*args, **kwargs)
        check_args(self.args)
        check_accelerator(self)

    # ------------------------------------------------------------------ set-up
    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer, then `amp.initialize` on it and the bare model."""
        optimizer = super().create_optimizer(model)
        if self._amp_optimizer is not None:
            return optimizer
        bare = _bare(optimizer)
        if self.model is None:
            raise ConfigTypeError(f"{type(self).__name__} has no model to initialize: pass model= (or model_init=) "
                                  "to it.")
        initialized, bare = amp.initialize(self.model, bare, **self.choice.keywords())
        if initialized is not self.model:
            raise InvalidCallError("amp.initialize returned another model object; AmpatchTrainer needs it in place.")
        self._amp_optimizer = bare
        accelerator = self.accelerator
        own_backward = accelerator.backward

        def backward(loss: torch.Tensor, **kwargs: Any) -> None:
            with amp.scale_loss(loss, bare) as scaled:
                own_backward(scaled, **kwargs)

        self._patches.patch(accelerator, "backward", backward)
        return optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The Trainer's scheduler, held still after a skipped step (once per scheduler)."""
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if self._amp_optimizer is not None and (scheduler, "step") not in self._patches:
            opt = self._amp_optimizer
            scheduler_guard.hold_on_skip(scheduler, lambda: amp.last_step_skipped(opt), self._patches)
        return scheduler

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's train(); afterwards the session is undone (the model is FP32 again)."""
        check_args(self.args)
        try:
            return super().train(*args, **kwargs)
        finally:
            self.end_ampatch()

    def end_ampatch(self) -> None:
        """Undo the session and the Trainer's patches (train() does this when it returns)."""
        self._patches.restore_all()
        if self._amp_optimizer is not None:
            self.ampatch_report = end_session()
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

    def _load_best_model(self) -> None:
        """The best checkpoint's model (its weights file holds the exact FP32 masters: the
        `model.state_dict()` of a model with masters), then its optimizer state, masters
        included, so the optimizer matches the model it goes with (a checkpoint whose weights
        are the half values widened, from before, gets its exact masters from there)."""
        super()._load_best_model()
        session = current()
        best = self.state.best_model_checkpoint
        if (self._amp_optimizer is None or session is None or session.properties.master_mode is MasterMode.NONE
                or best is None):
            return
        path = os.path.join(best, OPTIMIZER_NAME)
        if not os.path.isfile(path):  # save_only_model=True: the weights file alone is exact
            return
        self._amp_optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


class AmpatchTrainer(AmpatchTrainerMixin, transformers.Trainer):
    """`transformers.Trainer` at an ampatch `opt_level` (O0-O5): `AmpatchTrainerMixin` on the
    Trainer itself. After `train()`, the session's `report()` is in `trainer.ampatch_report`.

    Args:
        opt_level: "O0" to "O5", as `amp.initialize`'s. Default: None (the policy's level
            when `policy` is given, else "O2").
        policy: a policy file `ampatch tune` wrote (its path, or its dict). Default: None.
        initialize_kwargs: a dict of `amp.initialize`'s other keywords. Default: None.

    Raises:
        ValueError: the Trainer's own `fp16`/`bf16`, or mixed precision, DeepSpeed or FSDP
            switched on through Accelerate (two AMPs at once).

    Example::

        >>> trainer = AmpatchTrainer(model=model, args=args, train_dataset=ds, opt_level="O2")
        >>> trainer.train(); print(trainer.ampatch_report)
    """
