"""`AmpatchPrecision`: ampatch's opt levels as a precision plugin of Lightning's `Trainer`.

    trainer = lightning.Trainer(plugins=[AmpatchPrecision("O2")], ...)

The plugin drives `amp.initialize` + `amp.scale_loss` from Lightning's hooks:

- `convert_module`: refuses the strategies that own precision (DeepSpeed, FSDP1, XLA;
  ModelParallelStrategy runs: it shards with FSDP2 in `configure_model`, before `connect`);
  the module stays FP32 until `connect`;
- `connect` (once the strategy made the optimizers): `amp.initialize` on the bare
  LightningModule and, when fitting, the optimizers (an evaluation stage initializes the
  model alone: the report at exit keeps the training steps). Under DDP the module arrives
  wrapped; it is initialized bare and wrapped again with the same settings. Where master
  weights exist, `toggle_optimizer`/`untoggle_optimizer` are made to act on the model's
  params too (they set `requires_grad` on the optimizers' params, the masters). Where the
  module is cast, its direct children with half params take half inputs (step code calls
  them directly: `self.discriminator(self(z))`);
- `convert_input`, `train_step_context`/`forward_context` (O2/O3/O5): the batch's floats in
  the half dtype, and tensors made inside the step half (the default dtype);
- `backward`: the loss scaled (`amp.scale_loss`) around Lightning's backward, for the
  optimizer being stepped (automatic optimization) or all of them (`manual_backward`);
- `optimizer_step`: the closure, the hooks (the model's grads there are copies of the
  masters', `common.HookGrads`), Lightning's clipping on the masters (`main_params`), then
  the step, skipped after an overflow; the schedulers of a skipped step hold still;
- `state_dict`/`load_state_dict`: the loss scaler in Lightning's checkpoints;
- `teardown`: `amp.deinitialize()`, the model FP32 again on the device it is on now; the
  session's `report()` stays in `plugin.last_report`.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import ampatch as amp

from ..base.patcher import Patcher
from ..errors import ConfigTypeError, OrderError
from ..frameworks import scheduler_guard
from ..frameworks.level import end_session
from ..model.default_dtype import fp32_default
from ..model.forwards import InputCast, install_forward, is_wrapped
from . import framework
from .common import Facts, HookGrads, PluginAttributes, PluginState, pairs_of, start_plugin, sync_requires_grad

__all__ = ["AmpatchPrecision"]

# DistributedDataParallel settings carried over when the module is wrapped again.
DDP_SETTINGS = ("broadcast_buffers", "find_unused_parameters", "gradient_as_bucket_view", "static_graph")
# Hooks that see the model's grads between backward and step (HookGrads lends them copies).
GRAD_HOOKS = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping")


def _rewrap(ddp: nn.parallel.DistributedDataParallel, module: nn.Module) -> nn.parallel.DistributedDataParallel:
    """A new DDP wrapper around `module` (now initialized) with the settings of `ddp`."""
    settings = {name: getattr(ddp, name) for name in DDP_SETTINGS if hasattr(ddp, name)}
    if "bucket_bytes_cap" in vars(ddp):
        settings["bucket_cap_mb"] = ddp.bucket_bytes_cap / (1024 * 1024)
    return nn.parallel.DistributedDataParallel(module, device_ids=ddp.device_ids, output_device=ddp.output_device,
                                               process_group=ddp.process_group, **settings)


def _trainer(module: nn.Module) -> Any:
    """The Trainer attached to `module`, or None (not a LightningModule, or none attached)."""
    if not isinstance(module, framework.LightningModule):
        return None
    try:
        return module.trainer
    except RuntimeError:  # "is not attached to a `Trainer`"
        return None


def _fitting(module: nn.Module) -> bool:
    """Whether the Trainer attached to `module` is fitting (else: validate, test, predict)."""
    trainer = _trainer(module)
    return trainer is None or trainer.state.fn == framework.TrainerFn.FITTING


class AmpatchPrecision(PluginAttributes, framework.TrainerHalfPrecision):
    """ampatch at `opt_level` (O0-O5) as the precision plugin of a Lightning `Trainer`.

    The plugin runs `amp.initialize` when the Trainer has made the optimizers, `amp.scale_loss`
    around each backward, and `amp.deinitialize` at teardown (the module's docstring lists
    each hook). One plugin runs one ampatch session at a time (ampatch has one current
    session). A `HalfPrecision` to Lightning only so that its ThroughputMonitor asks it the
    compute dtype; `precision` says what the weights are once the session runs ("32-true"
    before).

    Args:
        opt_level: "O0" to "O5", as `amp.initialize`'s. Default: None (the policy's level
            when `policy` is given, else "O2").
        policy: a policy file `ampatch tune` wrote (its path, or its dict). Default: None.
        initialize_kwargs: any other keyword of `amp.initialize` (`half_dtype`, `loss_scale`,
            `keep_fp32`, `master_weights`, ...), passed on as given; not `models`,
            `optimizers`, `opt_level` or `policy`.

    Raises:
        TypeError: `opt_level` not a string, or a reserved keyword among `initialize_kwargs`
            (a bad value of a keyword is `amp.initialize`'s error, at `connect`).

    Example::

        >>> trainer = lightning.Trainer(plugins=[AmpatchPrecision("O2", keep_fp32=["head"])])
        >>> trainer.fit(model)
        >>> print(trainer.precision_plugin.last_report)  # the session's report(), after teardown
    """

    def __init__(self, opt_level: str | None = None, policy: Any = None, **initialize_kwargs: Any) -> None:
        start_plugin(self, "AmpatchPrecision", opt_level, policy, initialize_kwargs)
        self._patches = Patcher()  # the schedulers' holds, the module's toggling
        self._listens = False  # a hook reads the model's grads between backward and step
        self._lent: HookGrads | None = None  # the grads lent to the model during optimizer_step's hooks

    # ------------------------------------------------------------------ set-up
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Nothing yet (the cast happens in `connect`, with the optimizers); refuses the
        strategies ampatch cannot run beside."""
        trainer = _trainer(module)
        if trainer is not None:
            framework.refuse_strategy(trainer.strategy, "AmpatchPrecision")
        return module

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """Modules and tensors are made in FP32 (the masters start from FP32 weights)."""
        return contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def connect(self, model: nn.Module, optimizers: list[torch.optim.Optimizer],
                lr_schedulers: list[Any]) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """`amp.initialize` the bare module and, when fitting, the strategy's optimizers (DDP
        wrapped again). Evaluation stages initialize the module alone and hand the
        optimizers (left over from a fit) back untouched."""
        ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
        bare = ddp.module if ddp is not None else model
        fitting = _fitting(bare)
        opts = [framework.raw_optimizer(o) for o in optimizers] if fitting else []
        if any(isinstance(o, torch.optim.LBFGS) for o in opts):  # once, before anything is set up
            raise ConfigTypeError("AmpatchPrecision cannot drive LBFGS: it calls its closure (and backward) several "
                                  "times inside step(), where the loss scale cannot reach. Use another optimizer, or "
                                  "train without the plugin.")
        self._patches.restore_all()
        keywords = self.choice.keywords()
        if opts:
            bare, opts = amp.initialize(bare, opts, **keywords)
        else:
            bare = amp.initialize(bare, **keywords)
        self.optimizers = list(opts)
        self.state = PluginState.CONNECTED
        self.facts = Facts.of_session()
        framework.set_precision(self, self.facts.precision)
        framework.set_compute_dtype(self, self.facts.compute_dtype)
        self.checkpoint.resume(self.facts)
        self._cast_child_inputs(bare)
        if fitting:
            self._guard_schedulers(bare, lr_schedulers)
            self._toggle_on_model(bare)
            self._listens = self._hooks_read_grads(bare)
        wrapped = _rewrap(ddp, bare) if ddp is not None else bare
        return wrapped, (list(opts) if fitting else optimizers), lr_schedulers

    def _cast_child_inputs(self, module: nn.Module) -> None:
        """Where the module is cast, its direct children holding half params take their
        floating inputs in half: step code calls them directly, and may hand them what the
        module's own forward returned in FP32 (`self.discriminator(self(z))`)."""
        dtype = self.facts.cast_dtype
        if dtype is None:
            return
        for child in module.children():
            if not is_wrapped(child) and any(p.dtype == dtype for p in child.parameters()):
                install_forward(child, InputCast(child.forward, dtype), self._patches)

    def _guard_schedulers(self, module: nn.Module, configs: list[Any]) -> None:
        """The plugin's optimizers' schedulers hold still after a skipped step: those with
        `interval="step"` (automatic optimization), all of them under manual optimization
        (the step's code calls `sch.step()` itself). Each is held once."""
        manual = not getattr(module, "automatic_optimization", True)
        for config in configs:
            scheduler = getattr(config, "scheduler", config)
            optimizer = getattr(scheduler, "optimizer", None)
            if (optimizer is None or not any(optimizer is o for o in self.optimizers)
                    or (scheduler, "step") in self._patches):
                continue
            if manual or getattr(config, "interval", "step") == "step":
                scheduler_guard.hold_on_skip(scheduler, functools.partial(self._skipped, optimizer), self._patches)

    def _skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        return self.state is PluginState.CONNECTED and amp.last_step_skipped(optimizer)

    def _toggle_on_model(self, module: nn.Module) -> None:
        """Lightning's `toggle_optimizer(opt)` sets `requires_grad` on the params in the
        optimizers' param_groups, the FP32 masters at O2/O5: it is made to set the model's
        half params alike (read from the model first), so another optimizer's half params get
        no grads from this backward, as without ampatch."""
        if not isinstance(module, framework.LightningModule) or not pairs_of(self.optimizers):
            return
        for name in ("toggle_optimizer", "untoggle_optimizer"):
            self._patches.patch(module, name, functools.partial(self._toggled, getattr(module, name)))

    def _toggled(self, own: Callable[[Any], None], optimizer: Any) -> None:
        pairs = pairs_of(self.optimizers)
        sync_requires_grad(pairs, to_model=False)
        own(optimizer)
        sync_requires_grad(pairs, to_model=True)

    def _hooks_read_grads(self, module: nn.Module) -> bool:
        """Whether a hook of the module or a callback may read the model's grads between
        backward and step (only then are the masters' grads lent to the model)."""
        if not pairs_of(self.optimizers):
            return False
        trainer = _trainer(module)
        callbacks = list(trainer.callbacks) if trainer is not None else []
        return (any(framework.is_overridden(h, module, parent=framework.LightningModule) for h in GRAD_HOOKS)
                or any(framework.is_overridden(h, c, parent=framework.Callback) for c in callbacks
                       for h in GRAD_HOOKS[:2]))

    # ------------------------------------------------------------------ steps
    def convert_input(self, data: Any) -> Any:
        """The batch's floats in the half dtype where the model is cast (O2/O3/O5)."""
        return self.facts.convert_input(data)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Around each step: tensors made inside are half where the model is cast."""
        with self.facts.step_context():
            yield

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """Lightning's backward inside `amp.scale_loss` for `optimizer` (all of the plugin's
        optimizers under manual optimization, where Lightning names none)."""
        if self.state is not PluginState.CONNECTED or not self.optimizers:
            raise OrderError("AmpatchPrecision.backward ran before connect(): the plugin initializes ampatch "
                             "when the Trainer sets up its optimizers; use it through Trainer(plugins=[...]).")
        opts = framework.raw_optimizer(optimizer) if optimizer is not None else self.optimizers
        with fp32_default(), amp.scale_loss(tensor, opts) as scaled:  # (manual_backward: inside the step)
            model.backward(scaled, *args, **kwargs)

    def post_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        """Lightning's `on_after_backward` hooks, seeing the masters' grads on the model."""
        with self._grads_for_hooks():
            return super().post_backward(tensor, module)

    def optimizer_step(  # type: ignore[override]  # Lightning's own Precision.optimizer_step: same signature, same ignore
            self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run the closure (forward and scaled backward), the hooks and Lightning's clipping on
        the masters, then the step (skipped by ampatch after an overflow). The closure cannot
        go into `step(closure)`: its backward would bypass the loss scale."""
        closure_result = closure()
        with self._grads_for_hooks() as lent:
            self._lent = lent
            try:  # Lightning's own (Precision._after_closure): on_before_optimizer_step hooks, then clipping
                self._after_closure(model, optimizer)
            finally:
                self._lent = None
        if closure_result is None and getattr(model, "automatic_optimization", True):
            return None  # training_step returned None: no backward, no step (as Lightning's own plugins)
        with fp32_default():  # (manual optimization steps inside the step)
            return optimizer.step(**kwargs)

    @contextlib.contextmanager
    def _grads_for_hooks(self) -> Iterator[HookGrads | None]:
        if not self._listens:
            yield None
            return
        with HookGrads.lent_for(pairs_of(self.optimizers)) as lent:
            yield lent

    def clip_gradients(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        """Lightning's clipping, on the masters (`main_params`); the grads lent to the model for
        the hooks go back first, with what the hooks changed in them."""
        if self._lent is not None:
            self._lent.close()
        super().clip_gradients(optimizer, *args, **kwargs)

    # Lightning annotates Parameters; an optimizer's param_groups hold tensors (the masters are Parameters)
    def main_params(self, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:  # type: ignore[override]
        """The params the optimizer steps: the FP32 masters at O2/O5 (clip these)."""
        return amp.master_params(framework.raw_optimizer(optimizer))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The loss scaler (Apex's format), for Lightning's checkpoint."""
        return self.checkpoint.save(self.facts, self.state is PluginState.CONNECTED and bool(self.optimizers))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the loss scaler of a checkpoint (kept until connect if it comes first)."""
        self.checkpoint.load(state_dict, self.facts, self.state is PluginState.CONNECTED)

    # ------------------------------------------------------------------ end
    def teardown(self) -> None:
        """Undo the session: the model back in FP32 (the masters' values) on the device it is
        on now, optimizers and torch as they were, schedulers and toggling unpatched."""
        self._patches.restore_all()
        if self.state is PluginState.CONNECTED:
            self.last_report = end_session()
        self.optimizers = []
        self._listens = False
        self.state = PluginState.TORN_DOWN
        super().teardown()
