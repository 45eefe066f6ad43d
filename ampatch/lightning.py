"""Lightning 2.x: ampatch's opt levels as a precision plugin.

    trainer = lightning.Trainer(plugins=[AmpatchPrecision("O2")], ...)

Lightning's own precision plugins are autocast ("16-mixed") or pure half without FP32
masters ("16-true"); this one is `amp.initialize` + `amp.scale_loss` driven by Lightning's
hooks, so O2/O5 (half weights, FP32 masters, dynamic loss scale) and every other level
train a LightningModule as a hand-written ampatch loop would:

- `connect` (once the strategy made the optimizers): `amp.initialize` on the bare
  LightningModule and the optimizers. Under DDP the module arrives wrapped; it is
  initialized bare and wrapped again with the same settings (the half params are not the
  FP32 ones DDP's buckets were built for);
- `backward`: the loss is scaled (`amp.scale_loss`) around Lightning's backward, for the
  optimizer being stepped (automatic optimization) or all of them (`manual_backward`);
- `optimizer_step`: the closure runs first, then Lightning's clipping (on the FP32
  masters: `main_params`), then the ampatch step, which is skipped after an overflow.
  A skipped step does not advance the step-interval LR schedulers of that optimizer;
- `state_dict`/`load_state_dict`: the loss scaler, in Lightning checkpoints (masters and
  optimizer state are in the optimizers' own state dicts);
- `teardown`: `amp.deinitialize()`, the schedulers as they were.

Lightning is imported from `lightning.pytorch`, else from `pytorch_lightning`; this module
is imported only by who uses it (never by `import ampatch`).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any

import torch
from torch import nn

import ampatch as amp

from .optim import scheduler_guard as lr_guard
from .patching import Patcher

try:
    from lightning.pytorch.plugins.precision import Precision
except ImportError:  # the standalone package name
    try:
        from pytorch_lightning.plugins.precision import Precision
    except ImportError as exc:
        raise ImportError("ampatch.lightning needs Lightning 2.x: pip install 'ampatch[integrations]' "
                          "(or pip install lightning).") from exc

logger = logging.getLogger("ampatch")

# Keywords the plugin itself decides: the model and optimizers come from Lightning.
RESERVED = ("models", "optimizers")
# DistributedDataParallel settings carried over when the module is wrapped again.
DDP_SETTINGS = ("broadcast_buffers", "find_unused_parameters", "gradient_as_bucket_view", "static_graph")


class PluginState(Enum):
    """Where the plugin is: nothing done yet, an ampatch session running, undone again."""
    IDLE = "idle"
    CONNECTED = "connected"
    TORN_DOWN = "torn down"


def _raw(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind a LightningOptimizer (or the optimizer itself)."""
    return getattr(optimizer, "_optimizer", optimizer)


def _rewrap(ddp: nn.parallel.DistributedDataParallel, module: nn.Module) -> nn.parallel.DistributedDataParallel:
    """A new DDP wrapper around `module` (now initialized) with the settings of `ddp`."""
    settings = {name: getattr(ddp, name) for name in DDP_SETTINGS if hasattr(ddp, name)}
    if "bucket_bytes_cap" in vars(ddp):
        settings["bucket_cap_mb"] = ddp.bucket_bytes_cap / (1024 * 1024)
    return nn.parallel.DistributedDataParallel(module, device_ids=ddp.device_ids, output_device=ddp.output_device,
                                               process_group=ddp.process_group, **settings)


class AmpatchPrecision(Precision):
    """ampatch at `opt_level` (O0-O5) for a Lightning `Trainer`: `plugins=[AmpatchPrecision("O2")]`.

    `policy` (the file `ampatch tune` writes) and any other `amp.initialize` keyword
    (`half_dtype`, `loss_scale`, `keep_fp32`, ...) are passed on to `amp.initialize`.
    One plugin runs one ampatch session at a time (ampatch has one current session).
    """

    precision = "32-true"  # what Lightning itself does to inputs and modules: nothing

    def __init__(self, opt_level: str = "O2", policy: Any = None, **initialize_kwargs: Any) -> None:
        super().__init__()
        if not isinstance(opt_level, str):
            raise TypeError(f"AmpatchPrecision(opt_level) takes a level name such as 'O2', got {opt_level!r}.")
        for name in RESERVED:
            if name in initialize_kwargs:
                raise TypeError(f"AmpatchPrecision got {name}=: Lightning passes the model and optimizers to "
                                "the plugin; give only amp.initialize's other keywords.")
        self.opt_level = opt_level
        self.initialize_kwargs = dict(initialize_kwargs)
        if policy is not None:
            self.initialize_kwargs["policy"] = policy
        self.state = PluginState.IDLE
        self.optimizers: list[torch.optim.Optimizer] = []
        self._pending: dict | None = None  # scaler state loaded before connect
        self._patches = Patcher()  # the schedulers' holds

    # ------------------------------------------------------------------ set-up
    def connect(self, model: nn.Module, optimizers: list[torch.optim.Optimizer],
                lr_schedulers: list[Any]) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """`amp.initialize` the bare module and the strategy's optimizers (DDP wrapped again)."""
        ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
        bare = ddp.module if ddp is not None else model
        opts = [_raw(o) for o in optimizers]
        if any(isinstance(o, torch.optim.LBFGS) for o in opts):  # once, before anything is set up
            raise TypeError("AmpatchPrecision cannot drive LBFGS: it calls its closure (and backward) several "
                            "times inside step(), where the loss scale cannot reach. Use another optimizer, or "
                            "train without the plugin.")
        if opts:
            bare, opts = amp.initialize(bare, opts, opt_level=self.opt_level, **self.initialize_kwargs)
        else:  # validate/test/predict: the model only
            bare = amp.initialize(bare, opt_level=self.opt_level, **self.initialize_kwargs)
        self.optimizers = list(opts)
        self.state = PluginState.CONNECTED
        if self._pending is not None:
            amp.load_state_dict(self._pending)
            self._pending = None
        self._guard_schedulers(lr_schedulers)
        return (_rewrap(ddp, bare) if ddp is not None else bare), list(opts), lr_schedulers

    def _guard_schedulers(self, configs: list[Any]) -> None:
        """Step-interval schedulers of the plugin's optimizers hold still after a skipped step."""
        self._restore_schedulers()
        for config in configs:
            scheduler = getattr(config, "scheduler", config)
            optimizer = getattr(scheduler, "optimizer", None)
            if getattr(config, "interval", "step") == "step" and any(optimizer is o for o in self.optimizers):
                lr_guard.hold_on_skip(scheduler, functools.partial(self._skipped, optimizer), self._patches)

    def _skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        return self.state is PluginState.CONNECTED and amp.last_step_skipped(optimizer)

    def _restore_schedulers(self) -> None:
        self._patches.restore_all()

    # ------------------------------------------------------------------ training
    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """Lightning's backward inside `amp.scale_loss` for `optimizer` (all of the plugin's
        optimizers under manual optimization, where Lightning names none)."""
        if self.state is not PluginState.CONNECTED or not self.optimizers:
            raise RuntimeError("AmpatchPrecision.backward ran before connect(): the plugin initializes ampatch "
                               "when the Trainer sets up its optimizers; use it through Trainer(plugins=[...]).")
        opts = _raw(optimizer) if optimizer is not None else self.optimizers  # one: scale_loss's short path
        with amp.scale_loss(tensor, opts) as scaled:
            model.backward(scaled, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run the closure (forward and scaled backward), Lightning's clipping on the masters,
        then the step (skipped by ampatch after an overflow). The closure cannot go into
        `step(closure)`: its backward would bypass the loss scale."""
        closure_result = closure()
        self._after_closure(model, optimizer)
        if closure_result is None and getattr(model, "automatic_optimization", True):
            return None  # training_step returned None: no backward, no step (as Lightning's own plugins)
        return optimizer.step(**kwargs)

    def main_params(self, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """The params the optimizer steps: the FP32 masters at O2/O5 (clip these)."""
        return amp.master_params(_raw(optimizer))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The loss scaler (Apex's format), for Lightning's checkpoint."""
        if self.state is not PluginState.CONNECTED:
            return {}
        return {"opt_level": self.opt_level, "loss_scalers": amp.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the loss scaler of a checkpoint (kept until connect if it comes first)."""
        if not state_dict:
            return
        if "loss_scalers" not in state_dict:
            raise ValueError("AmpatchPrecision.load_state_dict: this checkpoint entry was not written by "
                             f"AmpatchPrecision (keys {sorted(state_dict)}).")
        if state_dict.get("opt_level") != self.opt_level:
            logger.warning("ampatch: resuming an %s checkpoint at %s; its loss scale is loaded as it is.",
                           state_dict.get("opt_level"), self.opt_level)
        if self.state is PluginState.CONNECTED:
            amp.load_state_dict(state_dict["loss_scalers"])
        else:
            self._pending = state_dict["loss_scalers"]

    # ------------------------------------------------------------------ end
    def teardown(self) -> None:
        """Undo the session: the model back in FP32 (the masters' values), optimizers and torch
        as they were, schedulers unguarded."""
        self._restore_schedulers()
        if self.state is PluginState.CONNECTED:
            amp.deinitialize()
        self.optimizers = []
        self.state = PluginState.TORN_DOWN
        super().teardown()
