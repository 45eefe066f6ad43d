"""`AmpatchFabricPrecision`: ampatch's opt levels as a precision plugin of Lightning Fabric.

    fabric = Fabric(plugins=[AmpatchFabricPrecision("O2")])
    model, optimizer = fabric.setup(model, optimizer)
    fabric.backward(loss); fabric.clip_gradients(model, optimizer, max_norm=1.0); optimizer.step()

- `convert_module` (inside `fabric.setup(model, *optimizers)`): the model is moved to
  Fabric's device, then `amp.initialize` runs on it and the optimizers given with it,
  before the strategy wraps it (DDP is built around the cast params). Every later
  `fabric.setup` (a GAN's second network, a frozen teacher) initializes again with all the
  models and optimizers so far: before training that changes no value, and the loss scale
  is carried over;
- `convert_input`/`forward_context` (O2/O3/O5): the batch's floats in the half dtype, and
  tensors made inside the forward half;
- `backward` (`fabric.backward(loss)`): the loss scaled for all the plugin's optimizers
  (Fabric does not say which optimizer a loss is for: an overflow skips the next step of
  each);
- `main_params` (`fabric.clip_gradients`): the FP32 masters; `unscale_gradients` has nothing
  to do (grads are unscaled when the backward ends);
- `state_dict`/`load_state_dict`: the loss scaler; Fabric saves a precision plugin's state
  only when it is in the state given to `fabric.save` (`{"ampatch": plugin, ...}`); the masters
  are in the optimizer's state dict;
- `teardown`: `amp.deinitialize()`, the models FP32 again; the session's `report()` stays in
  `plugin.last_report`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import ampatch as amp

from ..errors import ConfigTypeError, InvalidCallError, OrderError
from ..frameworks.level import end_session
from . import framework
from .common import Facts, PluginAttributes, PluginState, start_plugin

__all__ = ["AmpatchFabricPrecision"]


class AmpatchFabricPrecision(PluginAttributes, framework.FabricHalfPrecision):
    """ampatch at `opt_level` (O0-O5) as the precision plugin of Lightning Fabric.

    Set each model up with its optimizers in one call, `fabric.setup(model, optimizer)`: the
    FP32 masters are made from the FP32 weights then. `fabric.backward(loss)` scales the loss
    for all the plugin's optimizers; `fabric.clip_gradients` clips the masters. A
    `HalfPrecision` to Fabric only so that its throughput utilities ask it the compute dtype.

    Args:
        opt_level: "O0" to "O5", as `amp.initialize`'s. Default: None (the policy's level
            when `policy` is given, else "O2").
        policy: a policy file `ampatch tune` wrote (its path, or its dict). Default: None.
        initialize_kwargs: any other keyword of `amp.initialize` (`half_dtype`, `loss_scale`,
            `keep_fp32`, ...), passed on as given; not `models`, `optimizers`, `opt_level` or
            `policy`.

    Raises:
        TypeError: `opt_level` not a string, or a reserved keyword among `initialize_kwargs`.

    Example::

        >>> fabric = lightning.Fabric(plugins=[AmpatchFabricPrecision("O2")])
        >>> model, optimizer = fabric.setup(model, optimizer)
        >>> fabric.backward(loss); optimizer.step()
    """

    def __init__(self, opt_level: str | None = None, policy: Any = None, **initialize_kwargs: Any) -> None:
        start_plugin(self, "AmpatchFabricPrecision", opt_level, policy, initialize_kwargs)
        self.models: list[nn.Module] = []

    # ------------------------------------------------------------------ set-up
    def convert_module(self, module: nn.Module) -> nn.Module:
        """`amp.initialize` on `module` and the optimizers `fabric.setup` was given with it (and
        the models and optimizers set up before), on Fabric's device."""
        call = framework.fabric_setup_call()
        if call is None:
            raise OrderError("AmpatchFabricPrecision.convert_module runs inside fabric.setup(model, optimizer) "
                             "(or fabric.setup_module(model)): the plugin initializes ampatch there, with the "
                             "optimizers. Set the model up through Fabric.")
        framework.refuse_strategy(call.fabric.strategy, "AmpatchFabricPrecision")
        opts = [framework.raw_optimizer(o) for o in call.optimizers]
        if any(isinstance(o, torch.optim.LBFGS) for o in opts):
            raise ConfigTypeError("AmpatchFabricPrecision cannot drive LBFGS: it calls its closure (and backward) "
                                  "inside step(), where the loss scale cannot reach. Use another optimizer.")
        if call.move_to_device:  # the masters are made where the model trains
            module = call.fabric.to_device(module)
        if any(module is m for m in self.models):
            raise OrderError("AmpatchFabricPrecision: this model was set up already; call fabric.setup once per "
                             "model, with its optimizers.")
        self.models.append(module)
        self.optimizers += [o for o in opts if not any(o is p for p in self.optimizers)]
        self._initialize()
        return module

    def _initialize(self) -> None:
        """`amp.initialize` on every model and optimizer set up so far (the loss scale carried
        over from the session it replaces)."""
        scalers = amp.state_dict() if self.state is PluginState.CONNECTED and self.optimizers[:1] else None
        models = self.models[0] if len(self.models) == 1 else list(self.models)
        keywords = self.choice.keywords()
        if self.optimizers:
            returned, _ = amp.initialize(models, list(self.optimizers), **keywords)
        else:
            returned = amp.initialize(models, **keywords)
        returned = returned if isinstance(returned, list) else [returned]
        if len(returned) != len(self.models) or any(a is not b for a, b in zip(returned, self.models)):
            raise InvalidCallError("amp.initialize returned other model objects; AmpatchFabricPrecision needs them in "
                                   "place.")
        self.state = PluginState.CONNECTED
        self.facts = Facts.of_session()
        framework.set_precision(self, self.facts.precision)
        framework.set_compute_dtype(self, self.facts.compute_dtype)
        if self.optimizers:
            self.checkpoint.resume(self.facts, carried=scalers)

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """Modules and tensors are made in FP32 (`fabric.init_module()`): masters start exact."""
        return contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ steps
    def convert_input(self, data: Any) -> Any:
        """The batch's floats in the half dtype where the models are cast (O2/O3/O5)."""
        return self.facts.convert_input(data)

    def convert_output(self, data: Any) -> Any:
        """As the model returns it: FP32 (or `cast_model_outputs`), ampatch's forward did that."""
        return data

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Around the forward (and `fabric.autocast()`): tensors made inside are half where the
        models are cast."""
        return self.facts.step_context()

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        """`tensor.backward()` inside `amp.scale_loss` for all the plugin's optimizers."""
        if self.state is not PluginState.CONNECTED or not self.optimizers:
            raise OrderError("AmpatchFabricPrecision: fabric.backward needs the optimizers, given to fabric.setup "
                             "with their model: model, optimizer = fabric.setup(model, optimizer) (not "
                             "setup_module + setup_optimizers: the masters must be made before the cast).")
        with amp.scale_loss(tensor, self.optimizers) as scaled:
            scaled.backward(*args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The step, skipped by ampatch after an overflow."""
        if kwargs.get("closure") is not None:
            raise ConfigTypeError("AmpatchFabricPrecision: optimizer.step(closure) runs a backward inside step(), "
                                  "where the loss scale cannot reach; call fabric.backward(loss), then "
                                  "optimizer.step().")
        return optimizer.step(**kwargs)

    # Lightning annotates Parameters; an optimizer's param_groups hold tensors (the masters are Parameters)
    def main_params(self, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:  # type: ignore[override]
        """The params the optimizer steps: the FP32 masters at O2/O5 (what clipping acts on)."""
        return amp.master_params(framework.raw_optimizer(optimizer))

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing: the grads are unscaled (into the masters) when `fabric.backward` ends."""

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The loss scaler (Apex's format); put the plugin in `fabric.save`'s state to keep it."""
        return self.checkpoint.save(self.facts, self._active())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the loss scaler of a checkpoint (kept until the first setup if it comes first)."""
        self.checkpoint.load(state_dict, self.facts, self._active())

    def _active(self) -> bool:
        return self.state is PluginState.CONNECTED and bool(self.optimizers)

    # ------------------------------------------------------------------ end
    def teardown(self) -> None:
        """Undo the session: the models FP32 again (the masters' values), optimizers and torch
        as they were."""
        if self.state is PluginState.CONNECTED:
            self.last_report = end_session()
        self.models, self.optimizers = [], []
        self.state = PluginState.TORN_DOWN
        super().teardown()
